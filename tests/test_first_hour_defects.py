"""The five defects a newcomer met in the first hour (issue 30), on real vLLM 0.25.1 files.

1. a patched file whose state folder is gone (a multi-stage image that copied only ``vllm/``
   and its dist-info, or a state folder moved aside): ``unrecorded``, never ``applied`` or a
   revert that answers ok; ``revert --against`` puts back the stock bytes it can prove;
2. ``apply`` over a hand-edited patched file says ``drifted``, as ``verify`` does;
3. (the install route: tests/test_first_hour_install.py);
4. a failing ``verify`` says why, with the command that fixes it; totals count every row;
5. ``-s VENV`` given a venv's (or a conda env's) own folder works on its site-packages.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from fp32patch.patcher.spec import load_specs
from tests.conftest import LOGITS_PROCESSOR, NEMOTRON, tree_digest
from tests.support.pypi import import_root_from_members, member_files

pytestmark = pytest.mark.network

VLLM_PATCHES = ("nemotron-h-fp32-lm-head", "vllm-fp32-logits")
STATE = ".fp32patch"


def _text(result) -> str:
    return " ".join((result.stdout + result.stderr).split())


def _ours(out: dict) -> dict[str, dict]:
    return {p["id"]: p for p in out["patches"] if p["id"] in VLLM_PATCHES}


@pytest.fixture
def unrecorded(vllm_root, cli, tmp_path) -> Path:
    """Patched, then its state folder moved aside (what the manifest-error message advised)."""
    assert cli("apply", "-s", vllm_root).exit_code == 0
    shutil.move(vllm_root / STATE, tmp_path / "state-aside")
    return vllm_root


def _wheel(folder: Path, version: str = "0.25.1") -> Path:
    """A wheel laid out as PyPI's, holding the release's real target files and dist-info."""
    path = folder / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, src in member_files("vllm", version, [NEMOTRON, LOGITS_PROCESSOR]).items():
            wheel.writestr(name, src.read_bytes())
    return path


# ---------------------------------------------------------------- 1. patched, but no record


def test_verify_names_a_patched_file_without_a_record(unrecorded, cli):
    result = cli("verify", "-s", unrecorded)
    assert result.exit_code == 1
    code, out = cli.json("verify", "-s", unrecorded)
    assert code == 1 and not out["ok"]
    for patch in _ours(out).values():
        assert patch["status"] == "unrecorded"
        assert patch["exact"] is True  # the bytes are exactly what this spec writes
        assert patch["record_row"] == "matches"  # and the RECORD row apply rewrote agrees
    text = _text(result)
    assert "no record" in text and "exactly what this spec writes" in text
    assert "--against" in text  # the way back is named


def test_verify_tells_an_edited_unrecorded_file_from_an_exact_one(unrecorded, cli):
    target = unrecorded / NEMOTRON
    gate = b"_fp32patch_runtime = _fp32patch_lm_head_runtime()"
    target.write_bytes(target.read_bytes().replace(gate, b"_fp32patch_runtime = None", 1))  # our code, edited
    code, out = cli.json("verify", "-s", unrecorded)
    assert code == 1
    got = _ours(out)
    assert got["nemotron-h-fp32-lm-head"]["status"] == "unrecorded"
    assert got["nemotron-h-fp32-lm-head"]["exact"] is False
    assert got["nemotron-h-fp32-lm-head"]["record_row"] == "differs"
    assert "not what this spec writes" in got["nemotron-h-fp32-lm-head"]["message"]
    assert got["vllm-fp32-logits"]["exact"] is True


@pytest.mark.parametrize("force", [False, True])
def test_revert_never_answers_ok_over_an_unrecorded_file(unrecorded, cli, force):
    before = tree_digest(unrecorded)
    args = ["revert", "-s", unrecorded, *(["--force"] if force else [])]
    result = cli(*args)
    assert result.exit_code == 3
    code, out = cli.json(*args)
    assert code == 3 and out["ok"] is False
    assert {p["status"] for p in _ours(out).values()} == {"unrecorded"}
    text = _text(result)
    assert f"fp32patch revert -s {unrecorded} --against" in text  # the way back, runnable
    assert "pip download --no-deps" in text and "vllm==0.25.1" in text
    assert tree_digest(unrecorded) == before  # nothing written, no state folder made


@pytest.mark.parametrize("kind", ["wheel", "folder"])
def test_revert_against_the_release_restores_the_stock_bytes(unrecorded, vllm_stock, cli, tmp_path, kind):
    candidate = _wheel(tmp_path) if kind == "wheel" else vllm_stock
    code, out = cli.json("revert", "-s", unrecorded, "--against", candidate)
    assert code == 0, out
    assert {p["status"] for p in _ours(out).values()} == {"reverted"}
    for rel in (NEMOTRON, LOGITS_PROCESSOR):
        assert (unrecorded / rel).read_bytes() == (vllm_stock / rel).read_bytes()
    record = "vllm-0.25.1.dist-info/RECORD"
    assert (unrecorded / record).read_bytes() == (vllm_stock / record).read_bytes()  # its rows, stock again
    assert not (unrecorded / STATE).exists()  # nothing of ours stays
    code, out = cli.json("verify", "-s", unrecorded)
    assert {p["status"] for p in _ours(out).values()} == {"not-applied"}


def test_revert_against_bytes_it_cannot_prove_refuses(unrecorded, cli, tmp_path):
    target = unrecorded / NEMOTRON
    target.write_bytes(target.read_bytes() + b"# edited in the image\n")
    before = tree_digest(unrecorded)
    code, out = cli.json("revert", "-s", unrecorded, "--against", _wheel(tmp_path))
    assert code == 3 and not out["ok"]
    got = _ours(out)["nemotron-h-fp32-lm-head"]
    assert got["status"] == "unrecorded"
    assert "does not give today's bytes" in got["message"]
    assert tree_digest(unrecorded) == before  # the provable file is not written alone either


def test_revert_against_another_release_refuses(unrecorded, cli, tmp_path):
    other = import_root_from_members("vllm", "0.33.0", [NEMOTRON, LOGITS_PROCESSOR], tmp_path / "other")
    before = tree_digest(unrecorded)
    code, out = cli.json("revert", "-s", unrecorded, "--against", other)
    assert code == 3
    assert "vllm 0.33.0" in _ours(out)["nemotron-h-fp32-lm-head"]["message"]
    assert tree_digest(unrecorded) == before


def test_a_root_with_one_patch_recorded_and_one_not_reverts_both_or_neither(vllm_root, vllm_stock, cli, tmp_path):
    assert cli("apply", "-s", vllm_root).exit_code == 0
    manifest = vllm_root / STATE / "manifest.json"
    data = json.loads(manifest.read_text())
    data["entries"] = [e for e in data["entries"] if e["patch"] != "vllm-fp32-logits"]  # its record lost
    manifest.write_text(json.dumps(data))
    before = tree_digest(vllm_root)
    code, out = cli.json("revert", "-s", vllm_root)
    assert code == 3
    got = _ours(out)
    assert got["vllm-fp32-logits"]["status"] == "unrecorded"
    assert got["nemotron-h-fp32-lm-head"]["status"] == "applied"
    assert "not reverted" in got["nemotron-h-fp32-lm-head"]["message"]
    assert tree_digest(vllm_root) == before
    code, out = cli.json("revert", "-s", vllm_root, "--against", _wheel(tmp_path))
    assert code == 0 and {p["status"] for p in _ours(out).values()} == {"reverted"}
    assert tree_digest(vllm_root) == tree_digest(vllm_stock)


def test_apply_over_an_unrecorded_file_says_so_and_records_nothing(unrecorded, cli):
    before = tree_digest(unrecorded)
    result = cli("apply", "-s", unrecorded)
    assert result.exit_code == 3
    assert "already-applied" not in result.stdout
    code, out = cli.json("apply", "-s", unrecorded)
    assert code == 3 and {p["status"] for p in _ours(out).values()} == {"unrecorded"}
    assert tree_digest(unrecorded) == before


def test_the_corrupted_manifest_message_says_what_files_read_as(vllm_root, cli, tmp_path):
    assert cli("apply", "-s", vllm_root).exit_code == 0
    (vllm_root / STATE / "manifest.json").write_text("{ truncated")
    result = cli("verify", "-s", vllm_root)
    assert result.exit_code == 2
    text = _text(result)
    assert "read as unrecorded" in text and "--against" in text
    assert "drifted or not-applied" not in text
    # and following it: the files read as it said
    shutil.move(vllm_root / STATE, tmp_path / "aside")
    code, out = cli.json("verify", "-s", vllm_root)
    assert {p["status"] for p in _ours(out).values()} == {"unrecorded"}


# ---------------------------------------------------------------- 2. apply over a hand-edited file


def test_apply_over_a_hand_edited_patched_file_says_drifted(vllm_root, cli):
    assert cli("apply", "-s", vllm_root).exit_code == 0
    target = vllm_root / NEMOTRON
    target.write_bytes(target.read_bytes() + b"x = 1\n")
    before = tree_digest(vllm_root)
    code, out = cli.json("verify", "-s", vllm_root)
    assert code == 1 and _ours(out)["nemotron-h-fp32-lm-head"]["status"] == "drifted"
    result = cli("apply", "-s", vllm_root)
    assert result.exit_code != 0
    code, out = cli.json("apply", "-s", vllm_root)
    assert code == 3 and not out["ok"]
    assert _ours(out)["nemotron-h-fp32-lm-head"]["status"] == "drifted"
    assert "changed after it was patched" in _ours(out)["nemotron-h-fp32-lm-head"]["message"]
    assert tree_digest(vllm_root) == before


# ---------------------------------------------------------------- 4. a failing verify says why


def test_a_failing_verify_says_why_and_what_to_run(vllm_root, cli):
    assert cli("apply", "-s", vllm_root).exit_code == 0
    assert cli("revert", "-s", vllm_root).exit_code == 0
    result = cli("verify", "-s", vllm_root)
    assert result.exit_code == 1
    assert f"2 not applied: run `fp32patch apply -s {vllm_root}`" in _text(result)


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path / "lib" / f"python{sysconfig.get_python_version()}" / "site-packages"


def _install(sp: Path, stock: Path) -> None:
    for rel in (NEMOTRON, LOGITS_PROCESSOR, "vllm-0.25.1.dist-info"):
        src = stock / rel
        (sp / rel).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, sp / rel)


def test_totals_count_every_row_and_the_notes_stay_short(vllm_stock, tmp_path, cli):
    top = tmp_path / "envs"
    sps = []
    for i in range(30):  # Ray's per-actor environments: two hold vLLM
        env = top / f"actor-{i:02d}"
        env.mkdir(parents=True)
        (env / "pyvenv.cfg").write_text("home = /usr/bin\n")
        sp = env / "lib" / "python3.12" / "site-packages"
        sp.mkdir(parents=True)
        sps.append(sp)
        if i < 2:
            _install(sp, vllm_stock)
    assert cli("apply", "--envs", top).exit_code == 0
    assert cli("revert", "-s", sps[0]).exit_code == 0
    result = cli("verify", "--envs", top)
    assert result.exit_code == 1
    text = _text(result)
    # vLLM's two patches: a row in each of the 30 roots; the other shipped patches (NeMo-RL's two, verl's,
    # TRL's) are found nowhere: one folded row each, counted once per root
    others = len(load_specs()) - 2
    [totals] = [line for line in result.stdout.splitlines() if line.startswith("30 import roots: ")]
    assert sorted(totals.removeprefix("30 import roots: ").split(", ")) == sorted(
        [f"{28 * 2 + 30 * others} not-installed", "2 applied", "2 not-applied"]
    )
    assert f"2 not applied: run `fp32patch apply --envs {top}`" in text
    # folded into one line with the command that lists them (issue 43), not a line each
    assert f"{others} patches whose packages are in none of the 30 import roots" in text
    assert "is not in any of the 30 import roots" not in text
    for line in (result.stdout + result.stderr).splitlines():
        assert len(line) <= 200, line


# ---------------------------------------------------------------- 5. -s VENV


@pytest.mark.parametrize("kind", ["venv", "conda"])
def test_site_packages_given_an_environment_folder(vllm_stock, tmp_path, cli, kind):
    env = tmp_path / "env"
    if kind == "venv":
        sp = _venv(env)
    else:
        (env / "conda-meta").mkdir(parents=True)
        sp = env / "lib" / f"python{sysconfig.get_python_version()}" / "site-packages"
        sp.mkdir(parents=True)
    _install(sp, vllm_stock)
    code, out = cli.json("apply", "-s", env)
    assert code == 0, out
    got = _ours(out)
    assert {p["status"] for p in got.values()} == {"applied"}
    assert {p["root"] for p in got.values()} == {str(sp.resolve())}
    assert (sp / STATE / "manifest.json").is_file()
    code, out = cli.json("verify", "-s", env)
    assert code == 0
    assert cli("revert", "-s", env).exit_code == 0
    assert (sp / NEMOTRON).read_bytes() == (vllm_stock / NEMOTRON).read_bytes()
