"""Anchors: find scopes and code shapes in a libcst tree, formatting-blind.

A scope is a dotted path of class and function names (``NemotronHForCausalLM.compute_logits``);
``*`` stands for one name and ``**`` for any run of names, so ``**.create_chat_completion``
finds a route however deeply it is nested. A code pattern is Python with ``...`` holes:
``raise ValueError(...)`` matches that raise with any arguments. Patterns are compared as
Python ASTs, so line breaks, parentheses, quotes and comments never decide a match.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from fnmatch import fnmatchcase

import libcst as cst

from fp32patch.patcher.model import Pattern
from fp32patch.patcher.vocabulary import pattern_kind

# ast types -> the libcst node types that can render to them (a pre-filter; unknown
# types fall back to every expression or statement).
_EXPR_TYPES: dict[type, tuple[type, ...]] = {
    ast.Call: (cst.Call,),
    ast.Attribute: (cst.Attribute,),
    ast.Name: (cst.Name,),
    ast.JoinedStr: (cst.FormattedString, cst.ConcatenatedString),
    ast.BinOp: (cst.BinaryOperation,),
    ast.BoolOp: (cst.BooleanOperation,),
    ast.Compare: (cst.Comparison,),
    ast.Subscript: (cst.Subscript,),
    ast.Tuple: (cst.Tuple,),
    ast.Dict: (cst.Dict,),
    ast.List: (cst.List,),
    ast.Await: (cst.Await,),
    # literals: a string pattern matches string literals in code, never comments
    ast.Constant: (cst.SimpleString, cst.ConcatenatedString, cst.Integer, cst.Float, cst.Imaginary, cst.Name),
}
_STMT_TYPES: dict[type, tuple[type, ...]] = {
    ast.If: (cst.If,),
    ast.Try: (cst.Try,),
    ast.With: (cst.With,),
    ast.AsyncWith: (cst.With,),
    ast.For: (cst.For,),
    ast.AsyncFor: (cst.For,),
    ast.While: (cst.While,),
    ast.FunctionDef: (cst.FunctionDef,),
    ast.AsyncFunctionDef: (cst.FunctionDef,),
    ast.ClassDef: (cst.ClassDef,),
}
_IGNORED_FIELDS = {"ctx", "type_comment", "kind"}


def _is_hole(node: object) -> bool:
    if isinstance(node, ast.Expr):
        node = node.value
    return isinstance(node, ast.Constant) and node.value is Ellipsis


def _match_list(pattern: list, nodes: list) -> bool:
    if not pattern:
        return not nodes
    head, rest = pattern[0], pattern[1:]
    if isinstance(head, ast.AST) and _is_hole(head):
        return any(_match_list(rest, nodes[i:]) for i in range(len(nodes) + 1))
    return bool(nodes) and ast_match(head, nodes[0]) and _match_list(rest, nodes[1:])


def ast_match(pattern: object, node: object) -> bool:
    """Structural equality where ``...`` in the pattern stands for anything."""
    if isinstance(pattern, ast.expr) and _is_hole(pattern):
        return isinstance(node, ast.AST)
    if isinstance(pattern, list):
        return isinstance(node, list) and _match_list(pattern, node)
    if not isinstance(pattern, ast.AST):
        return pattern == node
    if type(pattern) is not type(node):
        return False
    if isinstance(pattern, ast.Call) and len(pattern.args) == 1 and _is_hole(pattern.args[0]) and not pattern.keywords:
        # f(...) is "f called with anything", keywords included
        return ast_match(pattern.func, node.func)  # type: ignore[attr-defined]
    for name in pattern._fields:
        if name in _IGNORED_FIELDS:
            continue
        want, got = getattr(pattern, name, None), getattr(node, name, None)
        if isinstance(pattern, ast.ExceptHandler) and name == "name" and want is None:
            continue  # `except X:` in a pattern does not care how the handler names it
        if not ast_match(want, got):
            return False
    return True


@dataclass(frozen=True)
class CodePattern:
    """A parsed ``match`` string: one expression, one statement, or one except handler."""

    kind: str  # "expr" | "stmt" | "handler"
    tree: ast.AST

    @classmethod
    def parse(cls, code: str, *, statement: bool = False) -> CodePattern:
        """``statement``: the pattern anchors a statement, so an expression (a bare call, an
        ``await``) stands for the statement that is exactly that expression."""
        kind = pattern_kind(code)
        if kind == "expr" and statement:
            kind = "stmt"
        if kind == "expr":
            return cls(kind, ast.parse(code.strip(), mode="eval").body)
        if kind == "stmt":
            return cls(kind, ast.parse(code.strip()).body[0])
        tree = ast.parse("try:\n    pass\n" + code.strip())
        return cls(kind, tree.body[0].handlers[0])  # type: ignore[attr-defined]

    def cst_types(self) -> tuple[type, ...]:
        if self.kind == "expr":
            return _EXPR_TYPES.get(type(self.tree), (cst.BaseExpression,))
        if self.kind == "handler":
            return (cst.ExceptHandler,)
        compound = _STMT_TYPES.get(type(self.tree))
        return compound or (cst.SimpleStatementLine,)

    def matches(self, module: cst.Module, node: cst.CSTNode) -> bool:
        parsed = _as_ast(module, node, self.kind)
        return parsed is not None and ast_match(self.tree, parsed)


def _as_ast(module: cst.Module, node: cst.CSTNode, kind: str) -> ast.AST | None:
    code = module.code_for_node(node)
    try:
        if kind == "expr":
            return ast.parse(f"(\n{code}\n)", mode="eval").body
        if kind == "handler":
            handler = code.lstrip()
            return ast.parse("try:\n    pass\n" + handler).body[0].handlers[0]  # type: ignore[attr-defined]
        body = ast.parse(code.lstrip()).body
    except SyntaxError:
        return None
    return body[0] if len(body) == 1 else None


def expr_ast(code: str) -> ast.AST:
    return ast.parse(code.strip(), mode="eval").body


def cst_expr_equals(module: cst.Module, node: cst.CSTNode | None, pattern: ast.AST) -> bool:
    if node is None:
        return False
    parsed = _as_ast(module, node, "expr")
    return parsed is not None and ast_match(pattern, parsed)


# ---------------------------------------------------------------- scopes


def _scope_matches(pattern: list[str], path: tuple[str, ...]) -> bool:
    if not pattern:
        return not path
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_scope_matches(rest, path[i:]) for i in range(len(path) + 1))
    return bool(path) and fnmatchcase(path[0], head) and _scope_matches(rest, path[1:])


class _Collect(cst.CSTVisitor):
    """One traversal that records every node (``node.children`` re-visits per call)."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        self.nodes.append(node)
        return True


def descendants(node: cst.CSTNode) -> list[cst.CSTNode]:
    """``node`` and every node below it, in source order."""
    collect = _Collect()
    node.visit(collect)
    return collect.nodes


class _CollectOwn(_Collect):
    """Like ``_Collect``, but a function's own code only: a def or class nested in it is recorded
    and not entered (its body runs only when something calls it, not as part of the function)."""

    def __init__(self, root: cst.CSTNode) -> None:
        super().__init__()
        self.root = root
        self.nested: list[cst.CSTNode] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if node is not self.root and isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            self.nested.append(node)
            return False
        return super().on_visit(node)


def own_descendants(scope: cst.CSTNode) -> tuple[list[cst.CSTNode], list[cst.CSTNode]]:
    """The nodes an anchor in ``scope`` may be: a function's own code (not that of a def or class
    nested in it); a class's or a module's every node. Also the nested defs and classes left out."""
    if not isinstance(scope, cst.FunctionDef):
        return descendants(scope), []
    collect = _CollectOwn(scope)
    scope.visit(collect)
    return collect.nodes, collect.nested


def _statement_bodies(stmt: cst.CSTNode) -> Iterator[cst.CSTNode]:
    """The statements directly inside a compound statement (all of its blocks), in order."""
    parts: list[object] = [getattr(stmt, "body", None)]
    if isinstance(stmt, (cst.Try, cst.TryStar)):
        parts += [h.body for h in stmt.handlers]
    if isinstance(stmt, cst.Match):
        parts += [case.body for case in stmt.cases]
    orelse = getattr(stmt, "orelse", None)
    parts.append(orelse if isinstance(orelse, cst.If) else getattr(orelse, "body", None))
    parts.append(getattr(getattr(stmt, "finalbody", None), "body", None))
    for part in parts:
        if isinstance(part, cst.If):
            yield part  # an elif: walked as a statement of its own
        elif isinstance(part, cst.IndentedBlock):
            yield from part.body


def walk(node: cst.CSTNode, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], cst.CSTNode]]:
    """Every statement with the class/def path that encloses it (a def is inside its own path).

    Only statements are visited: classes and functions can only be statements, so scope
    finding never needs to look inside expressions.
    """
    if isinstance(node, (cst.ClassDef, cst.FunctionDef)):
        path = (*path, node.name.value)
    yield path, node
    children = node.body if isinstance(node, cst.Module) else _statement_bodies(node)
    for child in children:
        if isinstance(child, cst.BaseCompoundStatement):
            yield from walk(child, path)


def param_names(func: cst.FunctionDef) -> tuple[str, ...]:
    p = func.params
    names = [x.name.value for x in (*p.posonly_params, *p.params)]
    if isinstance(p.star_arg, cst.Param):
        names.append("*" + p.star_arg.name.value)
    names += [x.name.value for x in p.kwonly_params]
    if p.star_kwarg is not None:
        names.append("**" + p.star_kwarg.name.value)
    return tuple(names)


def call_args(func: cst.FunctionDef) -> str:
    """The function's own parameters after the first, forwarded as call arguments."""
    p = func.params
    positional = [x.name.value for x in (*p.posonly_params, *p.params)][1:]
    parts = list(positional)
    if isinstance(p.star_arg, cst.Param):
        parts.append("*" + p.star_arg.name.value)
    parts += [f"{x.name.value}={x.name.value}" for x in p.kwonly_params]
    if p.star_kwarg is not None:
        parts.append("**" + p.star_kwarg.name.value)
    return ", ".join(parts)


@dataclass
class Found:
    """What one pattern found: the scope nodes, and the matches inside them."""

    scopes: list[cst.CSTNode]
    near_misses: list[str]  # scopes with the right name but other params, for messages
    matches: list[cst.CSTNode]


def find(
    module: cst.Module, pattern: Pattern, *, match_types: tuple[type, ...] | None = None, statement: bool = False
) -> Found:
    """Resolve ``pattern`` in ``module``: its scopes, then its code matches inside them
    (``statement``: statements only, an expression pattern standing for its expression statement)."""
    segments = pattern.scope.split(".") if pattern.scope else []
    scopes: list[cst.CSTNode] = []
    near: list[str] = []
    if not segments:
        scopes = [module]
    else:
        for path, node in walk(module):
            if isinstance(node, (cst.ClassDef, cst.FunctionDef)) and _scope_matches(segments, path):
                if pattern.params is not None:
                    if not isinstance(node, cst.FunctionDef):
                        continue
                    names = param_names(node)
                    if names != tuple(pattern.params):
                        near.append(f"{'.'.join(path)}({', '.join(names)})")
                        continue
                scopes.append(node)
        if not scopes and not near:
            near = _did_you_mean(module, segments)
    if pattern.regex is not None:
        rx = re.compile(pattern.regex)
        scopes = [s for s in scopes if rx.search(module.code_for_node(s))]
    matches: list[cst.CSTNode] = []
    if pattern.match is not None:
        code = CodePattern.parse(pattern.match, statement=statement)
        types = match_types or code.cst_types()
        seen: set[int] = set()
        nested: list[cst.CSTNode] = []
        for scope in scopes:
            own, inner = own_descendants(scope)
            nested += inner
            for node in own:
                if id(node) in seen or not isinstance(node, types):
                    continue
                if code.matches(module, node):
                    seen.add(id(node))
                    matches.append(node)
        # A def or class nested in a function scope runs only when something calls it. An anchor found
        # there too makes the match ambiguous (counted, as before); found only there, it is not taken (an
        # edit would never run as part of the function) and the refusal says where it went.
        inside: dict[int, tuple[cst.CSTNode, str]] = {}
        for inner in nested:
            for n in descendants(inner):
                if id(n) not in seen and id(n) not in inside and isinstance(n, types) and code.matches(module, n):
                    inside[id(n)] = (n, inner.name.value)  # type: ignore[attr-defined]
        if inside and matches:
            matches += [n for n, _ in inside.values()]
        elif inside:
            names = ", ".join(dict.fromkeys(f"`{name}`" for _, name in inside.values()))
            near.append(f"only inside a def or class nested in the scope ({names}), which the scope does not run")
    return Found(scopes=scopes, near_misses=near, matches=matches)


def _did_you_mean(module: cst.Module, segments: list[str]) -> list[str]:
    """For a scope that names nothing: the nearest class/def paths of the module."""
    import difflib

    paths = {".".join(path) for path, node in walk(module) if isinstance(node, (cst.ClassDef, cst.FunctionDef))}
    wanted = ".".join(s for s in segments if s not in ("*", "**"))
    by_last = {p.rsplit(".", 1)[-1]: p for p in sorted(paths)}
    close = difflib.get_close_matches(wanted, sorted(paths), n=2, cutoff=0.75)
    close += [by_last[n] for n in difflib.get_close_matches(segments[-1], by_last, n=2, cutoff=0.75)]
    return [f"did you mean {p}?" for p in dict.fromkeys(close)][:2]


def present(module: cst.Module, pattern: Pattern) -> bool:
    found = find(module, pattern)
    return bool(found.matches) if pattern.match is not None else bool(found.scopes)
