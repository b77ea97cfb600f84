"""The undefined-name check: a table of (original, patched) modules and the names it reports.

Each case is what an inserted snippet could do; the check reports a name only where the
patched module reads it with no definition in reach more often than the original did.
"""

from __future__ import annotations

import textwrap

import pytest

from fp32patch.patcher.names import undefined_names

BASE = """\
import os
from typing import Any

LIMIT = 3


def helper(x):
    return x + LIMIT


class Model:
    size = 4

    def forward(self, hidden):
        return hidden
"""

# (what is appended to BASE, the names it must report)
CASES = [
    ("def f():\n    return _gate()\n", ["_gate"]),
    ("def _gate():\n    return 1\n\n\ndef f():\n    return _gate()\n", []),
    ("def f():\n    return os.environ.get('X'), Any, helper(LIMIT), len([])\n", []),
    ("def f(a, *rest, key=None, **kw):\n    return a, rest, key, kw\n", []),
    ("def outer():\n    y = 1\n\n    def inner():\n        nonlocal y\n        return y\n\n    return inner\n", []),
    ("def outer():\n    y = 1\n    return lambda z: y + z\n", []),
    ("def f(items):\n    return [i * k for i in items for k in range(i)] + list(j for j in items)\n", []),
    ("def f(items):\n    return {k: v for k, v in items}, {s for s in items}\n", []),
    ("def f():\n    try:\n        pass\n    except ValueError as err:\n        return err\n", []),
    ("def f(xs):\n    if (n := len(xs)) > 1:\n        return n\n", []),
    ("def setup():\n    global _runtime\n    _runtime = 1\n\n\ndef use():\n    return _runtime\n", []),
    ("def setup():\n    global _late\n    import json as _late\n\n\ndef use():\n    return _late\n", []),
    # a class body does not enclose its methods
    ("class C:\n    ref = 1\n\n    def m(self):\n        return ref\n", ["ref"]),
    ("class C:\n    ref = 1\n    other = ref + 1\n", []),
    # evaluated where the def stands: decorators, defaults, annotations, bases
    ("@_decorate\ndef f():\n    pass\n", ["_decorate"]),
    ("def f(x=_default):\n    return x\n", ["_default"]),
    ("def f(x: _Annotation) -> None:\n    return x\n", ["_Annotation"]),
    ("class C(_Base):\n    pass\n", ["_Base"]),
    ("def f(xs):\n    return [x for x in _missing]\n", ["_missing"]),
    ("def f():\n    return __name__, __file__, print, __class__\n", []),
    ("def f():\n    return a, b, a\n", ["a", "b"]),
]


@pytest.mark.parametrize(("added", "reported"), CASES, ids=[c[0].split("\n")[0] for c in CASES])
def test_what_an_insertion_reads(added, reported):
    assert undefined_names(BASE, BASE + "\n\n" + added) == reported


def test_a_name_the_original_already_reads_undefined_counts_each_new_read():
    before = BASE + "\n\ndef legacy():\n    return _sometimes\n"
    assert undefined_names(before, before) == []
    assert undefined_names(before, before + "\n\ndef more():\n    return _sometimes\n") == ["_sometimes"]


def test_a_star_import_defines_anything():
    before = "from somewhere import *\n"
    assert undefined_names(before, before + "x = _gate()\n") == []


def test_annotations_that_are_never_evaluated_are_not_reads():
    before = "from __future__ import annotations\n"
    assert undefined_names(before, before + "def f(x: _Later) -> _Later:\n    return x\n") == []


def test_a_nested_method_reads_through_every_enclosing_function():
    after = textwrap.dedent(
        """
        def factory(size):
            class Head:
                def forward(self, x):
                    return x * size + _scale

            return Head
        """
    )
    assert undefined_names("", after) == ["_scale"]


def test_source_the_compiler_refuses_gives_no_verdict():
    assert undefined_names("def f(:\n", "x = y\n") == []
