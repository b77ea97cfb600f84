"""The operation vocabulary, one table per operation: (before, after) and must-not-match.

Each case runs a one-edit spec through ``transform``; "after" is the exact text, so any
change in formatting, placement or marking shows here first.
"""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from fp32patch.patcher.match import descendants
from fp32patch.patcher.ops import Change, apply_changes
from fp32patch.patcher.spec import SpecError, parse_spec
from fp32patch.patcher.transform import transform


def _spec(edit: str, extra: str = "") -> object:
    text = f"""
schema = 1
id = "t"
summary = "test"
[target]
distribution = "pkg"
path = "pkg/m.py"
[[edits]]
id = "e"
{textwrap.dedent(edit)}
{extra}
"""
    return parse_spec(text, "test.toml")


def _run(edit: str, before: str):
    return transform(_spec(edit), textwrap.dedent(before).encode(), path="pkg/m.py", version=None)


def _check(edit: str, before: str, after: str) -> None:
    result = _run(edit, before)
    assert result.status == "applied", result.message
    assert result.new.decode() == textwrap.dedent(after)
    again = transform(_spec(edit), result.new, path="pkg/m.py", version=None)
    assert again.status == "already-applied"


INSERT_AFTER_IMPORTS = [
    (
        '''
        """Doc."""
        import os
        from x import y
        X = 1


        def f():
            pass
        ''',
        '''
        """Doc."""
        import os
        from x import y


        # fp32patch: t [e]
        def g():
            return 1


        X = 1


        def f():
            pass
        ''',
    ),
    (  # no imports at all: after the docstring
        '''
        """Doc."""
        def f():
            pass
        ''',
        '''
        """Doc."""


        # fp32patch: t [e]
        def g():
            return 1


        def f():
            pass
        ''',
    ),
]


@pytest.mark.parametrize(("before", "after"), INSERT_AFTER_IMPORTS)
def test_insert_after_imports(before, after):
    _check('op = "insert_after_imports"\ncode = "def g():\\n    return 1\\n"', before, after)


def test_insert_after_imports_refuses_a_name_clash():
    result = _run(
        'op = "insert_after_imports"\ncode = "def g():\\n    return 1\\n"', "import os\n\n\ndef g():\n    pass\n"
    )
    assert result.status == "anchor-ambiguous" and "already defines g" in result.message


PREPEND = 'op = "prepend_to_body"\nscope = "C.f"\ncode = "return hash(self, ${call_args})"'
PREPEND_CASES = [
    (
        """
        class C:
            def f(self, a, b=1, *args, k, **kw):
                \"\"\"Doc.\"\"\"
                return a
        """,
        """
        class C:
            def f(self, a, b=1, *args, k, **kw):
                \"\"\"Doc.\"\"\"
                # fp32patch: t [e]
                return hash(self, a, b, *args, k=k, **kw)
                return a
        """,
    ),
    (  # one-line body, tab indentation, CRLF line endings are kept
        "class C:\r\n\tdef f(self, a): return a\r\n",
        "class C:\r\n\tdef f(self, a):\r\n\t\t# fp32patch: t [e]\r\n\t\treturn hash(self, a)\r\n\t\treturn a\r\n",
    ),
]


@pytest.mark.parametrize(("before", "after"), PREPEND_CASES)
def test_prepend_to_body(before, after):
    _check(PREPEND, before, after)


PREPEND_NO_MATCH = [
    "def f(self, a):\n    return a\n",  # not inside C
    "class C:\n    def g(self, a):\n        return a\n",  # another name
    "class D:\n    class C:\n        def f(self): pass\n",  # C nested deeper: the scope is exact
]


@pytest.mark.parametrize("before", PREPEND_NO_MATCH)
def test_prepend_to_body_must_not_match(before):
    assert _run(PREPEND, before).status == "anchor-missing"


def test_scope_wildcards_and_params():
    edit = 'op = "prepend_to_body"\nscope = "**.f"\nparams = ["self", "x"]\ncode = "pass"'
    src = "class A:\n    def outer(self):\n        class B:\n            def f(self, x):\n                return x\n"
    assert _run(edit, src).status == "applied"
    wrong = _run(edit, src.replace("self, x", "self, y"))
    assert wrong.status == "anchor-missing" and "found instead: A.outer.B.f(self, y)" in wrong.message


REPLACE_EXPR = 'op = "replace"\nscope = "f"\nmatch = "ValueError(...)"\ncode = "ValueError(str(n))"'
REPLACE_CASES = [
    (
        """
        def f(n):
            if n:
                raise ValueError(
                    f"too long: {n}"  # a comment inside
                )
        """,
        """
        def f(n):
            if n:
                # fp32patch: t [e]
                raise ValueError(str(n))
        """,
    ),
]


@pytest.mark.parametrize(("before", "after"), REPLACE_CASES)
def test_replace_expression(before, after):
    _check(REPLACE_EXPR, before, after)


@pytest.mark.parametrize(
    "before",
    [
        "def f(n):\n    raise TypeError('x')\n",
        "def g(n):\n    raise ValueError('x')\n",  # outside the scope
        "def f(n):\n    raise ValueError('x')\n    raise ValueError('y')\n",  # twice
    ],
)
def test_replace_expression_must_match_exactly_once(before):
    assert _run(REPLACE_EXPR, before).status in ("anchor-missing", "anchor-ambiguous")


def test_replace_statement_keeps_leading_comments():
    edit = 'op = "replace"\nscope = "f"\nmatch = "return x + 1"\ncode = "y = x + 1\\nreturn y"'
    _check(
        edit,
        "def f(x):\n    # why\n    return (x +\n            1)\n",
        "def f(x):\n    # why\n    # fp32patch: t [e]\n    y = x + 1\n    return y\n",
    )


def test_insert_before_and_after():
    before_edit = 'op = "insert_before"\nscope = "f"\nmatch = "return ..."\ncode = "print()"'
    _check(
        before_edit,
        "def f():\n    # c\n    return 1\n",
        "def f():\n    # c\n    # fp32patch: t [e]\n    print()\n    return 1\n",
    )
    after_edit = 'op = "insert_after"\nscope = "f"\nmatch = "x = ..."\ncode = "print(x)"'
    _check(
        after_edit,
        "def f():\n    x = 2\n    return x\n",
        "def f():\n    x = 2\n    # fp32patch: t [e]\n    print(x)\n    return x\n",
    )


HANDLER = '''op = "insert_except_handler"
scope = "**.route"
catches = "KnownError"
code = """
except ValueError as e:
    return 400
"""'''


def test_insert_except_handler():
    _check(
        HANDLER,
        """
        def setup():
            async def route():
                try:
                    return await go()
                except KnownError as e:
                    return 400
                except Exception:
                    raise
        """,
        """
        def setup():
            async def route():
                try:
                    return await go()
                except KnownError as e:
                    return 400
                # fp32patch: t [e]
                except ValueError as e:
                    return 400
                except Exception:
                    raise
        """,
    )


@pytest.mark.parametrize(
    "before",
    [
        "async def route():\n    try:\n        pass\n    except (KnownError, ValueError):\n        pass\n",  # a tuple is another handler
        "async def route():\n    try:\n        pass\n    except OtherError:\n        pass\n",
    ],
)
def test_insert_except_handler_must_not_match(before):
    assert _run(HANDLER, before).status == "anchor-missing"


def test_patterns_ignore_formatting():
    edit = 'op = "insert_after"\nscope = "f"\nmatch = "x = call(a, b=2)"\ncode = "print()"'
    for src in (
        "def f():\n    x = call(a, b=2)\n",
        "def f():\n    x = call(\n        a,\n        b=2,  # two\n    )\n",
        "def f():\n    x = (call(a,\n              b = 2))\n",
    ):
        assert _run(edit, src).status == "applied", src


def test_skip_when_and_obsolete():
    edit = 'op = "insert_after"\nscope = "f"\nmatch = "x = 1"\ncode = "y = 2"\nskip_when = [{ scope = "f", match = "y = 2" }]'
    result = _run(edit, "def f():\n    x = 1\n    y = 2\n")
    assert result.status == "obsolete" and result.skipped == ["e"]
    spec = _spec(
        'op = "insert_after"\nscope = "f"\nmatch = "x = 1"\ncode = "y = 2"',
        '[[obsolete_when]]\nname = "upstream"\npatterns = [{ scope = "f", regex = "fixed upstream" }]',
    )
    result = transform(spec, b"def f():\n    # fixed upstream\n    x = 1\n", path="m.py", version=None)
    assert result.status == "obsolete" and "upstream" in result.message


def test_refuse_when_names_the_shape_and_says_why_before_obsolete_or_any_variant():
    spec = _spec(
        'op = "insert_after"\nscope = "f"\nmatch = "x = 1"\ncode = "y = 2"',
        '[[refuse_when]]\nname = "the halfway fix"\npatterns = [{ scope = "f", regex = "halfway" }]\n'
        'why = """\nUse the\n  other release."""\n'
        '[[obsolete_when]]\nname = "upstream"\npatterns = [{ scope = "f", regex = "fix" }]',
    )
    result = transform(spec, b"def f():\n    # halfway fix\n    x = 1\n", path="m.py", version=None)
    assert result.status == "unsupported-version" and result.new is None
    assert "it has the halfway fix: Use the other release. Nothing was written." in result.message
    # without the shape, the rest of the spec decides as before
    assert transform(spec, b"def f():\n    x = 1\n", path="m.py", version=None).status == "applied"
    assert transform(spec, b"def f():\n    # fix\n    x = 1\n", path="m.py", version=None).status == "obsolete"


# A newer release moved the anchor into g (and defines g); the older one has it in f only.
UNLESS_EDIT = 'op = "insert_after"\nscope = "f"\nmatch = "x = 1"\ncode = "y = 2"'
UNLESS_VARIANTS = (
    '[[variants]]\nname = "new"\nedits.e.scope = "g"\n'
    '[[variants]]\nname = "old"\nunless = [{ scope = "**.g" }, { regex = "moved_on" }]\n'
)


@pytest.mark.parametrize(
    ("source", "status", "variant"),
    [
        ("def f():\n    x = 1\ndef g():\n    x = 1\n", "applied", "new"),
        ("def f():\n    x = 1\n", "applied", "old"),
        # g is there but its anchor moved: the old variant's anchor in f holds, and would have
        # patched the wrong function silently; it is kept off, and the new one's refusal shown
        ("def f():\n    x = 1\ndef g():\n    x = 2\n", "anchor-missing", None),
        # `**.g`: a g at any depth (a method, here)
        ("class C:\n    def g(self):\n        pass\ndef f():\n    x = 1\n", "anchor-missing", None),
        # any one of the shapes keeps it off (the second is a string only the newer file holds)
        ("def f():\n    x = 1\nNAME = 'moved_on'\n", "anchor-missing", None),
    ],
)
def test_a_variant_is_kept_off_files_with_a_shape_its_unless_names(source, status, variant):
    result = transform(_spec(UNLESS_EDIT, UNLESS_VARIANTS), source.encode(), path="pkg/m.py", version=None)
    assert result.status == status, result.message
    if status == "applied":
        assert result.variant == variant
    else:
        assert result.new is None
        assert "variant new" in result.message and "scope g" in result.message, result.message


def test_a_variant_kept_off_by_unless_alone_says_which_shape_and_writes_nothing():
    spec = _spec(UNLESS_EDIT, '[[variants]]\nname = "old"\nunless = [{ scope = "g" }]\n')
    result = transform(spec, b"def f():\n    x = 1\ndef g():\n    pass\n", path="pkg/m.py", version=None)
    assert result.status == "unsupported-version" and result.new is None
    assert "variant old is for releases without scope g, and this one has it" in result.message, result.message
    assert transform(spec, b"def f():\n    x = 1\n", path="pkg/m.py", version=None).status == "applied"


@pytest.mark.parametrize(
    ("unless", "named"),
    [
        ('unless = [{ scop = "g" }]', "variants[0].unless[0].scop: unknown field (did you mean 'scope'?"),
        ('unless = "g"', "variants[0].unless: expected array"),
        ('unless = ["g"]', "variants[0].unless[0]: no shape named 'g' (the spec has no [shapes])"),
        ("unless = [1]", "variants[0].unless[0]: expected a table, got integer"),
        ('unless = [{ file = "other", scope = "g" }]', "variants[0].unless[0].file: no file named 'other'"),
        ('unless = [{ regex = "(" }]', "variants[0].unless[0].regex: not a regular expression"),
    ],
)
def test_a_bad_unless_is_refused_at_load_naming_where(unless, named):
    with pytest.raises(SpecError) as err:
        _spec(UNLESS_EDIT, f'[[variants]]\nname = "old"\n{unless}\n')
    assert f"test.toml: {named}" in str(err.value), err.value


# The same spec with its patterns named once in [shapes]: the same decisions, the same hash.
SHAPES = '[shapes]\ng-anywhere = { scope = "**.g" }\nmoved-on = { regex = "moved_on" }\n'
NAMED_VARIANTS = (
    '[[variants]]\nname = "new"\nedits.e.scope = "g"\n[[variants]]\nname = "old"\nunless = ["g-anywhere", "moved-on"]\n'
)


@pytest.mark.parametrize(
    "source",
    [
        "def f():\n    x = 1\ndef g():\n    x = 1\n",
        "def f():\n    x = 1\n",
        "def f():\n    x = 1\ndef g():\n    x = 2\n",
        "def f():\n    x = 1\nNAME = 'moved_on'\n",
    ],
)
def test_named_shapes_decide_as_the_patterns_written_in_place_and_hash_the_same(source):
    written = _spec(UNLESS_EDIT, UNLESS_VARIANTS)
    named = _spec(UNLESS_EDIT, NAMED_VARIANTS + SHAPES)
    assert named.sha256 == written.sha256  # naming is notation: a tree patched before stays `applied`
    a, b = (transform(s, source.encode(), path="pkg/m.py", version=None) for s in (written, named))
    assert (a.status, a.variant, a.new) == (b.status, b.variant, b.new)
    assert a.message == b.message  # where kept off, the newer variant's refusal is shown, the same


def test_a_variant_kept_off_by_a_named_shape_says_its_name():
    spec = _spec(
        UNLESS_EDIT, '[[variants]]\nname = "old"\nunless = ["g-anywhere"]\n[shapes]\ng-anywhere = { scope = "**.g" }\n'
    )
    result = transform(spec, b"def f():\n    x = 1\ndef g():\n    pass\n", path="pkg/m.py", version=None)
    assert result.status == "unsupported-version" and result.new is None
    assert "variant old is for releases without g-anywhere (scope **.g), and this one has it" in result.message


def test_named_shapes_serve_skip_when_and_obsolete_when():
    edit = 'op = "insert_after"\nscope = "f"\nmatch = "x = 1"\ncode = "y = 2"\nskip_when = ["has-y"]'
    spec = _spec(
        edit,
        '[[obsolete_when]]\nname = "upstream"\npatterns = ["has-y", { regex = "fixed upstream" }]\n'
        '[shapes]\nhas-y = { scope = "f", match = "y = 2" }\n',
    )
    result = transform(spec, b"def f():\n    x = 1\n    y = 2\n", path="m.py", version=None)
    assert result.status == "obsolete" and result.skipped == ["e"]
    result = transform(spec, b"def f():\n    # fixed upstream\n    x = 1\n    y = 2\n", path="m.py", version=None)
    assert result.status == "obsolete" and "upstream" in result.message
    assert transform(spec, b"def f():\n    x = 1\n", path="m.py", version=None).status == "applied"


def test_every_place_a_shape_is_named_hashes_as_written_in_place():
    """The hash's view writes every name out: an edit's skip_when, a variant's override of it, a
    variant's unless, obsolete_when's and refuse_when's patterns (changing any one changes it)."""
    g, y = '{ scope = "**.g" }', '{ scope = "f", match = "y = 2" }'

    def spec(g_at: str, y_at: str, shapes: str = "") -> object:
        return _spec(
            f'op = "insert_after"\nscope = "f"\nmatch = "x = 1"\ncode = "y = 2"\nskip_when = [{y_at}]',
            f'[[variants]]\nname = "new"\nedits.e.skip_when = [{y_at}, {g_at}]\nunless = [{g_at}]\n'
            f'[[obsolete_when]]\nname = "u"\npatterns = [{y_at}]\n'
            f'[[refuse_when]]\nname = "r"\npatterns = [{g_at}, {y_at}]\nwhy = "w"\n{shapes}',
        )

    written = spec(g, y)
    named = spec('"g"', '"y"', f"[shapes]\ng = {g}\ny = {y}\n")
    assert named.sha256 == written.sha256
    assert spec(g, '{ scope = "f", match = "y = 3" }').sha256 != written.sha256
    assert spec('"g"', '"y"', f'[shapes]\ng = {g}\ny = {{ scope = "f", match = "y = 3" }}\n').sha256 != written.sha256


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (
            'unless = ["g-anywher"]\n[shapes]\ng-anywhere = { scope = "g" }',
            "variants[0].unless[0]: no shape named 'g-anywher' (did you mean 'g-anywhere'? shapes: g-anywhere)",
        ),
        ('unless = ["g"]\n[shapes]\ng = { scop = "g" }', "shapes.g.scop: unknown field (did you mean 'scope'?"),
        ('unless = ["g"]\n[shapes]\ng = { regex = "(" }', "shapes.g.regex: not a regular expression"),
        ('unless = ["g"]\n[shapes]\ng = { file = "other" }', "shapes.g.file: no file named 'other'"),
        ('unless = ["g"]\n[shapes]\ng = "scope g"', "shapes.g: expected a table, got string"),
        (
            'unless = ["G_1"]\n[shapes]\nG_1 = { scope = "g" }',
            "shapes.G_1: a shape's name is lower-case and dash-separated",
        ),
        ('unless = ["g"]\n[shapes]\ng = { scope = "g" }\nh = { scope = "h" }', "shapes.h: named in no unless"),
    ],
)
def test_bad_shapes_are_refused_at_load_naming_where(extra, named):
    with pytest.raises(SpecError) as err:
        _spec(UNLESS_EDIT, f'[[variants]]\nname = "old"\n{extra}\n')
    assert f"test.toml: {named}" in str(err.value), err.value


def test_shapes_must_be_a_table():
    text = 'schema = 1\nid = "t"\nsummary = "s"\nshapes = 1\n[target]\ndistribution = "p"\npath = "p/m.py"\n'
    with pytest.raises(SpecError, match=r"test\.toml: shapes: expected table, got integer 1"):
        parse_spec(text + '[[edits]]\nid = "e"\n' + UNLESS_EDIT, "test.toml")


def test_bom_and_missing_final_newline_are_kept():
    src = b"\xef\xbb\xbfclass C:\n    def f(self, a):\n        return a"
    result = transform(_spec(PREPEND), src, path="m.py", version=None)
    assert result.new.startswith(b"\xef\xbb\xbf") and result.new.endswith(b"return a")


def test_partially_applied_is_refused():
    spec = parse_spec(
        """
schema = 1
id = "t"
summary = "s"
[target]
distribution = "pkg"
path = "m.py"
[[edits]]
id = "one"
op = "insert_after"
scope = "f"
match = "x = 1"
code = "a = 1"
[[edits]]
id = "two"
op = "insert_after"
scope = "f"
match = "x = 1"
code = "b = 1"
""",
        "t.toml",
    )
    result = transform(spec, b"def f():\n    x = 1\n    # fp32patch: t [one]\n    a = 1\n", path="m.py", version=None)
    assert result.status == "partially-applied" and "one" in result.message


def test_marker_text_inside_a_string_is_not_a_marker():
    """A docstring quoting the markers must not make an unpatched file read as patched."""
    src = b'DOC = """\n# fp32patch: t [e]\n"""\n\n\nclass C:\n    def f(self, a):\n        return a\n'
    result = transform(_spec(PREPEND), src, path="m.py", version=None)
    assert result.status == "applied"
    assert transform(_spec(PREPEND), result.new, path="m.py", version=None).status == "already-applied"


# ---------------------------------------------------------------- apply_changes: only the way to an edit is rebuilt

_MODULE = """\
import os


def untouched(a, b):
    return (a + b) * 2


class Head:
    scale = 1.0

    def forward(self, x):
        y = x * self.scale
        return y


TAIL = os.sep
"""


def _comment_above(text: str):
    def rewrite(node):
        return node.with_changes(leading_lines=[*node.leading_lines, cst.EmptyLine(comment=cst.Comment(text))])

    return rewrite


class _EveryNode(cst.CSTTransformer):
    """The rewrites as a plain libcst transformer applies them, entering every node (the reference)."""

    def __init__(self, changes):
        super().__init__()
        self.by_node = {id(c.node): c.rewrite for c in changes}

    def on_leave(self, original_node, updated_node):
        rewrite = self.by_node.get(id(original_node))
        return rewrite(updated_node) if rewrite else updated_node


def _statements(module, kind):
    return [n for n in descendants(module) if isinstance(n, kind)]


def test_apply_changes_gives_a_whole_traversal_s_code_and_keeps_the_other_subtrees():
    module = cst.parse_module(_MODULE)
    lines = _statements(module, cst.SimpleStatementLine)
    deep = next(n for n in lines if module.code_for_node(n).strip() == "y = x * self.scale")
    tail = next(n for n in lines if module.code_for_node(n).strip().startswith("TAIL"))
    changes = [Change(deep, _comment_above("# in the method")), Change(tail, _comment_above("# at the end"))]

    out = apply_changes(module, changes)

    assert out.code == module.visit(_EveryNode(changes)).code
    assert "    # in the method\n        y = x * self.scale" in out.code and "# at the end\nTAIL" in out.code
    # the statements with no edit below them are the module's own objects, not rebuilt copies
    kept = [old is new for old, new in zip(module.body, out.body, strict=True)]
    assert kept == [True, True, False, False]  # import, untouched(); Head (an edit inside), TAIL
    head_old, head_new = module.body[2].body.body, out.body[2].body.body
    assert head_old[0] is head_new[0] and head_old[1] is not head_new[1]  # `scale = 1.0` kept; forward rebuilt


def test_apply_changes_without_changes_is_the_module_itself():
    module = cst.parse_module(_MODULE)
    assert apply_changes(module, []) is module


def test_apply_changes_refuses_an_anchor_that_is_not_in_the_module():
    """An anchor no traversal reaches (here: a node of another parse) is refused as overlapping
    edits are, not skipped."""
    module = cst.parse_module(_MODULE)
    stranger = _statements(cst.parse_module(_MODULE), cst.SimpleStatementLine)[0]
    with pytest.raises(ValueError, match="edits overlap"):
        apply_changes(module, [Change(stranger, _comment_above("# lost"))])


def test_apply_changes_inside_a_replaced_statement_applies_both_as_a_whole_traversal_does():
    """An edit whose anchor lies inside another edit's statement: both are rewritten, the inner one
    first, as libcst's own traversal orders them."""
    module = cst.parse_module(_MODULE)
    method = next(n for n in _statements(module, cst.FunctionDef) if n.name.value == "forward")
    inner = _statements(method, cst.SimpleStatementLine)[0]
    changes = [Change(method, _comment_above("# outer")), Change(inner, _comment_above("# inner"))]
    assert apply_changes(module, changes).code == module.visit(_EveryNode(changes)).code
