"""Many fp32patch processes on one import root at once: one lock, no torn file, one valid manifest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fp32patch.patcher.apply import apply as apply_patches
from fp32patch.patcher.state import StateDir
from fp32patch.patcher.transaction import record_hash
from tests.conftest import NEMOTRON
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

RECORD = "vllm-0.33.0.dist-info/RECORD"
NEMOTRON_ID = "nemotron-h-fp32-lm-head"
MARKERS = ("[runtime-gate]", "[route-compute-logits]", "[refit-notify]")


def _nemotron(out: dict) -> dict | None:
    """This patch's entry (a vLLM root lacks the other patches' targets)."""
    return next((p for p in out["patches"] if p["id"] == NEMOTRON_ID), None)


def _start(*args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "FP32PATCH_CRASH_AT"}
    return subprocess.Popen(
        [sys.executable, "-m", "fp32patch", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


class Watcher(threading.Thread):
    """Reads the target, its RECORD and the manifest in a loop while the processes run."""

    def __init__(self, root: Path, allowed: set[bytes]):
        super().__init__(daemon=True)
        self.root, self.allowed = root, allowed
        self.stop = threading.Event()
        self.reads = 0
        self.problems: list[str] = []

    def run(self) -> None:
        manifest = self.root / ".fp32patch" / "manifest.json"
        while not self.stop.is_set():
            data = (self.root / NEMOTRON).read_bytes()
            if data not in self.allowed:
                self.problems.append(f"torn target ({len(data)} bytes)")
            try:
                raw = manifest.read_bytes()
            except FileNotFoundError:
                raw = None
            if raw is not None:
                try:
                    json.loads(raw)
                except ValueError:
                    self.problems.append(f"manifest not valid JSON ({len(raw)} bytes)")
            self.reads += 1


@pytest.fixture
def root(tmp_path) -> Path:
    return import_root_from_members("vllm", "0.33.0", [NEMOTRON], tmp_path / "sp")


@pytest.fixture
def forms(root, tmp_path) -> dict[str, bytes]:
    """The target's original and patched bytes (patched in a copy)."""
    import shutil

    other = tmp_path / "reference"
    shutil.copytree(root, other)
    assert apply_patches([], [other]).ok
    return {"original": (root / NEMOTRON).read_bytes(), "patched": (other / NEMOTRON).read_bytes()}


def _consistent(root: Path, forms: dict[str, bytes], cli) -> str:
    """The root after the storm: a whole file, RECORD and manifest agreeing with it, verify too."""
    data = (root / NEMOTRON).read_bytes()
    which = next(k for k, v in forms.items() if v == data)
    row = next(line for line in (root / RECORD).read_text().splitlines() if line.startswith(NEMOTRON + ","))
    assert row.split(",")[1] == record_hash(data)
    if which == "patched":
        entries = json.loads((root / ".fp32patch" / "manifest.json").read_text())["entries"]
        assert [e["state"] for e in entries] == ["applied"]
    else:  # the last writer was a full revert: nothing of ours stays
        assert not (root / ".fp32patch").exists()
    code, out = cli.json("verify", "-s", root)
    assert _nemotron(out)["status"] == ("applied" if which == "patched" else "not-applied")
    assert not list(root.rglob("*fp32patch-tmp*"))
    return which


def test_sixteen_applies_at_once(root, forms, cli):
    watcher = Watcher(root, set(forms.values()))
    watcher.start()
    procs = [_start("apply", "-s", str(root), "--json") for _ in range(16)]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    watcher.stop.set()
    watcher.join()

    assert [code for code, _, _ in results] == [0] * 16, [err for _, _, err in results if err]
    statuses = sorted(_nemotron(json.loads(out))["status"] for _, out, _ in results)
    assert statuses == ["already-applied"] * 15 + ["applied"]
    assert watcher.reads > 0 and watcher.problems == []
    data = (root / NEMOTRON).read_text()
    assert [data.count(m) for m in MARKERS] == [1, 1, 1]  # patched once, not once per process
    assert _consistent(root, forms, cli) == "patched"


def test_another_process_wins_between_plan_and_lock(root, forms, monkeypatch):
    """apply plans without the lock, then re-reads under it: a win by someone else in between is seen."""
    real_lock = StateDir.lock
    raced = []

    def lock_after_a_rival(self):
        if not raced:
            raced.append(subprocess.run([sys.executable, "-m", "fp32patch", "apply", "-s", str(root)]).returncode)
        return real_lock(self)

    monkeypatch.setattr(StateDir, "lock", lock_after_a_rival)
    report = apply_patches([], [root])
    assert raced == [0]  # the rival patched the file after our plan said "applied"
    assert report.ok and [o.status for o in report.outcomes if o.patch == NEMOTRON_ID] == ["already-applied"]
    assert (root / NEMOTRON).read_bytes() == forms["patched"]
    assert len(json.loads((root / ".fp32patch" / "manifest.json").read_text())["entries"]) == 1


def test_applies_and_reverts_at_once_serialise(root, forms, cli):
    watcher = Watcher(root, set(forms.values()))
    watcher.start()
    procs = [_start(cmd, "-s", str(root), "--json") for _ in range(8) for cmd in ("apply", "revert")]
    results = [(p.wait(timeout=300), p.stdout.read(), p.stderr.read()) for p in procs]
    watcher.stop.set()
    watcher.join()

    assert [code for code, _, _ in results] == [0] * 16, [err for _, _, err in results if err]
    reports = [json.loads(out) for _, out, _ in results]
    assert any(_nemotron(r) and _nemotron(r)["status"] == "applied" for r in reports)
    assert watcher.reads > 0 and watcher.problems == []
    _consistent(root, forms, cli)

    # whatever order they ran in, the next revert gives back the exact original
    assert cli("revert", "-s", root).exit_code == 0
    assert _consistent(root, forms, cli) == "original"
    assert (root / NEMOTRON).read_bytes() == forms["original"]
