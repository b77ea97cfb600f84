"""Running a test file's Triton kernels through Triton's interpreter, on the CPU.

Triton reads ``TRITON_INTERPRET`` once, when it is first imported, and megatron-core imports it
before a suite's tests run: so a file whose tests need the interpreter runs itself again in a
child pytest that has the variable (``run_under_interpreter``), and marks those tests
``only_interpreted`` (skipped in the parent, which runs the child instead)."""

from __future__ import annotations

import os
import sys
import tempfile

import pytest

from tests.support import processes

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
only_interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the child pytest")


def run_under_interpreter(path: str, timeout: float = 600.0) -> None:
    """Run the test file ``path`` in a child pytest with ``TRITON_INTERPRET=1``; fail with the
    child's output unless it passed with no failure."""
    with tempfile.TemporaryFile("w+") as out:
        child = processes.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", path],
            timeout=timeout,
            env={**os.environ, "TRITON_INTERPRET": "1"},
            stdout=out,
            stderr=out,
            text=True,
        )
        out.seek(0)
        text = out.read()
    assert child.returncode == 0, text[-8000:]
    assert " passed" in text and " failed" not in text, text[-8000:]
