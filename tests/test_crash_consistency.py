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
NEMO_RL_ID = "nemo-rl-context-length-400"
MAX_STEPS = 60  # far more than any command takes; a loop that never ends is a failure
KILLED = -9
BATCH = 4  # killed processes started at once


def _fp32patch(*args: str, crash_at: int | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FP32PATCH_CRASH_AT"}
    if crash_at is not None:
        env["FP32PATCH_CRASH_AT"] = str(crash_at)
    return subprocess.run(
        [sys.executable, "-m", "fp32patch", *args], capture_output=True, text=True, env=env, timeout=120
    )


def _start(*args: str, crash_at: int) -> subprocess.Popen:
    env = {**os.environ, "FP32PATCH_CRASH_AT": str(crash_at)}
    return subprocess.Popen(
        [sys.executable, "-m", "fp32patch", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )


def _code_names(path: Path) -> set[str]:
    """The names in the code object Python's import system loads for ``path`` (bytecode included)."""
    loader = importlib.machinery.SourceFileLoader("probe", str(path))
    return {c.co_name for c in loader.get_code("probe").co_consts if hasattr(c, "co_name")}


NEMO_RL = "nemo_rl/models/generation/vllm/vllm_worker_async.py"
NEMO_RL_FIXTURE = Path(__file__).parent / "fixtures" / "nemo_rl" / "pre_fix.py"


class Layout:
    """A root with one target (vLLM's) or two (vLLM's and NeMo-RL's, one transaction), and their forms."""

    def __init__(self, pristine: Path, patched: Path, files: dict[str, str]):
        self.pristine, self.patched, self.files = pristine, patched, files
        self.forms = {
            rel: {"original": (pristine / rel).read_bytes(), "patched": (patched / rel).read_bytes()}
            for rel in files.values()
        }
        self.record = {"original": (pristine / RECORD).read_bytes(), "patched": (patched / RECORD).read_bytes()}

    def which(self, root: Path) -> dict[str, str]:
        """Each patch's file: "original" or "patched"; a torn file (or RECORD) fails here."""
        out = {}
        for patch, rel in self.files.items():
            data = (root / rel).read_bytes()
            found = [k for k, v in self.forms[rel].items() if v == data]
            assert found, f"torn {rel}: neither the original nor the patched bytes"
            out[patch] = found[0]
        assert (root / RECORD).read_bytes() in self.record.values(), "torn RECORD"
        return out


def _build(base: Path, two_files: bool) -> Layout:
    """vLLM 0.33.0's nemotron_h.py and dist-info, with a stale-prone (unchecked-hash) pyc of it;
    with two files, NeMo-RL's route file beside it, so one apply writes both in one transaction."""
    root = import_root_from_members("vllm", "0.33.0", [NEMOTRON], base / "pristine")
    files = {NEMOTRON_ID: NEMOTRON}
    if two_files:
        (root / NEMO_RL).parent.mkdir(parents=True)
        shutil.copyfile(NEMO_RL_FIXTURE, root / NEMO_RL)
        files[NEMO_RL_ID] = NEMO_RL
    target = root / NEMOTRON
    py_compile.compile(
        str(target),
        cfile=importlib.util.cache_from_source(str(target)),
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )
    patched = base / "patched"
    shutil.copytree(root, patched)
    assert _fp32patch("apply", "-s", str(patched)).returncode == 0
    return Layout(root, patched, files)


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> Layout:
    """Two targets in one transaction. Every write step of a one-file apply or revert is a
    step of this one too (the RECORD row, the kept original, the intent, the settle), so
    killing it at every step also kills a one-file run at each of its own."""
    return _build(tmp_path_factory.mktemp("layout"), True)


@pytest.fixture(scope="module")
def one_file(tmp_path_factory) -> Layout:
    return _build(tmp_path_factory.mktemp("one-file"), False)


def _copy(src: Path, dest: Path) -> Path:
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(src, dest, symlinks=True)
    return dest


def _assert_settled(root: Path, layout: Layout, expect: str) -> None:
    """What a finished command leaves: the expected bytes, RECORD in step, no leftovers."""
    assert set(layout.which(root).values()) == {expect}
    data = (root / NEMOTRON).read_bytes()
    row = next(line for line in (root / RECORD).read_text().splitlines() if line.startswith(NEMOTRON + ","))
    assert row.split(",")[1] == record_hash(data)
    assert ("_fp32patch_lm_head_runtime" in _code_names(root / NEMOTRON)) == (expect == "patched")
    assert not [p for p in root.rglob("*fp32patch-tmp*")], "temp files left behind"
    path = root / ".fp32patch" / "manifest.json"
    # a kill before the intent was recorded may leave no manifest at all: nothing to record
    manifest = json.loads(path.read_text()) if path.exists() or expect == "patched" else {"entries": []}
    assert all(e["state"] == "applied" for e in manifest["entries"])
    assert len(manifest["entries"]) == (len(layout.files) if expect == "patched" else 0)


def _verify_tells(cli, root: Path, layout: Layout) -> str:
    """verify's status of each patch is what its file's bytes are; returns the combination."""
    which = layout.which(root)
    code, out = cli.json("verify", "-s", root)
    statuses = {p["id"]: p["status"] for p in out["patches"]}
    for patch, form in which.items():
        assert statuses[patch] == ("applied" if form == "patched" else "not-applied"), (patch, out)
    assert code == 1 or set(which.values()) == {"patched"}  # never fine while a file is original
    return "+".join(which[p] for p in sorted(which))


def _kill_points(command: list[str], start: Path, work: Path, check) -> int:
    """Run ``command`` on fresh copies of ``start`` killed at step 1, 2, ... until it finishes.

    The killed processes run a few at a time (each on its own copy); the checks, in step order.
    """
    for first in range(1, MAX_STEPS + 1, BATCH):
        steps = range(first, first + BATCH)
        roots = [_copy(start, work / f"kill-{n}") for n in steps]
        procs = [_start(*command, "-s", str(root), crash_at=n) for n, root in zip(steps, roots, strict=True)]
        errors = [p.communicate(timeout=120)[1] for p in procs]
        for n, root, proc, stderr in zip(steps, roots, procs, errors, strict=True):
            if proc.returncode == 0:
                return n - 1
            assert proc.returncode == KILLED, stderr
            check(n, root)
            shutil.rmtree(root)
    raise AssertionError(f"{command} still had write steps after {MAX_STEPS}")


def test_apply_killed_at_every_step(layout, tmp_path, cli, kill_points):
    seen: dict[str, int] = {}

    def check(n: int, root: Path) -> None:
        which = _verify_tells(cli, root, layout)
        seen[which] = seen.get(which, 0) + 1
        other = _copy(root, tmp_path / "revert-after")
        result = cli("apply", "-s", root)
        assert result.exit_code == 0, result.stdout + result.stderr
        _assert_settled(root, layout, "patched")
        assert cli("verify", "-s", root).exit_code == 0
        result = cli("revert", "-s", other)
        assert result.exit_code == 0, result.stdout + result.stderr
        _assert_settled(other, layout, "original")

    steps = _kill_points(["apply"], layout.pristine, tmp_path, check)
    kill_points.append(("apply", len(layout.files), steps))
    assert steps >= 10  # keep original, intent, target, RECORD, settle: two points per durable write
    # the kills fell on both sides of every replace (and, with two files, between them)
    assert len(seen) == len(layout.files) + 1, seen
    print(f"apply ({len(layout.files)} file(s)): {steps} kill points, files after the kill: {seen}")


def test_revert_killed_at_every_step(layout, tmp_path, cli, kill_points):
    seen: dict[str, int] = {}

    def check(n: int, root: Path) -> None:
        which = _verify_tells(cli, root, layout)
        seen[which] = seen.get(which, 0) + 1
        other = _copy(root, tmp_path / "apply-after")
        result = cli("revert", "-s", root)
        assert result.exit_code == 0, result.stdout + result.stderr
        _assert_settled(root, layout, "original")
        result = cli("apply", "-s", other)
        assert result.exit_code == 0, result.stdout + result.stderr
        _assert_settled(other, layout, "patched")

    steps = _kill_points(["revert"], layout.patched, tmp_path, check)
    kill_points.append(("revert", len(layout.files), steps))
    assert steps >= 6
    assert len(seen) == len(layout.files) + 1, seen
    print(f"revert ({len(layout.files)} file(s)): {steps} kill points, files after the kill: {seen}")


def test_forced_revert_killed_at_every_step_loses_no_bytes(one_file, tmp_path, cli, kill_points):
    """A drifted file's bytes are either still in place or kept in displaced/, whatever the kill."""
    layout = one_file
    start = _copy(layout.patched, tmp_path / "drifted")
    edited = layout.forms[NEMOTRON]["patched"] + b"# a hand edit after patching\n"
    original = layout.forms[NEMOTRON]["original"]
    (start / NEMOTRON).write_bytes(edited)

    def check(n: int, root: Path) -> None:
        data = (root / NEMOTRON).read_bytes()
        assert data in (edited, original)
        displaced = root / ".fp32patch" / "displaced"
        kept = [p.read_bytes() for p in displaced.iterdir()] if displaced.is_dir() else []
        assert data == edited or edited in kept, "the hand-edited bytes were lost"
        code, out = cli.json("verify", "-s", root)
        [entry] = [p for p in out["patches"] if p["id"] == NEMOTRON_ID]
        assert entry["status"] == ("drifted" if data == edited else "not-applied")
        result = cli("revert", "-s", root, "--force")
        assert result.exit_code == 0, result.stdout + result.stderr
        _assert_settled(root, layout, "original")

    steps = _kill_points(["revert", "--force"], start, tmp_path, check)
    kill_points.append(("revert --force", 1, steps))
    assert steps >= 8


@pytest.fixture(scope="module")
def kill_points():
    tried: list[tuple[str, int, int]] = []
    yield tried
    print(f"\nkill points tried: {sum(n for _, _, n in tried)} ({tried})")
