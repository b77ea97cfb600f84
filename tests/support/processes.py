"""Processes a test starts, and everything they start, gone when the test is done with them.

A vLLM server or a script that builds a vLLM ``LLM`` starts an engine core of its own (and, for
some releases, workers): stopping the process the test started leaves those running when they
outlive their parent's SIGTERM, each holding its model and KV cache (one SkyRL server's engine
core held 0.7 GiB for half an hour on this machine before it was noticed). So a test starts such
a process as the leader of a session of its own (``start``), and ``stop`` ends the whole process
group: SIGTERM, a grace period, then SIGKILL for whatever is left, the leader's exit included.
``run`` is ``subprocess.run`` with the same ending, on success, failure and timeout alike.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence
from typing import Any


def start(args: Sequence[str], **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **popen)`` as the leader of a new session (its own process group)."""
    return subprocess.Popen(list(args), start_new_session=True, **popen)


def stop(process: subprocess.Popen, grace_s: float = 30.0) -> None:
    """End ``process`` and every process of its group: SIGTERM to the group, ``grace_s`` seconds
    for the leader to exit, then SIGKILL to what is left of the group."""
    if process.poll() is None:
        _signal(process, signal.SIGTERM)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    _signal(process, signal.SIGKILL)  # what outlived the leader, or the leader itself
    process.wait()


def run(args: Sequence[str], *, timeout: float, **popen: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(args, timeout=timeout, **popen)`` (output to files or inherited, not
    captured), leaving no process of its group behind; raises ``subprocess.TimeoutExpired``
    after stopping them all."""
    process = start(args, **popen)
    try:
        code = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(process, grace_s=5.0)
        raise
    stop(process)  # the leader is done: its group's stragglers go too
    return subprocess.CompletedProcess(list(args), code)


def _signal(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:  # nothing of the group is left
        pass
