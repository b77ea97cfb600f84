"""How each operation of the vocabulary edits a tree: one small class each, applied by one pass.

An operation never walks the tree itself for editing: ``plan`` resolves its anchor in the
*original* module (so one edit's insertion can never become another edit's anchor) and
returns changes keyed by the original nodes; ``transform`` applies every change of every
edit in a single libcst pass. Each inserted or changed statement carries the marker
comment ``# fp32patch: <spec> [<edit>]``, which is how an applied edit is recognised.

Adding an operation: describe it in ``vocabulary.OPERATIONS`` (name, description, fields,
load-time checks), subclass ``Operation`` here with its ``plan``, register it in
``PLANNERS`` under the same name, and add its table of (before, after) and must-not-match
cases to tests/test_ops.py.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import libcst as cst

from fp32patch.patcher.markers import marker
from fp32patch.patcher.match import CodePattern, call_args, cst_expr_equals, descendants, expr_ast, find
from fp32patch.patcher.model import Edit, Status
from fp32patch.patcher.vocabulary import CALL_ARGS, OPERATIONS

Rewrite = Callable[[cst.CSTNode], cst.CSTNode | cst.FlattenSentinel | cst.RemovalSentinel]


class AnchorError(Exception):
    """An anchor matched a number of times other than the one the spec requires."""

    def __init__(self, edit: Edit, code: str, detail: str):
        super().__init__(detail)
        self.edit, self.code, self.detail = edit, code, detail


@dataclass
class Change:
    node: cst.CSTNode  # a node of the original module
    rewrite: Rewrite  # updated node -> replacement


def _marked(lines: Sequence[cst.EmptyLine], text: str, *, blank_before: int = 0) -> list[cst.EmptyLine]:
    return [*lines, *([cst.EmptyLine()] * blank_before), cst.EmptyLine(comment=cst.Comment(text))]


def _with_marker(node: cst.CSTNode, text: str, *, blank_before: int = 0) -> cst.CSTNode:
    if hasattr(node, "leading_lines"):
        return node.with_changes(leading_lines=_marked(node.leading_lines, text, blank_before=blank_before))
    raise TypeError(f"cannot mark {type(node).__name__}")


def _statements(code: str) -> list[cst.BaseStatement]:
    return list(_parsed_statements(code))


@functools.lru_cache(maxsize=512)
def _parsed_statements(code: str) -> tuple[cst.BaseStatement, ...]:
    # libcst's nodes are immutable: one parse of a snippet serves every anchor and every file of a run
    # (a spec inserts the same gate into many files; the release matrices transform them thousands of times)
    return tuple(cst.parse_module(code.strip("\n") + "\n").body)


def _expect(edit: Edit, found: int, what: str, extra: str = "") -> None:
    if found == edit.count:
        return
    code = Status.ANCHOR_MISSING if found < edit.count else Status.ANCHOR_AMBIGUOUS
    detail = f"{what} matched {found} time{'s' if found != 1 else ''}, expected {edit.count}"
    raise AnchorError(edit, code, detail + (f" ({extra})" if extra else ""))


def _near(found_near: list[str]) -> str:
    guesses = [n for n in found_near if n.startswith("did you mean")]
    found = [n for n in found_near if n not in guesses]
    return "; ".join([*(["found instead: " + "; ".join(found)] if found else []), *guesses])


def _code_at(module: cst.Module, edit: Edit, node: cst.CSTNode) -> str:
    """The edit's code for one anchor: ``${call_args}`` is the enclosing function's parameters."""
    if CALL_ARGS not in edit.code:
        return edit.code
    func = node if isinstance(node, cst.FunctionDef) else _enclosing(module, [node], (cst.FunctionDef,)).get(id(node))
    if not isinstance(func, cst.FunctionDef):
        raise AnchorError(edit, Status.EDIT_FAILED, f"{CALL_ARGS} is used, but the anchor is not inside a function")
    return edit.code.replace(CALL_ARGS, call_args(func))


def _body_start(block: cst.BaseSuite) -> int:
    """Index of the first statement after a docstring."""
    body = list(block.body) if isinstance(block, cst.IndentedBlock) else []
    if body and isinstance(body[0], cst.SimpleStatementLine) and len(body[0].body) == 1:
        first = body[0].body[0]
        if isinstance(first, cst.Expr) and isinstance(first.value, (cst.SimpleString, cst.ConcatenatedString)):
            return 1
    return 0


def _as_block(suite: cst.BaseSuite) -> cst.IndentedBlock:
    if isinstance(suite, cst.IndentedBlock):
        return suite
    # `def f(): return x` on one line: give it a real block so statements can go in front
    assert isinstance(suite, cst.SimpleStatementSuite)
    return cst.IndentedBlock(body=[cst.SimpleStatementLine(body=suite.body)])


class Operation:
    name = ""

    def plan(self, module: cst.Module, edit: Edit, spec_id: str) -> list[Change]:
        raise NotImplementedError


class InsertAfterImports(Operation):
    name = "insert_after_imports"

    def plan(self, module, edit, spec_id):
        new = _statements(edit.code)
        defined = _top_level_names(new)
        clash = sorted(defined & _top_level_names(module.body))
        if clash:
            raise AnchorError(edit, Status.ANCHOR_AMBIGUOUS, f"the module already defines {', '.join(clash)}")

        def rewrite(updated: cst.CSTNode) -> cst.CSTNode:
            assert isinstance(updated, cst.Module)
            body = list(updated.body)
            at = _after_imports(body)
            block = [_with_marker(new[0], marker(spec_id, edit.id), blank_before=2), *new[1:]]
            if at < len(body):
                # keep the file's rhythm: two blank lines between our block and what follows
                follower = body[at]
                blanks = sum(1 for line in follower.leading_lines if line.comment is None)
                if blanks < 2:
                    body[at] = follower.with_changes(
                        leading_lines=[*([cst.EmptyLine()] * (2 - blanks)), *follower.leading_lines]
                    )
            return updated.with_changes(body=[*body[:at], *block, *body[at:]])

        return [Change(module, rewrite)]


def _top_level_names(body: Sequence[cst.BaseStatement]) -> set[str]:
    names: set[str] = set()
    for stmt in body:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            names.add(stmt.name.value)
        elif isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                if isinstance(small, (cst.Assign, cst.AnnAssign)):
                    targets = small.targets if isinstance(small, cst.Assign) else [small]
                    for t in targets:
                        if isinstance(t.target, cst.Name):
                            names.add(t.target.value)
    return names


def _after_imports(body: list[cst.BaseStatement]) -> int:
    """Position after the last top-level import that comes before the first def or class."""
    at = _body_start(cst.IndentedBlock(body=body))
    for i, stmt in enumerate(body):
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            break
        if isinstance(stmt, cst.SimpleStatementLine) and any(
            isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body
        ):
            at = i + 1
    return at


class PrependToBody(Operation):
    name = "prepend_to_body"

    def plan(self, module, edit, spec_id):
        found = find(module, edit.anchor)
        funcs = [s for s in found.scopes if isinstance(s, cst.FunctionDef)]
        _expect(edit, len(funcs), f"function {edit.anchor.describe()}", _near(found.near_misses))
        changes = []
        for func in funcs:
            assert isinstance(func, cst.FunctionDef)
            new = _statements(_code_at(module, edit, func))
            new[0] = _with_marker(new[0], marker(spec_id, edit.id))

            def rewrite(updated: cst.CSTNode, new=new) -> cst.CSTNode:
                assert isinstance(updated, cst.FunctionDef)
                block = _as_block(updated.body)
                at = _body_start(block)
                body = list(block.body)
                return updated.with_changes(body=block.with_changes(body=[*body[:at], *new, *body[at:]]))

            changes.append(Change(func, rewrite))
        return changes


class _StatementAnchored(Operation):
    """Operations anchored on a statement pattern inside a scope."""

    def anchors(self, module: cst.Module, edit: Edit) -> list[cst.CSTNode]:
        found = find(module, edit.anchor, statement=True)
        _expect(edit, len(found.matches), edit.anchor.describe(), _near(found.near_misses))
        return found.matches


class InsertBefore(_StatementAnchored):
    name = "insert_before"

    def plan(self, module, edit, spec_id):
        changes = []
        for node in self.anchors(module, edit):
            new = _statements(_code_at(module, edit, node))

            def rewrite(updated: cst.CSTNode, new=new) -> cst.FlattenSentinel:
                # the comments above the anchor stay with the block that now starts here
                lead = list(getattr(updated, "leading_lines", []))
                first = new[0].with_changes(leading_lines=_marked(lead, marker(spec_id, edit.id)))
                return cst.FlattenSentinel([first, *new[1:], updated.with_changes(leading_lines=[])])

            changes.append(Change(node, rewrite))
        return changes


class InsertAfter(_StatementAnchored):
    name = "insert_after"

    def plan(self, module, edit, spec_id):
        changes = []
        for node in self.anchors(module, edit):
            new = _statements(_code_at(module, edit, node))
            new[0] = _with_marker(new[0], marker(spec_id, edit.id))
            changes.append(Change(node, lambda updated, new=new: cst.FlattenSentinel([updated, *new])))
        return changes


class Replace(Operation):
    name = "replace"

    def plan(self, module, edit, spec_id):
        found = find(module, edit.anchor)
        _expect(edit, len(found.matches), edit.anchor.describe(), _near(found.near_misses))
        kind = CodePattern.parse(edit.anchor.match or "").kind
        text = marker(spec_id, edit.id)
        if kind == "stmt":
            changes = []
            for node in found.matches:
                new = _statements(_code_at(module, edit, node))

                def rewrite(updated: cst.CSTNode, new=new) -> cst.FlattenSentinel:
                    lead = list(getattr(updated, "leading_lines", []))
                    return cst.FlattenSentinel([new[0].with_changes(leading_lines=_marked(lead, text)), *new[1:]])

                changes.append(Change(node, rewrite))
            return changes
        changes = []
        for node in found.matches:
            expr = cst.parse_expression(_code_at(module, edit, node).strip())
            changes.append(Change(node, lambda updated, expr=expr: expr))
        # the marker goes on the statement that holds each replaced expression
        for stmt in _enclosing_statements(module, found.matches):
            changes.append(Change(stmt, lambda updated: _with_marker(updated, text)))
        return changes


class _Enclosing(cst.CSTVisitor):
    """For each wanted node, the innermost node of ``kinds`` that holds it (the node itself excluded)."""

    def __init__(self, wanted: set[int], kinds: tuple[type, ...]):
        super().__init__()
        self.wanted, self.kinds = wanted, kinds
        self.stack: list[cst.CSTNode] = []
        self.found: dict[int, cst.CSTNode] = {}

    def on_visit(self, node: cst.CSTNode) -> bool:
        if id(node) in self.wanted and self.stack:
            self.found[id(node)] = self.stack[-1]
        if isinstance(node, self.kinds):
            self.stack.append(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        if self.stack and self.stack[-1] is original_node:
            self.stack.pop()


def _enclosing(module: cst.Module, nodes: list[cst.CSTNode], kinds: tuple[type, ...]) -> dict[int, cst.CSTNode]:
    visitor = _Enclosing({id(n) for n in nodes}, kinds)
    module.visit(visitor)
    return visitor.found


def _enclosing_statements(module: cst.Module, nodes: list[cst.CSTNode]) -> list[cst.CSTNode]:
    """The innermost statement holding each node, once each."""
    found = _enclosing(module, nodes, (cst.SimpleStatementLine, cst.BaseCompoundStatement))
    return list({id(s): s for n in nodes if (s := found.get(id(n))) is not None}.values())


class InsertExceptHandler(Operation):
    name = "insert_except_handler"

    def plan(self, module, edit, spec_id):
        found = find(module, edit.anchor)
        want = expr_ast(edit.catches or "")
        hits: list[tuple[cst.Try, int]] = []
        for scope in found.scopes:
            for node in descendants(scope):
                if isinstance(node, cst.Try) and all(node is not t for t, _ in hits):
                    for i, handler in enumerate(node.handlers):
                        if cst_expr_equals(module, handler.type, want):
                            hits.append((node, i))
        what = f"`except {edit.catches}` in {edit.anchor.describe()}"
        _expect(edit, len(hits), what, _near(found.near_misses))
        changes = []
        for node, index in hits:
            new = _handlers(_code_at(module, edit, node))
            new[0] = _with_marker(new[0], marker(spec_id, edit.id))

            def rewrite(updated: cst.CSTNode, index=index, new=new) -> cst.CSTNode:
                assert isinstance(updated, cst.Try)
                handlers = list(updated.handlers)
                return updated.with_changes(handlers=[*handlers[: index + 1], *new, *handlers[index + 1 :]])

            changes.append(Change(node, rewrite))
        return changes


def _handlers(code: str) -> list[cst.ExceptHandler]:
    return list(_parsed_handlers(code))


@functools.lru_cache(maxsize=128)
def _parsed_handlers(code: str) -> tuple[cst.ExceptHandler, ...]:
    stmt = cst.parse_module("try:\n    pass\n" + code.strip("\n") + "\n").body[0]
    assert isinstance(stmt, cst.Try)
    return tuple(stmt.handlers)


PLANNERS: dict[str, Operation] = {
    op.name: op
    for op in (
        InsertAfterImports(),
        PrependToBody(),
        InsertBefore(),
        InsertAfter(),
        Replace(),
        InsertExceptHandler(),
    )
}


assert set(PLANNERS) == set(OPERATIONS), "every operation of the vocabulary has a planner, and no other"


@functools.cache
def _node_fields(kind: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(kind))


def _children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The nodes held in ``node``'s fields (any order): read off the dataclass, where libcst's own
    ``children`` builds every child again through a visit."""
    out: list[cst.CSTNode] = []
    for name in _node_fields(type(node)):
        value = getattr(node, name)
        if isinstance(value, cst.CSTNode):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, cst.CSTNode))
    return out


def _on_the_way(module: cst.Module, targets: set[int]) -> set[int]:
    """The ids of the nodes from ``module`` down to each target node, the targets included: the
    only subtrees a rewrite can change. (libcst's transformer rebuilds every node it enters, about
    50 us each; a module's other subtrees are kept as they are, the same objects and the same code.)
    The walk stops once every target is found: a parsed module holds each node object once."""
    on_the_way: set[int] = set()
    path: list[cst.CSTNode] = []
    todo: list[tuple[cst.CSTNode, int]] = [(module, 0)]
    found: set[int] = set()
    while todo and len(found) < len(targets):  # (no recursion: a deep expression cannot exhaust the stack)
        node, depth = todo.pop()
        del path[depth:]
        path.append(node)
        if id(node) in targets:
            on_the_way.update(id(n) for n in path)
            found.add(id(node))
        todo.extend((child, depth + 1) for child in _children(node))
    return on_the_way


class _Apply(cst.CSTTransformer):
    def __init__(self, changes: list[Change], module: cst.Module):
        super().__init__()
        self.by_node: dict[int, list[Rewrite]] = {}
        for change in changes:
            self.by_node.setdefault(id(change.node), []).append(change.rewrite)
        self.done: set[int] = set()
        self.enter = _on_the_way(module, set(self.by_node))

    def on_visit(self, node: cst.CSTNode) -> bool:
        return id(node) in self.enter

    def on_leave(self, original_node, updated_node):
        rewrites = self.by_node.get(id(original_node))
        if not rewrites:
            return updated_node
        self.done.add(id(original_node))
        result = updated_node
        for rewrite in rewrites:
            if isinstance(result, cst.FlattenSentinel):
                raise ValueError("two edits rewrite the same statement into several; split the spec's anchors")
            result = rewrite(result)
        return result


def apply_changes(module: cst.Module, changes: list[Change]) -> cst.Module:
    transformer = _Apply(changes, module)
    result = module.visit(transformer)
    missed = set(transformer.by_node) - transformer.done
    if missed:  # an anchor inside a replaced subtree: the spec's edits overlap
        raise ValueError("edits overlap: one edit replaces code another edit anchors on")
    assert isinstance(result, cst.Module)
    return result
