"""Names that inserted code uses and nothing defines: found before anything is written.

A snippet copied without the edit that defines its helper (the module-level gate, say)
would compile, import, and then raise ``NameError`` on every call, even with the feature
switched off. So every patched module is resolved the way the compiler resolves it, and
any name read in it that no scope, import or builtin defines, and that was not already read
so (as often) in the original file, is reported.

The compiler's own scope analysis (``symtable``) says, for every scope, whether a name is
local, a closure variable, or a global; the syntax tree is walked alongside it to count each
read. Both run in C over the whole file in milliseconds, where a pure-Python scope analysis
of a large upstream module took a second or more, once for the file and once for its patch.
"""

from __future__ import annotations

import ast
import builtins
import symtable
from collections import Counter

# defined in every module at run time, though no statement assigns them
_MODULE_NAMES = {"__name__", "__file__", "__doc__", "__spec__", "__loader__", "__package__", "__builtins__",
                 "__path__", "__annotations__", "__dict__", "__class__", "__module__", "__qualname__"}  # fmt: skip
_KNOWN = set(dir(builtins)) | _MODULE_NAMES

# the name symtable gives the scope each kind of node opens (comprehensions other than generator
# expressions have no scope of their own from Python 3.12: they stay in the enclosing one)
_SCOPE_NAMES = {ast.Lambda: "lambda", ast.GeneratorExp: "genexpr", ast.ListComp: "listcomp", ast.SetComp: "setcomp",
                ast.DictComp: "dictcomp"}  # fmt: skip


class _Reads(ast.NodeVisitor):
    """Counts the reads of names that resolve to a module global the module never binds."""

    def __init__(self, module: symtable.SymbolTable, defined: set[str]) -> None:
        self.defined = defined
        self.scopes: list[tuple[symtable.SymbolTable, list[symtable.SymbolTable]]] = [(module, module.get_children())]
        self.counts: Counter[str] = Counter()

    def _enter(self, node: ast.AST, name: str) -> bool:
        """Step into the scope ``node`` opens; False where symtable has none for it."""
        table, children = self.scopes[-1]
        for index, child in enumerate(children):
            if child.get_name() == name and child.get_lineno() == node.lineno:
                del children[index]
                self.scopes.append((child, child.get_children()))
                return True
        return False

    def _inside(self, node: ast.AST, name: str, parts: list[ast.AST]) -> None:
        entered = self._enter(node, name)
        for part in parts:
            self.visit(part)
        if entered:
            self.scopes.pop()

    def _outer_parts_of(self, args: ast.arguments) -> list[ast.AST]:
        """What a def or lambda evaluates where it is defined: defaults and annotations."""
        parts: list[ast.AST] = [*args.defaults, *(d for d in args.kw_defaults if d is not None)]
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
        return parts + [a.annotation for a in every if a is not None and a.annotation is not None]

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        for part in [*node.decorator_list, *self._outer_parts_of(node.args), *([node.returns] if node.returns else [])]:
            self.visit(part)
        self._inside(node, node.name, node.body)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for part in self._outer_parts_of(node.args):
            self.visit(part)
        self._inside(node, "lambda", [node.body])

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for part in [*node.decorator_list, *node.bases, *node.keywords]:
            self.visit(part)
        self._inside(node, node.name, node.body)

    def _comprehension(self, node: ast.AST, results: list[ast.AST]) -> None:
        first, *rest = node.generators  # type: ignore[attr-defined]
        self.visit(first.iter)  # evaluated in the enclosing scope
        parts: list[ast.AST] = [first.target, *first.ifs]
        for generator in rest:
            parts += [generator.target, generator.iter, *generator.ifs]
        self._inside(node, _SCOPE_NAMES[type(node)], parts + results)

    def visit_GeneratorExp(self, node: ast.GeneratorExp) -> None:
        self._comprehension(node, [node.elt])

    visit_ListComp = visit_SetComp = visit_GeneratorExp

    def visit_DictComp(self, node: ast.DictComp) -> None:
        self._comprehension(node, [node.key, node.value])

    def visit_Name(self, node: ast.Name) -> None:
        if not isinstance(node.ctx, ast.Load) or node.id in _KNOWN:
            return
        table, _ = self.scopes[-1]
        try:
            symbol = table.lookup(node.id)
        except KeyError:  # not evaluated (an annotation under `from __future__ import annotations`)
            return
        at_module = table.get_type() == "module"
        if not at_module and (symbol.is_local() or symbol.is_free() or symbol.is_nonlocal()):
            return
        if node.id not in self.defined:
            self.counts[node.id] += 1


def _module_bindings(module: symtable.SymbolTable) -> set[str]:
    """Every name bound in the module's namespace: at module level, or by ``global`` inside a def."""
    out = {s.get_name() for s in module.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}
    stack = list(module.get_children())
    while stack:
        table = stack.pop()
        stack.extend(table.get_children())
        out |= {
            s.get_name() for s in table.get_symbols() if s.is_declared_global() and (s.is_assigned() or s.is_imported())
        }
    return out


def _unresolved(source: str) -> Counter[str] | None:
    """How often each name is read without a definition in reach; None if the module
    star-imports (anything may be defined) or is not Python the compiler takes."""
    try:
        tree = ast.parse(source)
        module = symtable.symtable(source, "<patched>", "exec")
    except (SyntaxError, ValueError):
        return None
    if any(isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names) for node in ast.walk(tree)):
        return None
    reads = _Reads(module, _module_bindings(module))
    reads.visit(tree)
    return reads.counts


def undefined_names(before: str, after: str) -> list[str]:
    """Names read without a definition in the source ``after`` more often than in ``before``."""
    old, new = _unresolved(before), _unresolved(after)
    if old is None or new is None:
        return []
    return sorted(name for name, n in new.items() if n > old.get(name, 0))
