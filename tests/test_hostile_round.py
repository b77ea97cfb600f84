"""Issue 43's hostile round, each case as a user meets it: the real CLI in a fresh process.

1. a state folder this user cannot read (another user's, ``umask 077`` at build, ``docker run --user``):
   every command answers exit 2 with one line naming the file and the error, and ``--json`` one object;
2. Ctrl-C while the CLI starts (in its imports, libcst's included, and in typer's parsing): one line, one
   JSON object with ``--json``, exit 130, nothing changed;
3. a release whose version cannot be read (``Version: banana``, no ``Version:`` line) refuses a patch
   whose releases are told apart by version (exit 3, nothing written); a patch without version windows
   lets its anchors pick and says so;
4. ``--json=1`` is a usage error answered in JSON.

Root passes permission bits, so "another user" is root without the capabilities that override them
(``setpriv --bounding-set -dac_override,-dac_read_search``): the files' own mode bits then decide.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import default_sigint, tree_digest
from tests.fixtures.nemo_rl_shapes import NEWEST, checkout

pytestmark = pytest.mark.network  # vLLM's and SGLang's files come out of their wheels

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ["verify", "status", "apply", "revert", "diff"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP32PATCH_CRASH")}
    return {**env, "PYTHONPATH": str(REPO), "NO_COLOR": "1", "COLUMNS": "200"}


def fp32patch(*args, prelude: str = "", without_dac: bool = False) -> subprocess.CompletedProcess:
    """``python -m fp32patch ARGS`` in a fresh process (after ``prelude``, Python run first in it)."""
    code = (
        f"{prelude}\nimport runpy, sys\nsys.argv[0] = 'fp32patch'\nrunpy.run_module('fp32patch', run_name='__main__')"
    )
    argv = [sys.executable, "-c", code, *map(str, args)]
    if without_dac:
        argv = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *argv]
    return subprocess.run(
        argv, capture_output=True, text=True, env=_env(), timeout=300, cwd="/", preexec_fn=default_sigint
    )


def one_json(result: subprocess.CompletedProcess) -> dict:
    text = result.stdout + result.stderr
    assert "Traceback" not in text, text
    return json.loads(result.stdout)  # one object: json.loads refuses a second


def stderr_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in result.stderr.splitlines() if ln.strip()]


# ---------------------------------------------------------------- 1. a state folder this user cannot read


@pytest.fixture
def patched(vllm_root, cli) -> Path:
    assert cli("apply", "-s", vllm_root).exit_code == 0
    return vllm_root


def _without_dac_works() -> bool:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return False
    probe = subprocess.run(["setpriv", "--bounding-set=-dac_override,-dac_read_search", "true"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.parametrize("unreadable", [".fp32patch", ".fp32patch/manifest.json", ".fp32patch/originals"])
def test_a_state_folder_this_user_cannot_read_is_one_line_for_every_command(patched, unreadable):
    if not _without_dac_works():
        pytest.skip("needs root and setpriv to drop the capabilities that pass permission bits")
    path = patched / unreadable
    path.chmod(0)
    try:
        before = tree_digest(patched)
        # every command where the whole folder is another user's; the ones that read each file where one is
        for command in COMMANDS if unreadable == ".fp32patch" else ["verify", "revert"]:
            result = fp32patch(command, "-s", patched, "--json", without_dac=True)
            out = one_json(result)
            assert (result.returncode, out["ok"]) == (2, False), (command, result.stdout, result.stderr)
            assert "Permission denied" in out["error"] and str(patched / ".fp32patch") in out["error"], out
            (line,) = stderr_lines(result)
            assert line.startswith("error: cannot read ") and "Permission denied" in line, line
        result = fp32patch("verify", "-s", patched, without_dac=True)
        assert result.returncode == 2 and len(stderr_lines(result)) == 1 and not result.stdout, result.stderr
        path.chmod(0o755)
        assert tree_digest(patched) == before  # nothing changed
    finally:
        path.chmod(0o755 if path.is_dir() else 0o644)


# ---------------------------------------------------------------- 2. Ctrl-C while the CLI starts

# A real SIGINT at the import of a module (after the import system found no module of that name in
# sys.modules), or when typer starts parsing the arguments
_SIGINT_AT_IMPORT = """
import importlib.abc, os, signal, sys
class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, _Hook())
"""
_SIGINT_AT_PARSE = """
import os, signal
import fp32patch.cli as _cli
_make = _cli._Group.make_context
def _interrupted(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    return _make(self, *args, **kwargs)
_cli._Group.make_context = _interrupted
"""


@pytest.mark.parametrize(
    "when",
    ["json", "typer", "parse", "fp32patch.patcher.plan", "libcst._nodes.expression", "fp32patch.patcher.transform"],
)
def test_ctrl_c_while_the_cli_starts_is_one_line_and_changes_nothing(vllm_root, when):
    """Before: a KeyboardInterrupt traceback, or exit 130 with nothing printed (typer swallows it), no JSON."""
    prelude = _SIGINT_AT_PARSE if when == "parse" else _SIGINT_AT_IMPORT.format(module=when)
    before = tree_digest(vllm_root)
    runs = [["apply", "-s", vllm_root, "--json"]]
    if when == "parse":  # and without --json: the one line, nothing on stdout
        runs.append(["apply", "-s", vllm_root])
    for args in runs:
        result = fp32patch(*args, prelude=prelude)
        assert result.returncode == 130, (result.stdout, result.stderr)
        (line,) = stderr_lines(result)
        assert line.startswith("interrupted (Ctrl-C)") and "nothing was written" in line, line
        if "--json" in args:
            assert one_json(result)["ok"] is False
        else:
            assert not result.stdout
        assert tree_digest(vllm_root) == before


# ---------------------------------------------------------------- 3. a version that cannot be read

SGLANG = "sglang-fp32-lm-head"


@pytest.fixture(scope="module")
def sglang_0_5_17(tmp_path_factory) -> Path:
    from tests.support.pypi import import_root_from_members

    root = tmp_path_factory.mktemp("sglang") / "site-packages"
    return import_root_from_members("sglang", "0.5.17", ["sglang/srt/layers/logits_processor.py"], root)


@pytest.mark.parametrize("version", ["banana", None], ids=["Version: banana", "no Version line"])
def test_an_unreadable_version_refuses_a_patch_told_apart_by_version(sglang_0_5_17, tmp_path, version):
    """Before: the gate was skipped and the SGLang patch applied with exit 0."""
    root = shutil.copytree(sglang_0_5_17, tmp_path / "site-packages")
    (metadata,) = root.glob("sglang-*.dist-info/METADATA")
    lines = [ln for ln in metadata.read_text().splitlines(keepends=True) if not ln.startswith("Version:")]
    if version is not None:
        lines.insert(2, f"Version: {version}\n")
    metadata.write_text("".join(lines))
    before = tree_digest(root)
    result = fp32patch("apply", "-s", root, "--patch", SGLANG, "--json")
    out = one_json(result)
    (row,) = out["patches"]
    assert (result.returncode, row["status"]) == (3, "unsupported-version"), row
    assert (
        f"its version cannot be read ({metadata} has {f'Version: {version}' if version else 'no Version'})"
        in (row["message"])
    )
    assert tree_digest(root) == before


def test_an_unreadable_version_without_windows_lets_the_anchors_pick_and_says_so(tmp_path):
    """NeMo-RL's patch has no version window (its version says nothing of its files' shape)."""
    root = checkout(NEWEST.name, tmp_path / "nemo-rl")
    (root / "nemo_rl.egg-info").mkdir()
    (root / "nemo_rl.egg-info" / "PKG-INFO").write_text("Metadata-Version: 2.4\nName: nemo-rl\nVersion: banana\n")
    result = fp32patch("apply", "-s", root, "--patch", "nemo-rl-fp32-lm-head")
    assert result.returncode == 0, result.stderr
    said = " ".join(result.stderr.split())
    assert f"its version cannot be read ({root}/nemo_rl.egg-info/PKG-INFO has Version: banana)" in said
    assert f"anchors alone picked the variant ({NEWEST.variant})" in said


# ---------------------------------------------------------------- 4. --json=1


@pytest.mark.parametrize("flag", ["--json=1", "--json=true", "--json="])
def test_json_with_a_value_is_a_usage_error_in_json(vllm_root, flag):
    result = fp32patch("verify", "-s", vllm_root, flag)
    out = one_json(result)
    assert (result.returncode, out["ok"]) == (2, False) and "--json" in out["error"], out


def test_a_sigint_the_process_inherited_ignored_stays_ignored(vllm_root):
    """nohup, a background job: the CLI keeps an ignored SIGINT ignored (its handler is not put in)."""
    prelude = "import signal; signal.signal(signal.SIGINT, signal.SIG_IGN)\n" + _SIGINT_AT_IMPORT.format(module="typer")
    result = fp32patch("verify", "-s", vllm_root, "--json", prelude=prelude)
    assert result.returncode == 1 and one_json(result)["ok"] is False  # not applied: verify's own answer
