"""The first day at one root (issue 43, part 4), each through the real CLI in a process of its own.

A table that lists the seven patches whose packages are not in the root, a root named one level
off (or not named at all) answered with the folder to name and the command, a drifted file of a
multi-file patch named in its row and in what a forced revert keeps, a mistyped patch id or mode
answered with the closest valid one, help and the wheel's summary naming every stack and engine,
and `make help`, `make demo` without torch, `make clean-demo`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import default_sigint

pytestmark = pytest.mark.network  # vLLM 0.25.1's files from its wheel on PyPI (cached)

REPO = Path(__file__).resolve().parent.parent
SHIPPED = len(list((REPO / "fp32patch" / "patches").glob("*.toml")))  # the patches fp32patch ships
ELSEWHERE = (
    f"{SHIPPED - 2} patches whose packages are not in this root"
    " (SGLang, NeMo-RL, verl, TRL, OpenRLHF, slime, Prime-RL, AReaL, SkyRL)"
)
STACKS = ("vLLM", "SGLang", "NeMo-RL", "verl", "TRL", "OpenRLHF", "slime", "Prime-RL", "AReaL", "SkyRL")


def fp32patch(*args, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """The CLI as a shell runs it (this checkout's package; PATH and the shell's environment as given)."""
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    environ.update(PYTHONPATH=str(REPO), NO_COLOR="1", COLUMNS="200", **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "fp32patch", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        env=environ,
        preexec_fn=default_sigint,
    )


def printed_command(text: str) -> list[str]:
    """The last command a message gives in backquotes, as words (``fp32patch`` dropped)."""
    commands = re.findall(r"`(fp32patch [^`]+)`", text)
    assert commands, text
    return shlex.split(commands[-1])[1:]


def rows(table: str) -> list[str]:
    """The table's rows: the lines that start with a patch id."""
    from fp32patch.patcher.spec import load_specs

    ids = {s.id for s in load_specs()}
    return [line for line in table.splitlines() if line.split(" ", 1)[0] in ids]


def venv_with_vllm(folder: Path, stock: Path) -> Path:
    """A venv's layout (pyvenv.cfg, lib/python3.X/site-packages) holding vLLM's files, as `python -m venv`
    and pip leave it; returns the venv's folder."""
    env = folder
    (env / "bin").mkdir(parents=True)
    (env / "pyvenv.cfg").write_text(f"home = {Path(sys.executable).parent}\nversion = 3.{sys.version_info.minor}\n")
    sp = env / "lib" / f"python3.{sys.version_info.minor}" / "site-packages"
    shutil.copytree(stock, sp)
    return env


# ---------------------------------------------------------------- one root, seven stacks not there


@pytest.mark.parametrize("command", ["status", "verify", "apply", "diff"])
def test_the_patches_whose_packages_are_not_there_are_one_line(vllm_root, command):
    if command == "verify":
        assert fp32patch("apply", "-s", vllm_root).returncode == 0
    result = fp32patch(command, "-s", vllm_root)
    table = result.stderr if command == "diff" else result.stdout  # diff: stdout is the patch alone
    assert result.returncode == 0, result.stdout + result.stderr
    assert "not-installed" not in result.stdout + result.stderr
    assert [row.split()[0] for row in rows(table)] == ["nemotron-h-fp32-lm-head", "vllm-fp32-logits"]
    assert f"{ELSEWHERE}; --all lists them" in table
    # and it does, every patch
    listing = fp32patch(command, "-s", vllm_root, "--all")
    assert len(rows(listing.stderr if command == "diff" else listing.stdout)) == SHIPPED


def test_a_failing_verify_says_only_what_matters(vllm_root):
    result = fp32patch("verify", "-s", vllm_root)
    assert result.returncode == 1
    assert result.stderr.strip() == f"2 not applied: run `fp32patch apply -s {vllm_root}`"
    assert "not-installed" not in result.stdout and "is not in" not in result.stdout
    # --all lists them; --json keeps every row for machines
    assert fp32patch("verify", "-s", vllm_root, "--all").stdout.count("not-installed") == SHIPPED - 2
    out = json.loads(fp32patch("verify", "-s", vllm_root, "--json").stdout)
    assert len(out["patches"]) == SHIPPED and sum(p["status"] == "not-installed" for p in out["patches"]) == SHIPPED - 2


def test_a_patch_named_with_patch_is_listed_even_when_not_there(vllm_root):
    result = fp32patch("status", "-s", vllm_root, "--patch", "sglang-fp32-lm-head")
    assert [row.split()[:2] for row in rows(result.stdout)] == [["sglang-fp32-lm-head", "not-installed"]]


# ---------------------------------------------------------------- -s one level off, or forgotten


@pytest.mark.parametrize(
    ("named", "says"),
    [
        ("SP/vllm", "is the package folder SP/vllm itself, not an import root"),
        ("SP/vllm/model_executor", "is inside the package folder SP/vllm, not an import root"),
        ("ENV/lib", "ENV/lib holds none of the patches' packages"),
        ("ENV/lib/PY", "ENV/lib/PY holds none of the patches' packages"),
    ],
    ids=["package folder", "inside the package", "venv lib", "venv lib/python3.X"],
)
def test_a_root_one_level_off_gets_the_folder_to_name(vllm_stock, tmp_path, named, says):
    env = venv_with_vllm(tmp_path / "venv", vllm_stock)
    py = f"python3.{sys.version_info.minor}"
    sp = env / "lib" / py / "site-packages"

    def spelled(text: str) -> str:
        return text.replace("SP", str(sp)).replace("ENV", str(env)).replace("PY", py)

    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    for command, code in (("verify", 1), ("apply", 2)):
        result = fp32patch(command, "-s", spelled(named))
        assert result.returncode == code
        assert spelled(says) in result.stderr, result.stderr
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written
    again = printed_command(result.stderr)  # apply's, as printed: it runs
    assert again[:2] == ["apply", "-s"] and again[2] in (str(sp), str(env))
    fixed = fp32patch(*again)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert [row.split()[:2] for row in rows(fixed.stdout)] == [
        ["nemotron-h-fp32-lm-head", "applied"],
        ["vllm-fp32-logits", "applied"],
    ]


def test_a_venv_folder_is_taken_as_its_site_packages(vllm_stock, tmp_path):
    env = venv_with_vllm(tmp_path / "venv", vllm_stock)
    result = fp32patch("status", "-s", env)
    assert result.returncode == 0 and result.stderr == ""
    assert [row.split()[:3] for row in rows(result.stdout)] == [
        ["nemotron-h-fp32-lm-head", "not-applied", "0.25.1"],
        ["vllm-fp32-logits", "not-applied", "0.25.1"],
    ]


def test_a_forgotten_root_points_at_the_environment_in_this_folder(vllm_stock, tmp_path):
    """fp32patch in an environment of its own (pipx, uv tool, this .venv): without -s it looks at its own
    site-packages, which holds no vLLM; the project's .venv in the current folder does."""
    env = venv_with_vllm(tmp_path / "project" / ".venv", vllm_stock)
    quiet_path = {"PATH": "/usr/bin:/bin"}
    result = fp32patch("verify", cwd=tmp_path / "project", env=quiet_path)
    assert result.returncode == 1
    text = " ".join(result.stderr.split())
    assert "this interpreter's site-packages (used when no -s or --envs is given)" in text
    assert "vLLM is in " + str(env / "lib") in text
    assert printed_command(text) == ["verify", "-s", str(env)]
    # nothing anywhere near: the command with a folder still to fill in
    (tmp_path / "elsewhere").mkdir()
    lost = fp32patch("status", cwd=tmp_path / "elsewhere", env=quiet_path)
    assert lost.returncode == 0
    assert "`fp32patch status -s DIR`" in lost.stderr and "`fp32patch status --envs DIR`" in lost.stderr


def test_a_folder_of_environments_gets_envs(vllm_stock, tmp_path):
    for name in ("a", "b"):
        venv_with_vllm(tmp_path / "ray_venvs" / name, vllm_stock)
    result = fp32patch("status", "-s", tmp_path / "ray_venvs")
    assert "2 Python environments under it do" in result.stderr
    assert printed_command(result.stderr) == ["status", "--envs", str(tmp_path / "ray_venvs")]


# ---------------------------------------------------------------- a drifted file of a multi-file patch


def test_the_drifted_file_is_named_in_its_row_and_in_what_revert_keeps(tmp_path):
    from tests.fixtures.slime_shapes import ARGUMENTS, ENGINE, checkout

    root = checkout(tmp_path)
    assert fp32patch("apply", "-s", root, "--patch", "slime-fp32-lm-head").returncode == 0
    engine = root / ENGINE
    edited = engine.read_bytes() + b"# changed in the image after patching\n"
    engine.write_bytes(edited)

    for command, code in (("verify", 1), ("revert", 3)):
        result = fp32patch(command, "-s", root)
        assert result.returncode == code
        [row] = [r for r in rows(result.stdout) if r.startswith("slime-fp32-lm-head")]
        assert row.split()[1] == "drifted" and row.split()[-1] == str(engine), row
        assert str(root / ARGUMENTS) not in row
    out = json.loads(fp32patch("verify", "-s", root, "--json").stdout)
    [entry] = [p for p in out["patches"] if p["id"] == "slime-fp32-lm-head"]
    assert entry["drifted"] == [str(engine)] and str(engine) in entry["message"]

    forced = fp32patch("revert", "-s", root, "--force")
    assert forced.returncode == 0, forced.stderr
    [kept] = (root / ".fp32patch" / "displaced").iterdir()
    assert kept.name.startswith("slime.backends.sglang_utils.sglang_engine.py.") and kept.read_bytes() == edited
    assert str(kept) in forced.stdout


# ---------------------------------------------------------------- a mistyped patch id or mode


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("vllm-fp32-logit", "vllm-fp32-logits"),
        ("nemotron", "nemotron-h-fp32-lm-head"),
        ("sglang-fp32", "sglang-fp32-lm-head"),
    ],
)
def test_a_mistyped_patch_id_gets_the_closest(vllm_root, typed, meant):
    result = fp32patch("verify", "-s", vllm_root, "--patch", typed)
    assert result.returncode == 2
    assert f"unknown patch id '{typed}' (did you mean '{meant}'?)" in result.stderr
    out = json.loads(fp32patch("apply", "-s", vllm_root, "--patch", typed, "--json").stdout)
    assert not out["ok"] and f"(did you mean '{meant}'?)" in out["error"]
    assert not (vllm_root / ".fp32patch").exists()


_SLIME_RUN = textwrap.dedent(
    """
    import sys
    sys.path[:0] = [{root!r}, {repo!r}]
    from tests.fixtures.slime_shapes import install_sglang
    install_sglang()
    sys.argv = ["train.py", "--hf-checkpoint", "/models/qwen", "--fp32-lm-head", {mode!r}]
    from slime.utils.arguments import parse_args
    parse_args()
    """
)


@pytest.mark.parametrize(
    ("typed", "meant"), [("fp32ot", "fp32out"), ("fp32out-hi-lo", "fp32out-hilo"), ("tf23", "tf32")]
)
def test_a_mistyped_mode_gets_the_closest(tmp_path, typed, meant):
    """slime's own command line, patched: a near miss of a mode names the mode it was near."""
    from tests.fixtures.slime_shapes import checkout

    root = checkout(tmp_path)
    assert fp32patch("apply", "-s", root, "--patch", "slime-fp32-lm-head").returncode == 0
    run = subprocess.run(
        [sys.executable, "-c", _SLIME_RUN.format(root=str(root), repo=str(REPO), mode=typed)],
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0
    assert f"--fp32-lm-head = '{typed}' is not valid (did you mean \"{meant}\"?)" in run.stderr, run.stderr[-2000:]


# ---------------------------------------------------------------- what names the stacks


def test_help_and_the_wheels_summary_name_every_stack_and_engine():
    from fp32patch.patcher.spec import tomllib

    helped = " ".join(fp32patch("--help").stdout.split())
    summary = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["description"]
    for name in STACKS:
        assert name in helped, name
        assert name in summary, name
    sglang = (REPO / "docs" / "sglang.md").read_text()
    assert "not run on a GPU yet" not in sglang and "Not run yet" not in sglang
    assert "bench/sglang-head-h200.json" in sglang


# ---------------------------------------------------------------- the Makefile a newcomer reads


def _make(*args: str) -> str:
    return subprocess.run(["make", "-s", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def test_make_help_lists_every_target_with_its_line():
    listed = dict(line.split(None, 2)[1:] for line in _make("help").splitlines() if line.startswith("  make "))
    phony = re.search(r"^\.PHONY:(.*)$", (REPO / "Makefile").read_text(), re.M).group(1).split()
    assert sorted(listed) == sorted(phony)
    assert all(len(line) > 10 for line in listed.values())


def test_make_demo_runs_the_cli_without_torch_and_clean_removes_what_it_left():
    planned = _make("-n", "demo", "DEMO_DIR=build/demo-check")
    assert "cpu_torch" not in planned and "torch" not in planned.replace("no torch", "")
    assert "pip install -q -e ." in planned and ".[" not in planned  # the package alone, no extras
    assert "build/demo-check" in _make("-n", "clean-demo", "DEMO_DIR=build/demo-check")
    assert "clean-demo" in (REPO / "Makefile").read_text().split("\nclean:", 1)[1].splitlines()[0]
