"""An anchor in a function scope is the function's own code, never a def or class nested in it.

A statement moved into a nested def runs only when something calls that def: patching it there
would leave an edit that never runs (found by the TRL anchor-property cases: vLLM's switch set
inside a def nobody calls, and `apply` said `applied`). Found only there: refused, saying where
it went. Found in the function and in a nested def too: ambiguous, refused as before. A nested
def named by the scope itself (``outer.inner``) is a scope like any other.
"""

from __future__ import annotations

from fp32patch.patcher.spec import parse_spec
from fp32patch.patcher.transform import transform

SPEC_TEXT = """
schema = 1
id = "demo"
summary = "one statement after an anchor in a method"

[target]
distribution = "demo"
path = "demo.py"

[[edits]]
id = "switch"
op = "insert_after"
scope = "Engine.build"
match = "quantization = None"
code = "print(model)"
"""
SPEC = parse_spec(SPEC_TEXT, "demo.toml")

STOCK = "class Engine:\n    def build(self, model):\n        quantization = None\n        return model\n"
MOVED = (
    "class Engine:\n    def build(self, model):\n        def _unused():\n            quantization = None\n\n"
    "        return model\n"
)
COPIED = (
    "class Engine:\n    def build(self, model):\n        quantization = None\n\n        def _again():\n"
    "            quantization = None\n\n        return model\n"
)


def _run(source: str):
    return transform(SPEC, source.encode(), path="demo.py", version=None)


def test_the_functions_own_anchor_is_patched():
    result = _run(STOCK)
    assert result.status == "applied"
    want = "quantization = None\n        # fp32patch: demo [switch]\n        print(model)\n        return model"
    assert want in (result.new or b"").decode()


def test_an_anchor_moved_into_a_nested_def_is_refused_naming_it():
    result = _run(MOVED)
    assert result.status == "anchor-missing" and result.new is None
    said = " ".join(str(result.message).split())
    assert "only inside a def or class nested in the scope (`_unused`), which the scope does not run" in said


def test_an_anchor_also_in_a_nested_def_is_ambiguous():
    result = _run(COPIED)
    assert result.status == "anchor-ambiguous" and result.new is None


def test_a_nested_def_named_by_the_scope_is_its_own_scope():
    spec = parse_spec(SPEC_TEXT.replace('scope = "Engine.build"', 'scope = "Engine.build._unused"'), "demo.toml")
    result = transform(spec, MOVED.encode(), path="demo.py", version=None)
    assert result.status == "applied"
