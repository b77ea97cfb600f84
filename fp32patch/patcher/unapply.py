"""Take specs' marked insertions back out of their files' texts. Pure, like ``transform``.

Where a file carries a patch's markers but no record says what it was before (the state
folder was left behind or moved aside), stripping the marked statements and applying the
specs again tells whether the file holds exactly what they write. The stripped text is
*a* file the specs turn into today's bytes, not necessarily the stock one (blank lines an
insertion added next to its block stay), so it is evidence, never bytes to restore: those
come from the release itself (``revert --against``).

Each marker starts the block its edit inserted, whose length is that of the edit's code.
An edit that put code in place of upstream's (``replace``) cannot be taken out: None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import libcst as cst

from fp32patch.patcher.markers import MARKER_RE, markers_in
from fp32patch.patcher.model import Spec

_Block = tuple[str, int]  # the edit's operation, and how many statements (or handlers) it inserts


def _length(op: str, code: str) -> int:
    code = code.replace("${call_args}", "_call_args").strip("\n") + "\n"
    if op == "insert_except_handler":
        try_stmt = cst.parse_module("try:\n    pass\n" + code).body[0]
        assert isinstance(try_stmt, cst.Try)
        return len(try_stmt.handlers)
    return len(cst.parse_module(code).body)


def _blocks(specs: Sequence[Spec]) -> dict[tuple[str, str], _Block] | None:
    """(patch, edit) -> what its marker starts; None if an edit cannot be taken out."""
    blocks: dict[tuple[str, str], _Block] = {}
    for spec in specs:
        for variant in spec.variants:
            for edit in variant.edits:
                if edit.op == "replace":
                    return None
                block = (edit.op, _length(edit.op, edit.code))
                if blocks.setdefault((spec.id, edit.id), block) != block:
                    return None  # variants insert blocks of different lengths: which one is here is unknown
    return blocks


class _Strip(cst.CSTTransformer):
    def __init__(self, blocks: dict[tuple[str, str], _Block]):
        super().__init__()
        self.blocks = blocks
        self.failed = False

    def _marker(self, node: cst.CSTNode) -> tuple[_Block, list[cst.EmptyLine]] | None:
        """The block a marker on ``node`` starts, and the lines above that marker."""
        lines = list(getattr(node, "leading_lines", ()))
        for i, line in enumerate(lines):
            m = MARKER_RE.match(line.comment.value) if line.comment is not None else None
            if m and (m["spec"], m["edit"]) in self.blocks:
                return self.blocks[(m["spec"], m["edit"])], lines[:i]
        return None

    def _strip(self, nodes: Sequence[cst.CSTNode]) -> list[cst.CSTNode]:
        kept: list[cst.CSTNode] = []
        skip = 0
        carried: list[cst.EmptyLine] = []
        for node in nodes:
            if skip:
                skip -= 1
                continue
            found = self._marker(node)
            if found is not None:
                (op, length), above = found
                skip = length - 1
                # insert_before took over the anchor's own comments: they go back to it
                carried = above if op == "insert_before" else []
                continue
            if carried:
                node = node.with_changes(leading_lines=[*carried, *node.leading_lines])
                carried = []
            kept.append(node)
        if skip or carried:
            self.failed = True  # a block that runs past its body: not what an edit inserted
        return kept

    def leave_Module(self, original_node, updated_node):
        return updated_node.with_changes(body=self._strip(updated_node.body))

    def _nonempty(self, node: cst.CSTNode, field: str) -> cst.CSTNode:
        kept = self._strip(getattr(node, field))
        if not kept:  # a block or a try left empty was never what an insertion went into
            self.failed = True
            return node
        return node.with_changes(**{field: kept})

    def leave_IndentedBlock(self, original_node, updated_node):
        return self._nonempty(updated_node, "body")

    def leave_Try(self, original_node, updated_node):
        return self._nonempty(updated_node, "handlers")


def strip(specs: Sequence[Spec], files: Mapping[str, bytes | None]) -> dict[str, bytes | None] | None:
    """``files`` with every marked insertion of ``specs`` taken out; None where that cannot be done."""
    blocks = _blocks(specs)
    if blocks is None:
        return None
    out: dict[str, bytes | None] = {}
    for path, data in files.items():
        if data is None:
            out[path] = None
            continue
        bom = data.startswith(b"\xef\xbb\xbf")
        try:
            module = cst.parse_module(data[3:].decode("utf-8") if bom else data.decode("utf-8"))
        except (UnicodeDecodeError, cst.ParserSyntaxError):
            return None
        stripper = _Strip(blocks)
        text = module.visit(stripper).code
        if stripper.failed or any(markers_in(text, s.id) for s in specs):
            return None  # a marker where no insertion starts (the top of a file, say): cannot tell
        out[path] = (b"\xef\xbb\xbf" if bom else b"") + text.encode("utf-8")
    return out
