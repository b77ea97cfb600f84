"""What a new spec author hits, on real vLLM files: each case refused or correct, nothing written on a refusal.

Chains of specs on one file, names nothing defines, ``${call_args}`` outside
prepend_to_body, errors inside an operation, manifest entries whose spec is not loaded,
a piped ``diff`` that must be a patch, hints that must run as printed, specs over several
files, and commands that must not import libcst.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp32patch.patcher import ops
from fp32patch.patcher.spec import load_specs
from fp32patch.patcher.transform import transform
from tests.conftest import NEMOTRON, sha, tree_digest
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

SHIPPED = Path(__file__).parent.parent / "fp32patch" / "patches"
LOGITS = "vllm/model_executor/layers/logits_processor.py"

# A second spec on NemotronH's file, as a contributor would write it: its own gate, its own edits.
SECOND = """
schema = 1
id = "demo-second"
summary = "a second patch on the same file"
[target]
distribution = "vllm"
path = "vllm/model_executor/models/nemotron_h.py"
[[edits]]
id = "flag"
op = "insert_after_imports"
code = "_DEMO_SECOND = 2"
[[edits]]
id = "use-flag"
op = "prepend_to_body"
scope = "NemotronHForCausalLM.compute_logits"
code = "_demo = _DEMO_SECOND"
"""

# route-compute-logits copied without the runtime-gate edit that defines its helper
NO_GATE = '''
schema = 1
id = "no-gate"
summary = "calls a helper nothing defines"
[target]
distribution = "vllm"
path = "vllm/model_executor/models/nemotron_h.py"
[[edits]]
id = "route"
op = "prepend_to_body"
scope = "NemotronHForCausalLM.compute_logits"
code = """
_rt = _fp32patch_lm_head_runtime()
if _rt is not None:
    return _rt.compute_logits(self, ${call_args})
"""
'''


def _root(tmp_path: Path, members=(NEMOTRON,), version: str = "0.25.1") -> Path:
    return import_root_from_members("vllm", version, list(members), tmp_path / "site-packages")


def _specs(tmp_path: Path, *extra: str, shipped: bool = True) -> Path:
    folder = tmp_path / "specs"
    folder.mkdir(exist_ok=True)
    if shipped:
        for f in SHIPPED.glob("*.toml"):
            shutil.copy(f, folder / f.name)
        if (SHIPPED / "snippets").is_dir():
            shutil.copytree(SHIPPED / "snippets", folder / "snippets", dirs_exist_ok=True)
    for i, text in enumerate(extra):
        (folder / f"zz-extra-{i}.toml").write_text(text)
    return folder


def _statuses(cli, *args) -> tuple[int, dict[str, str]]:
    code, data = cli.json(*args)
    return code, {p["id"]: p["status"] for p in data["patches"]}


# ---------------------------------------------------------------- 1. two specs on one file


def test_two_specs_on_one_file_form_one_chain(tmp_path, cli):
    root = _root(tmp_path)
    original = (root / NEMOTRON).read_bytes()
    specs = _specs(tmp_path, SECOND)
    code, st = _statuses(
        cli, "apply", "-s", root, "--specs", specs, "--patch", "nemotron-h-fp32-lm-head", "--patch", "demo-second"
    )
    assert code == 0 and st == {"nemotron-h-fp32-lm-head": "applied", "demo-second": "applied"}
    text = (root / NEMOTRON).read_text()
    assert "[route-compute-logits]" in text and "[use-flag]" in text  # both, not only the second
    code, st = _statuses(
        cli, "verify", "-s", root, "--specs", specs, "--patch", "nemotron-h-fp32-lm-head", "--patch", "demo-second"
    )
    assert code == 0 and set(st.values()) == {"applied"}

    # reverting one keeps the other, byte for byte as if it alone had been applied
    loaded = {s.id: s for s in load_specs(specs)}
    alone = transform(loaded["demo-second"], original, version="0.25.1").new
    code, st = _statuses(cli, "revert", "-s", root, "--specs", specs, "--patch", "nemotron-h-fp32-lm-head")
    assert code == 0 and st["nemotron-h-fp32-lm-head"] == "reverted"
    assert (root / NEMOTRON).read_bytes() == alone
    code, st = _statuses(cli, "verify", "-s", root, "--specs", specs, "--patch", "demo-second")
    assert code == 0 and st == {"demo-second": "applied"}
    # and back: apply the first again on top, then revert everything: the original, exactly
    assert cli("apply", "-s", root, "--specs", specs, "--patch", "nemotron-h-fp32-lm-head").exit_code == 0
    assert (
        cli(
            "verify", "-s", root, "--specs", specs, "--patch", "nemotron-h-fp32-lm-head", "--patch", "demo-second"
        ).exit_code
        == 0
    )
    assert cli("revert", "-s", root, "--specs", specs).exit_code == 0
    assert (root / NEMOTRON).read_bytes() == original


# ---------------------------------------------------------------- 2. undefined names


def test_inserted_code_using_an_undefined_name_is_refused(tmp_path, cli):
    root = _root(tmp_path)
    before = tree_digest(root)
    result = cli("apply", "-s", root, "--specs", _specs(tmp_path, NO_GATE, shipped=False))
    message = " ".join(result.output.split())
    assert result.exit_code == 3, message
    assert "undefined-name" in message and "_fp32patch_lm_head_runtime" in message and "edit route" in message
    assert tree_digest(root) == before


def test_a_gate_edit_of_the_same_spec_is_suggested(tmp_path):
    spec_text = (SHIPPED / "nemotron-h-fp32-lm-head.toml").read_text()
    folder = tmp_path / "one"
    shutil.copytree(SHIPPED / "snippets", folder / "snippets")
    # the same spec with its gate edit left out in a variant: the refusal points at it
    (folder / "s.toml").write_text(
        spec_text.replace(
            '[[variants]]\nname = "hidden-states-only"',
            '[[variants]]\nname = "hidden-states-only"\nomit = ["runtime-gate"]',
        )
    )
    spec = load_specs(folder)[0]
    data = (_root(tmp_path) / NEMOTRON).read_bytes()
    result = transform(spec, data, version="0.25.1")
    assert result.status == "undefined-name"
    assert "edit runtime-gate defines it" in result.message


# ---------------------------------------------------------------- 3. ${call_args} and errors inside an operation


def test_call_args_where_it_cannot_mean_anything_is_refused_at_load(tmp_path, cli):
    bad = NO_GATE.replace(
        'op = "prepend_to_body"\nscope = "NemotronHForCausalLM.compute_logits"', 'op = "insert_after_imports"'
    )
    result = cli("verify", "-s", _root(tmp_path), "--specs", _specs(tmp_path, bad, shipped=False))
    assert result.exit_code == 2
    assert "edits[0].code: ${call_args} cannot mean anything in insert_after_imports" in " ".join(result.stderr.split())


@pytest.mark.parametrize("command", ["apply", "verify", "check"])
def test_call_args_in_insert_before_is_the_enclosing_functions(tmp_path, cli, command):
    spec = """
schema = 1
id = "before-call"
summary = "s"
[target]
distribution = "vllm"
path = "vllm/model_executor/models/nemotron_h.py"
[[edits]]
id = "log-call"
op = "insert_before"
scope = "NemotronHForCausalLM.compute_logits"
match = "return logits"
code = "print(${call_args})"
"""
    root = _root(tmp_path)
    specs = _specs(tmp_path, spec, shipped=False)
    args = ["--against", root] if command == "check" else ["-s", root]
    result = cli(command, *args, "--specs", specs)
    assert result.exit_code in (0, 1), result.output  # verify of an unpatched root is 1; never a traceback
    if command == "apply":
        assert "print(hidden_states)" in (root / NEMOTRON).read_text()


def test_an_error_inside_an_operation_is_a_refusal_naming_patch_and_edit(tmp_path, cli, monkeypatch):
    def broken(self, module, edit, spec_id):
        raise RuntimeError("boom")

    monkeypatch.setattr(ops.PrependToBody, "plan", broken)
    root = _root(tmp_path)
    before = tree_digest(root)
    code, data = cli.json("apply", "-s", root, "--patch", "nemotron-h-fp32-lm-head")
    entry = data["patches"][0]
    assert code == 3 and entry["status"] == "edit-failed"
    assert "nemotron-h-fp32-lm-head" in entry["message"] and "edit route-compute-logits" in entry["message"]
    assert "RuntimeError: boom" in entry["message"]
    assert tree_digest(root) == before


# ---------------------------------------------------------------- 4. entries whose spec is not loaded


def test_an_entry_whose_spec_is_not_loaded_fails_verify_and_reverts_without_it(tmp_path, cli):
    root = _root(tmp_path)
    original = (root / NEMOTRON).read_bytes()
    specs = _specs(tmp_path, SECOND)
    assert cli("apply", "-s", root, "--specs", specs, "--patch", "demo-second").exit_code == 0
    code, data = cli.json("verify", "-s", root)
    rows = {p["id"]: p for p in data["patches"]}
    assert code == 1 and rows["demo-second"]["status"] == "spec-not-loaded"
    assert f"fp32patch revert -s {root} --patch demo-second" in rows["demo-second"]["message"]
    code, data = cli.json("revert", "-s", root, "--patch", "demo-second")  # the hint, as printed
    assert code == 0 and {p["id"]: p["status"] for p in data["patches"]}["demo-second"] == "reverted"
    assert (root / NEMOTRON).read_bytes() == original
    assert cli("status", "-s", root).exit_code == 0


# ---------------------------------------------------------------- 5. piped diff is a patch


def test_piped_diff_is_a_patch_that_patch_applies(tmp_path):
    root = _root(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(root, copy)
    env = {**os.environ, "NO_COLOR": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "fp32patch", "diff", "-s", str(root)], capture_output=True, env=env, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(b"--- a/"), run.stdout[:200]
    assert b"nemotron-h-fp32-lm-head" in run.stderr  # the table went to stderr
    subprocess.run(["patch", "-p1", "-s"], input=run.stdout, cwd=copy, check=True)
    assert (
        subprocess.run([sys.executable, "-m", "fp32patch", "apply", "-s", str(root)], capture_output=True).returncode
        == 0
    )
    assert (copy / NEMOTRON).read_bytes() == (root / NEMOTRON).read_bytes()


# ---------------------------------------------------------------- 6. help


@pytest.mark.parametrize("command", ["apply", "verify", "revert", "diff", "status", "check", "list", "ops"])
def test_help_shows_no_python_types(cli, command):
    text = cli(command, "--help").output
    assert "<bool>" not in text and "list[" not in text and "<path" not in text.lower(), text


# ---------------------------------------------------------------- 7. hints


def test_outdated_hint_names_the_spec_change_and_runs_as_printed(tmp_path, cli):
    root = _root(tmp_path)
    specs = _specs(tmp_path)
    assert cli("apply", "-s", root, "--specs", specs, "--patch", "nemotron-h-fp32-lm-head").exit_code == 0
    path = specs / "nemotron-h-fp32-lm-head.toml"
    path.write_text(path.read_text().replace('summary = "', 'summary = "(changed) '))
    code, data = cli.json("verify", "-s", root, "--specs", specs, "--patch", "nemotron-h-fp32-lm-head")
    entry = data["patches"][0]
    assert code == 1 and entry["status"] == "outdated"
    assert "earlier version of this spec" in entry["message"] and "fp32patch 0.1.0" not in entry["message"]
    printed = [part.split("`")[0] for part in entry["message"].split("`")[1::2]]
    assert printed[0].startswith(f"fp32patch revert -s {root} --specs {specs}")
    for command in printed:  # the hint runs as printed
        args = command.split()[1:]
        assert cli(*args).exit_code == 0, command
    assert _statuses(cli, "verify", "-s", root, "--specs", specs, "--patch", "nemotron-h-fp32-lm-head")[0] == 0


def test_a_misspelt_scope_gets_did_you_mean(tmp_path):
    text = (
        (SHIPPED / "nemotron-h-fp32-lm-head.toml")
        .read_text()
        .replace('scope = "NemotronHForCausalLM.load_weights"', 'scope = "NemotronHForCausalLM.load_weight"')
    )
    folder = tmp_path / "s"
    shutil.copytree(SHIPPED / "snippets", folder / "snippets")
    (folder / "s.toml").write_text(text)
    result = transform(load_specs(folder)[0], (_root(tmp_path) / NEMOTRON).read_bytes(), version="0.25.1")
    assert result.status == "anchor-missing"
    assert "did you mean NemotronHForCausalLM.load_weights?" in result.message


def test_spec_messages_use_toml_words_and_unknown_fields_come_first(tmp_path, cli):
    spec = SECOND.replace(
        'scope = "NemotronHForCausalLM.compute_logits"', 'scoop = "NemotronHForCausalLM.compute_logits"'
    )
    result = cli("list", "--specs", _specs(tmp_path, spec, shipped=False))
    message = " ".join(result.stderr.split())
    assert result.exit_code == 2 and "edits[1].scoop: unknown field (did you mean 'scope'?" in message
    (tmp_path / "specs" / "zz-extra-0.toml").write_text(SECOND.replace("[target]", "target = [1]\n[other]"))
    message = " ".join(cli("list", "--specs", tmp_path / "specs").stderr.split())
    assert "dict" not in message and "list" not in message.replace("`list`", "")


# ---------------------------------------------------------------- several files in one patch


TWO_FILES = """
schema = 1
id = "two-files"
summary = "one patch over two files"
[target]
distribution = "vllm"
files = { model = "vllm/model_executor/models/nemotron_h.py", logits = "vllm/model_executor/layers/logits_processor.py" }
[[edits]]
id = "model-flag"
file = "model"
op = "insert_after_imports"
code = "_TWO_FILES_MODEL = 1"
[[edits]]
id = "logits-flag"
file = "logits"
op = "insert_after_imports"
code = "_TWO_FILES_LOGITS = 1"
"""


def test_a_patch_over_two_files_is_applied_verified_and_reverted_as_one(tmp_path, cli):
    root = _root(tmp_path, members=(NEMOTRON, LOGITS))
    before = tree_digest(root)
    originals = {p: sha(root / p) for p in (NEMOTRON, LOGITS)}
    specs = _specs(tmp_path, TWO_FILES, shipped=False)
    code, data = cli.json("apply", "-s", root, "--specs", specs)
    assert code == 0 and data["patches"][0]["status"] == "applied"
    assert "_TWO_FILES_LOGITS" in (root / LOGITS).read_text() and "_TWO_FILES_MODEL" in (root / NEMOTRON).read_text()
    code, data = cli.json("verify", "-s", root, "--specs", specs)
    assert code == 0 and [f["recorded"] for f in data["patches"][0]["files"]] == [True, True]
    # one file changed by hand: the patch is drifted as a whole
    (root / LOGITS).write_text((root / LOGITS).read_text() + "\n# local change\n")
    code, data = cli.json("verify", "-s", root, "--specs", specs)
    assert code == 1 and data["patches"][0]["status"] == "drifted"
    assert cli("revert", "-s", root, "--specs", specs).exit_code == 3
    assert cli("revert", "-s", root, "--specs", specs, "--force").exit_code == 0
    assert {p: sha(root / p) for p in originals} == originals
    assert {k: v for k, v in tree_digest(root).items() if not k.startswith(".fp32patch")} == before


def test_a_missing_second_file_is_a_refusal_naming_it(tmp_path, cli):
    root = _root(tmp_path)  # nemotron_h.py only
    before = tree_digest(root)
    code, data = cli.json("apply", "-s", root, "--specs", _specs(tmp_path, TWO_FILES, shipped=False))
    entry = data["patches"][0]
    assert code == 3 and entry["status"] == "anchor-missing" and LOGITS in entry["message"]
    assert tree_digest(root) == before


# ---------------------------------------------------------------- 8. light commands


@pytest.mark.parametrize("args", [["--version"], ["list"], ["verify"], ["status"]])
def test_commands_that_only_hash_import_no_libcst(tmp_path, args):
    root = _root(tmp_path)
    subprocess.run([sys.executable, "-m", "fp32patch", "apply", "-s", str(root)], check=True, capture_output=True)
    extra = ["-s", str(root)] if args[0] in ("verify", "status") else []
    run = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "fp32patch", *args, *extra], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert not any(name.split(".")[0] in ("libcst", "torch", "vllm") for name in imported)


def test_ops_lists_every_operation_and_field(cli):
    code, data = cli.json("ops")
    names = {op["name"] for op in data["operations"]}
    assert code == 0 and names == set(ops.PLANNERS)
    for field in ("count", "regex", "catches", "skip_when", "code_file", "file"):
        assert field in data["fields"]
    assert "${call_args}" in data["fields"]["code"]
    assert json.dumps(data)  # plain JSON
