"""Every process group the tests make meets at a file store, never at a port found free (issue 43).

A port found free and closed again can be taken before rank 0's store listens: on a busy machine
a cold ``make test`` lost one spawn of the megatron suite (52 tests) to ``EADDRINUSE``. The ranks
here meet at ``tests/support/rendezvous.py``'s file store (the main suite's own two-rank check,
test_chunked_logprobs.py, runs through it), and the test files are read for the old ways back in.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# stand-ins written in upstream's shapes (NeMo-RL's worker calls init_process_group itself) are not ours
NOT_OURS = {TESTS / "fixtures"}
# MASTER_PORT that no store listens on: TRL's colocated vLLM reads env:// only where the group grpo_run
# made is gone (a fallback); verl's Worker records the variables of a group that already exists
FALLBACK = {TESTS / "heavy" / "trl" / "harness.py", TESTS / "heavy" / "verl" / "verl_harness.py"}


def _ours() -> list[Path]:
    return [p for p in sorted(TESTS.rglob("*.py")) if not any(p.is_relative_to(n) for n in NOT_OURS)]


def test_no_test_picks_a_port_for_its_ranks():
    found = []
    for path in _ours():
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        for pattern in (r"MASTER_PORT", r"tcp://", r"\bfree_port\("):
            if re.search(pattern, text) and path not in FALLBACK:
                found.append(f"{path.relative_to(TESTS)}: {pattern}")
        for call in re.finditer(r"init_process_group\((.*?)\)\n", text, re.S):
            if "init_method" not in call.group(1):
                found.append(f"{path.relative_to(TESTS)}: init_process_group without init_method")
    assert not found, found
