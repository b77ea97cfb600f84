"""The operation vocabulary as data: each operation's name, description, fields and load-time checks.

This is what a spec author sees (``fp32patch ops``) and what ``spec.py`` checks a spec
against when it loads. It parses code with ``ast`` only, so loading specs (for ``verify``,
``status``, ``list``) never imports libcst; ``ops.py`` holds how each operation edits a
tree, registered under the same names.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable
from dataclasses import dataclass

from fp32patch.patcher.model import Edit

CALL_ARGS = "${call_args}"
Fail = Callable[[str, str], None]

# Fields every edit may carry, with what they mean (shown by `fp32patch ops` and the README).
EDIT_FIELDS: dict[str, str] = {
    "id": "lower-case, dash-separated name of the edit; it is in the marker `# fp32patch: <patch> [<id>]`",
    "op": "the operation: one of `fp32patch ops`",
    "file": "which of the target's files it edits (a short name from [target] files); needed when there are several",
    "scope": "dotted class/def path of the anchor (`Cls.method`, `*` one name, `**` any run of names); empty: the module",
    "params": "the scope function's exact parameter names, in order (a signature change then refuses)",
    "match": "Python code with `...` holes, compared as syntax trees inside the scope (an expression, a statement "
    "or an `except X:` handler)",
    "regex": "a regular expression the scope's source text must contain (to tell scopes apart by string contents)",
    "count": "how many times the anchor must match, exactly (default 1); fewer or more is a refusal",
    "code": "the code to insert or put in place; `${call_args}` is the enclosing function's parameters after the "
    "first, forwarded as call arguments",
    "code_file": "instead of `code`: a file under fp32patch/patches/ (e.g. snippets/gate.py) whose text is the code",
    "catches": "insert_except_handler: the exception type of the handler to insert after",
    "skip_when": "patterns (tables of scope/match/params/regex/file, or names of the spec's [shapes]) that, all "
    "present, mean upstream fixed this part: the edit is skipped and the rest applied",
}


def parse_statements(code: str) -> list[ast.stmt]:
    """``code`` as statements (``${call_args}`` stands for arguments); raises SyntaxError."""
    return ast.parse(code.replace(CALL_ARGS, "_call_args").strip("\n") + "\n").body


@functools.lru_cache(maxsize=1024)
def statements_error(code: str) -> tuple[str, int | None] | None:
    """Why ``code`` is not Python statements (message, line), or None. Cached: a spec's
    variants repeat the same snippets, and specs load on every command."""
    try:
        parse_statements(code)
    except SyntaxError as exc:
        return exc.msg, exc.lineno
    return None


@functools.lru_cache(maxsize=1024)
def pattern_kind(code: str) -> str:
    """What a ``match`` pattern is: "expr", "stmt" or "handler"; raises SyntaxError/ValueError."""
    try:
        ast.parse(code.strip(), mode="eval")
        return "expr"
    except SyntaxError:
        pass
    try:
        body = ast.parse(code.strip()).body
    except SyntaxError:
        ast.parse("try:\n    pass\n" + code.strip())  # an `except X:` handler, or a SyntaxError
        return "handler"
    if len(body) != 1:
        raise ValueError(f"a match pattern is one statement, got {len(body)}")
    return "stmt"


def _statements_ok(edit: Edit, fail: Fail) -> None:
    error = statements_error(edit.code)
    if error is not None:
        fail("code", f"not valid Python statements: {error[0]} (line {error[1]})")


@dataclass(frozen=True)
class Operation:
    name: str
    description: str
    fields: tuple[str, ...]  # the fields it uses beyond id, op, file, code, count, skip_when
    call_args: bool  # whether `${call_args}` can mean something (the anchor is in a function)

    def validate(self, edit: Edit, fail: Fail) -> None:
        """Reject at load time a spec whose fields this operation cannot use (raise through ``fail``)."""
        if CALL_ARGS in edit.code and not self.call_args:
            fail("code", f"{CALL_ARGS} cannot mean anything in {self.name} (it has no function around it)")
        _CHECKS[self.name](edit, fail)


def _insert_after_imports(edit: Edit, fail: Fail) -> None:
    _statements_ok(edit, fail)
    if edit.anchor.scope or edit.anchor.match or edit.anchor.params:
        fail("scope", "insert_after_imports works on the module; give no scope, match or params")


def _prepend_to_body(edit: Edit, fail: Fail) -> None:
    _statements_ok(edit, fail)
    if not edit.anchor.scope:
        fail("scope", "prepend_to_body needs the function's scope")
    if edit.anchor.match:
        fail("match", "prepend_to_body anchors on its scope alone")


def _statement_anchored(name: str) -> Callable[[Edit, Fail], None]:
    def check(edit: Edit, fail: Fail) -> None:
        _statements_ok(edit, fail)
        if edit.anchor.match is None:
            fail("match", f"{name} needs a statement pattern to anchor on")
        elif pattern_kind(edit.anchor.match) == "handler":
            # an expression stands for the statement that is exactly it (a bare call, an await)
            fail("match", f"{name} anchors on a statement, got {edit.anchor.match!r}")

    return check


def _replace(edit: Edit, fail: Fail) -> None:
    if edit.anchor.match is None:
        fail("match", "replace needs a pattern to replace")
        return
    kind = pattern_kind(edit.anchor.match)
    if kind == "handler":
        fail("match", "replace works on expressions and statements, not except handlers")
    try:
        if kind == "expr":
            ast.parse(edit.code.replace(CALL_ARGS, "_call_args").strip(), mode="eval")
        else:
            parse_statements(edit.code)
    except SyntaxError as exc:
        fail("code", f"the replacement must be {'an expression' if kind == 'expr' else 'statements'}: {exc.msg}")


def _insert_except_handler(edit: Edit, fail: Fail) -> None:
    if edit.catches is None:
        fail("catches", "insert_except_handler needs the exception type it inserts after")
    if edit.anchor.match is not None:
        fail("match", "insert_except_handler anchors on its scope and `catches`")
    try:
        tree = ast.parse("try:\n    pass\n" + edit.code.replace(CALL_ARGS, "_call_args").strip("\n") + "\n")
        ok = len(tree.body) == 1 and isinstance(tree.body[0], ast.Try) and bool(tree.body[0].handlers)
    except SyntaxError as exc:
        fail("code", f"must be one or more `except ...:` handlers: {exc.msg}")
        return
    if not ok:
        fail("code", "must be one or more `except ...:` handlers")


_CHECKS: dict[str, Callable[[Edit, Fail], None]] = {
    "insert_after_imports": _insert_after_imports,
    "prepend_to_body": _prepend_to_body,
    "insert_before": _statement_anchored("insert_before"),
    "insert_after": _statement_anchored("insert_after"),
    "replace": _replace,
    "insert_except_handler": _insert_except_handler,
}

OPERATIONS: dict[str, Operation] = {
    op.name: op
    for op in (
        Operation(
            "insert_after_imports",
            "Insert module-level statements after the module's leading imports.",
            (),
            call_args=False,
        ),
        Operation(
            "prepend_to_body",
            "Insert statements at the start of a function's body (after its docstring).",
            ("scope", "params"),
            call_args=True,
        ),
        Operation(
            "insert_before",
            "Insert statements before each matched statement.",
            ("scope", "params", "match", "regex"),
            call_args=True,
        ),
        Operation(
            "insert_after",
            "Insert statements after each matched statement.",
            ("scope", "params", "match", "regex"),
            call_args=True,
        ),
        Operation(
            "replace",
            "Replace each matched expression or statement with new code.",
            ("scope", "params", "match", "regex"),
            call_args=True,
        ),
        Operation(
            "insert_except_handler",
            "Add except handlers to a try statement, after the handler that catches `catches`.",
            ("scope", "params", "regex", "catches"),
            call_args=True,
        ),
    )
}
