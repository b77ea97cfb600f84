"""SIGKILL at every write step of apply and revert, in a real ``python -m fp32patch`` process.

After each kill: every file is whole (its original bytes or its fully patched bytes, the
RECORD too), ``verify`` says which, and the next ``apply`` or ``revert`` completes: the
right bytes, RECORD in step, bytecode that cannot hide the change, no temp file left, the
manifest valid and settled. Kill points are counted by raising N until the process exits
on its own (``FP32PATCH_CRASH_AT``, see fp32patch/patcher/atomic.py).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fp32patch.patcher.transaction import record_hash
from tests.conftest import NEMOTRON
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

RECORD = "vllm-0.33.0.dist-info/RECORD"
NEMOTRON_ID = "nemotron-h-fp32-lm-head"
MAX_STEPS = 60  # far more than any command takes; a loop that never ends is a failure
KILLED = -9


def _fp32patch(*args: str, crash_at: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FP32PATCH_CRASH_AT"}
    if crash_at is not None:
        env["FP32PATCH_CRASH_AT"] = str(crash_at)
    return subprocess.run(
        [sys.executable, "-m", "fp32patch", *args], capture_output=True, text=True, env=env, timeout=120
    )


def _code_names(path: Path) -> set[str]:
    """The names in the code object Python's import system loads for ``path`` (bytecode included)."""
    loader = importlib.machinery.SourceFileLoader("probe", str(path))
    return {c.co_name for c in loader.get_code("probe").co_consts if hasattr(c, "co_name")}


class Forms:
    """The bytes a file may have: original or patched (target and RECORD)."""

    def __init__(self, original: Path, patched: Path):
        self.target = {"original": (original / NEMOTRON).read_bytes(), "patched": (patched / NEMOTRON).read_bytes()}
        self.record = {"original": (original / RECORD).read_bytes(), "patched": (patched / RECORD).read_bytes()}

    def which(self, root: Path) -> str:
        data = (root / NEMOTRON).read_bytes()
        found = [k for k, v in self.target.items() if v == data]
        assert found, "torn target: neither the original nor the patched bytes"
        record = (root / RECORD).read_bytes()
        assert record in self.record.values(), "torn RECORD"
        return found[0]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """vLLM 0.33.0's nemotron_h.py and dist-info, with a stale-prone (unchecked-hash) pyc of it."""
    root = import_root_from_members("vllm", "0.33.0", [NEMOTRON], tmp_path_factory.mktemp("pristine") / "sp")
    target = root / NEMOTRON
    py_compile.compile(
        str(target),
        cfile=importlib.util.cache_from_source(str(target)),
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
    return root


@pytest.fixture(scope="module")
def patched(pristine, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("patched") / "sp"
    shutil.copytree(pristine, root)
    assert _fp32patch("apply", "-s", str(root)).returncode == 0
    return root


@pytest.fixture(scope="module")
def forms(pristine, patched) -> Forms:
    return Forms(pristine, patched)


def _copy(src: Path, dest: Path) -> Path:
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest, symlinks=True)
    return dest


def _assert_settled(root: Path, forms: Forms, expect: str) -> None:
    """What a finished command leaves: the expected bytes, RECORD in step, no leftovers."""
    assert forms.which(root) == expect
    data = (root / NEMOTRON).read_bytes()
    row = next(line for line in (root / RECORD).read_text().splitlines() if line.startswith(NEMOTRON + ","))
    assert row.split(",")[1] == record_hash(data)
    assert ("_fp32patch_lm_head_runtime" in _code_names(root / NEMOTRON)) == (expect == "patched")
    assert not [p for p in root.rglob("*fp32patch-tmp*")], "temp files left behind"
    path = root / ".fp32patch" / "manifest.json"
    # a kill before the intent was recorded may leave no manifest at all: nothing to record
    manifest = json.loads(path.read_text()) if path.exists() or expect == "patched" else {"entries": []}
    assert all(e["state"] == "applied" for e in manifest["entries"])
    assert len(manifest["entries"]) == (1 if expect == "patched" else 0)


def _verify_tells(cli, root: Path, forms: Forms) -> str:
    which = forms.which(root)
    code, out = cli.json("verify", "-s", root)
    [entry] = [p for p in out["patches"] if p["id"] == NEMOTRON_ID]
    assert entry["status"] == ("applied" if which == "patched" else "not-applied"), entry
    assert code == 1 or which == "patched"  # a killed apply never verifies as fine while original
    return which


def _kill_points(command: list[str], start: Path, work: Path, check) -> int:
    """Run ``command`` on a fresh copy of ``start`` killed at step 1, 2, ... until it finishes."""
    for n in range(1, MAX_STEPS + 1):
        root = _copy(start, work / f"kill-{n}")
        proc = _fp32patch(*command, "-s", str(root), crash_at=n)
        if proc.returncode == 0:
            return n - 1
        assert proc.returncode == KILLED, proc.stderr
        check(n, root)
        shutil.rmtree(root)
    raise AssertionError(f"{command} still had write steps after {MAX_STEPS}")


def test_apply_killed_at_every_step(pristine, forms, tmp_path, cli):
    seen: dict[str, int] = {}

    def check(n: int, root: Path) -> None:
        which = _verify_tells(cli, root, forms)
        seen[which] = seen.get(which, 0) + 1
        other = _copy(root, tmp_path / "revert-after")
        result = cli("apply", "-s", root)
        assert result.exit_code == 0, result.stdout + result.stderr
        _assert_settled(root, forms, "patched")
        assert cli("verify", "-s", root).exit_code == 0
        result = cli("revert", "-s", other)
        assert result.exit_code == 0, result.stdout + result.stderr
        _assert_settled(other, forms, "original")

    steps = _kill_points(["apply"], pristine, tmp_path, check)
    assert steps >= 10  # keep original, intent, target, RECORD, settle: two points per durable write
    assert seen.get("original") and seen.get("patched")  # the kills fell on both sides of the replace
    print(f"apply: {steps} kill points, files after the kill: {seen}")


def test_revert_killed_at_every_step(patched, forms, tmp_path, cli):
    seen: dict[str, int] = {}

    def check(n: int, root: Path) -> None:
        which = _verify_tells(cli, root, forms)
        seen[which] = seen.get(which, 0) + 1
        other = _copy(root, tmp_path / "apply-after")
        result = cli("revert", "-s", root)
        assert result.exit_code == 0, result.stdout + result.stderr
        _assert_settled(root, forms, "original")
        result = cli("apply", "-s", other)
        assert result.exit_code == 0, result.stdout + result.stderr
        _assert_settled(other, forms, "patched")

    steps = _kill_points(["revert"], patched, tmp_path, check)
    assert steps >= 6
    assert seen.get("original") and seen.get("patched")
    print(f"revert: {steps} kill points, files after the kill: {seen}")


def test_forced_revert_killed_at_every_step_loses_no_bytes(patched, forms, tmp_path, cli):
    """A drifted file's bytes are either still in place or kept in displaced/, whatever the kill."""
    start = _copy(patched, tmp_path / "drifted")
    edited = forms.target["patched"] + b"# a hand edit after patching\n"
    (start / NEMOTRON).write_bytes(edited)

    def check(n: int, root: Path) -> None:
        data = (root / NEMOTRON).read_bytes()
        assert data in (edited, forms.target["original"])
        displaced = root / ".fp32patch" / "displaced"
        kept = [p.read_bytes() for p in displaced.iterdir()] if displaced.is_dir() else []
        assert data == edited or edited in kept, "the hand-edited bytes were lost"
        code, out = cli.json("verify", "-s", root)
        [entry] = [p for p in out["patches"] if p["id"] == NEMOTRON_ID]
        assert entry["status"] == ("drifted" if data == edited else "not-applied")
        result = cli("revert", "-s", root, "--force")
        assert result.exit_code == 0, result.stdout + result.stderr
        _assert_settled(root, forms, "original")

    steps = _kill_points(["revert", "--force"], start, tmp_path, check)
    assert steps >= 8
