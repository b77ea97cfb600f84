"""A spec whose edit is skipped (its part fixed upstream) stays applied on the next look.

Applying such a spec leaves markers for the edits it made and none for the skipped one;
reading the patched file again must say `already-applied`, not `partially-applied`
(which `apply` refuses with exit 3 and `verify` reports as drifted).
"""

from __future__ import annotations

import pytest

from fp32patch.patcher.spec import parse_spec
from fp32patch.patcher.transform import transform

SPEC = parse_spec(
    """
schema = 1
id = "demo"
summary = "two edits, the second skipped where upstream added its own guard"

[target]
distribution = "demo"
path = "demo.py"

[[edits]]
id = "log"
op = "prepend_to_body"
scope = "handle"
code = "print(x)"

[[edits]]
id = "guard"
op = "prepend_to_body"
scope = "handle"
code = "callable(x)"
skip_when = [{ scope = "handle", match = "callable(...)" }]
""",
    "demo.toml",
)

# (source, edits applied, edits skipped)
CASES = [
    ("def handle(x):\n    return x\n", ["log", "guard"], []),
    ("def handle(x):\n    callable(x)\n    return x\n", ["log"], ["guard"]),
]


@pytest.mark.parametrize(("source", "edits", "skipped"), CASES)
def test_patched_file_reads_as_already_applied(source, edits, skipped):
    first = transform(SPEC, source.encode(), path="demo.py", version=None)
    assert (first.status, first.edits, first.skipped) == ("applied", edits, skipped)
    again = transform(SPEC, first.new or b"", path="demo.py", version=None)
    assert again.status == "already-applied"


def test_a_lost_marker_is_still_partially_applied():
    # the guard is upstream's, but the log edit's marker is gone: not a finished patch
    first = transform(SPEC, b"def handle(x):\n    callable(x)\n    return x\n", path="demo.py", version=None)
    assert first.new is not None
    marker_line = "# fp32patch: demo [log]"
    text = first.new.decode().replace(marker_line, "# fp32patch: demo [gone]")
    assert transform(SPEC, text.encode(), path="demo.py", version=None).status == "partially-applied"
