"""Names that inserted code uses and nothing defines: found before anything is written.

A snippet copied without the edit that defines its helper (the module-level gate, say)
would compile, import, and then raise ``NameError`` on every call, even with the feature
switched off. So every patched module is resolved with libcst's scope analysis, and any
name read in it that no scope, import or builtin defines, and that was not already
unresolved in the original file, is reported.
"""

from __future__ import annotations

import builtins
from collections import Counter

import libcst as cst
from libcst.metadata import MetadataWrapper, ScopeProvider

# defined in every module at run time, though no statement assigns them
_MODULE_NAMES = {"__name__", "__file__", "__doc__", "__spec__", "__loader__", "__package__", "__builtins__",
                 "__path__", "__annotations__", "__dict__", "__class__", "__module__", "__qualname__"}  # fmt: skip
_KNOWN = set(dir(builtins)) | _MODULE_NAMES


def _unresolved(module: cst.Module) -> Counter[str] | None:
    """How often each name is read without a definition in reach; None if the module star-imports."""
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    scopes = wrapper.resolve(ScopeProvider)
    counts: Counter[str] = Counter()
    seen: set[int] = set()
    for scope in scopes.values():
        if scope is None or id(scope) in seen:
            continue
        seen.add(id(scope))
        for assignment in scope.assignments:
            node = getattr(assignment, "node", None)
            if isinstance(node, cst.ImportFrom) and isinstance(node.names, cst.ImportStar):
                return None
        for access in scope.accesses:
            if not access.referents and access.node.value not in _KNOWN:
                counts[access.node.value] += 1
    return counts


def undefined_names(before: cst.Module, after: cst.Module) -> list[str]:
    """Names read without a definition in ``after`` more often than in ``before``."""
    old, new = _unresolved(before), _unresolved(after)
    if old is None or new is None:  # `from x import *`: anything may be defined
        return []
    return sorted(name for name, n in new.items() if n > old.get(name, 0))
