"""tests/support/processes.py: what a test starts goes away with everything it started, as a vLLM
server's engine core must (one outlived its server for half an hour)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import processes

# A leader that starts a child ignoring SIGTERM (as an engine core busy shutting down can), writes
# the child's pid, then exits at once (``exit``) or waits to be stopped (``wait``).
LEADER = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
    stdout=subprocess.PIPE)
child.stdout.readline()
open(sys.argv[1], "w").write(str(child.pid))
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent, init here) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(")")[-1].split()[0] == "Z")


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _child_pid(path: Path, within_s: float = 30.0) -> int:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return int(path.read_text())
        time.sleep(0.1)
    raise AssertionError("the leader did not start its child")


def test_stop_ends_a_child_that_ignores_sigterm(tmp_path):
    pid_file = tmp_path / "child"
    process = processes.start([sys.executable, "-c", LEADER, str(pid_file), "wait"])
    child = _child_pid(pid_file)
    assert _alive(child)
    processes.stop(process, grace_s=2)
    assert process.returncode is not None
    assert _gone(child)


def test_run_ends_what_outlives_a_finished_leader(tmp_path):
    pid_file = tmp_path / "child"
    done = processes.run([sys.executable, "-c", LEADER, str(pid_file), "exit"], timeout=60)
    assert done.returncode == 0
    assert _gone(int(pid_file.read_text()))


def test_run_past_its_timeout_raises_and_leaves_nothing(tmp_path):
    pid_file = tmp_path / "child"
    with pytest.raises(subprocess.TimeoutExpired):
        processes.run([sys.executable, "-c", LEADER, str(pid_file), "wait"], timeout=15)
    assert _gone(_child_pid(pid_file))


def test_stopping_a_group_that_is_gone_is_quiet():
    process = processes.start([sys.executable, "-c", "pass"])
    process.wait()
    processes.stop(process)  # nothing left to signal: no error
    assert process.returncode == 0
