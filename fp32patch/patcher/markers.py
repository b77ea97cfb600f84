"""The marker comment every inserted statement carries, and how to find them in a file.

``# fp32patch: <patch> [<edit>]`` on a line of its own. Reading markers needs only the
tokenizer, so commands that merely check state never import libcst.
"""

from __future__ import annotations

import io
import re
import tokenize

MARKER_RE = re.compile(r"^[ \t]*# fp32patch: (?P<spec>[a-z0-9-]+) \[(?P<edit>[a-z0-9-]+)\]", re.MULTILINE)


def marker(spec_id: str, edit_id: str) -> str:
    return f"# fp32patch: {spec_id} [{edit_id}]"


def markers_in(text: str, spec_id: str) -> set[str]:
    """The edits of ``spec_id`` whose marker comment is in ``text``.

    Only real comments on a line of their own count: marker-like text inside a string
    (a docstring quoting a marker, say) must not make an unpatched file read as patched.
    Text that does not tokenize (a broken file) is searched line by line instead.
    """
    try:
        lines = [
            tok.line
            for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT and not tok.line[: tok.start[1]].strip()
        ]
    except (tokenize.TokenError, SyntaxError):
        lines = [text]
    return {m["edit"] for line in lines for m in MARKER_RE.finditer(line) if m["spec"] == spec_id}
