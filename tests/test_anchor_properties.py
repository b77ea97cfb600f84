"""Property: whatever the formatting, comments and code around an anchor, the result is a correct edit or a refusal.

Starting from real upstream files (vLLM's nemotron_h.py, one release per spec variant),
hypothesis applies a few mutations: signatures re-wrapped, comments, blank lines,
decorators and docstrings added, decoys (a class with a similar name, a nested or
module-level def of the same name, marker text inside strings and inline comments),
import blocks grown. Each mutation is *benign* (the patch must still apply) or
*breaking* (it must be refused). A correct edit is: every edit's marker exactly once,
output that compiles, re-apply is already-applied, and the output's AST minus the
inserted statements equal to the input's, the insertions in the right functions.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp32patch.patcher.spec import load_specs
from fp32patch.patcher.transform import ERRORS, transform
from tests.conftest import NEMOTRON
from tests.support.pypi import wheel_members

pytestmark = pytest.mark.network

SPEC_ID = "nemotron-h-fp32-lm-head"
CLASS = "NemotronHForCausalLM"
ROUTED = {"compute_logits": "route-compute-logits", "load_weights": "refit-notify"}
EXAMPLES = {"0.33.0": 120, "0.10.2": 80}  # one release per variant (hidden-states-only, with-sampling-metadata)
GATE = "_fp32patch_lm_head_runtime"
LOCAL = "_fp32patch_runtime"


# ---------------------------------------------------------------- locating code in the text


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _top_class(tree: ast.Module) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS)


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _first_line(node: ast.stmt) -> int:
    """1-based first line of a statement, its decorators included."""
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])  # a decorator expression starts on its "@" line


def _statements(node: ast.AST) -> list[ast.stmt]:
    return [n for n in ast.walk(node) if isinstance(n, ast.stmt)]


def _insert(text: str, line: int, block: str) -> str:
    """Insert ``block`` (whole lines) before 1-based ``line``."""
    lines = _lines(text)
    return "".join([*lines[: line - 1], block, *lines[line - 1 :]])


def _signature(text: str, func: ast.FunctionDef) -> tuple[int, int, list[str], str, str]:
    """The def's line span (0-based, end exclusive), its parameters, return annotation, and what follows ':'."""
    lines = _lines(text)
    start = func.lineno - 1
    toks = tokenize.generate_tokens(io.StringIO("".join(lines[start:])).readline)
    depth, params, current, ret, after_paren = 0, [], [], [], False
    for tok in toks:
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT):
            continue
        if not after_paren:
            if tok.type == tokenize.OP and tok.string in "([{":
                depth += 1
                if depth == 1:
                    continue
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth -= 1
                if depth == 0:
                    after_paren = True
                    if current:
                        params.append(current)
                    continue
            elif tok.type == tokenize.OP and tok.string == "," and depth == 1:
                params.append(current)
                current = []
                continue
            if depth >= 1:
                current.append(tok)
        elif tok.type == tokenize.OP and tok.string == ":":
            end_row, end_col = tok.end
            rest = lines[start + end_row - 1][end_col:]
            return start, start + end_row, [_untokenize(p) for p in params if p], " ".join(ret), rest
        else:
            ret.append(tok.string)
    raise AssertionError(f"no end of signature for {func.name}")


def _untokenize(toks: list[tokenize.TokenInfo]) -> str:
    out = ""
    for prev, tok in zip([None, *toks[:-1]], toks, strict=True):
        gap = prev is not None and prev.end != tok.start and tok.string not in ".[](),:" and prev.string not in ".[("
        out += (" " if gap else "") + tok.string
    return out


# ---------------------------------------------------------------- mutations


@dataclass(frozen=True)
class Mutation:
    name: str
    apply: Callable[[str, int], str]
    breaking: bool = False


def reformat_signature(text: str, seed: int) -> str:
    name = ("compute_logits", "load_weights")[seed % 2]
    func = _method(_top_class(ast.parse(text)), name)
    start, end, params, ret, rest = _signature(text, func)
    ind = _indent(_lines(text)[start])
    ret = f" {ret}" if ret else ""
    style = (seed // 2) % 5
    if style == 0:  # one line
        sig = f"{ind}def {name}({', '.join(params)}){ret}:"
    elif style == 1:  # one parameter per line, trailing comma
        sig = f"{ind}def {name}(\n" + "".join(f"{ind}        {p},\n" for p in params) + f"{ind}){ret}:"
    elif style == 2:  # hanging, aligned under the parenthesis
        pad = " " * len(f"{ind}def {name}(")
        sig = f"{ind}def {name}(" + f",\n{pad}".join(params) + f"){ret}:"
    elif style == 3:  # generous spacing
        sig = f"{ind}def  {name} (  {' ,  '.join(params)}  ) {ret.replace('->', ' ->  ')} :"
    else:  # a comment on every parameter line
        sig = f"{ind}def {name}(  # why\n" + "".join(f"{ind}    {p},  # {p.split(':')[0]}\n" for p in params)
        sig += f"{ind}){ret}:  # returns"
    lines = _lines(text)
    return "".join([*lines[:start], sig + rest, *lines[end:]])


COMMENTS = [
    "# a comment",
    "# def compute_logits(self, hidden_states):",
    "# NemotronHForCausalLM.load_weights(self, weights) is called on refit",
    "# fp32patch: nemotron-h-fp32-lm-head",
    "#: sphinx comment with ... and `...`",
    "# type: ignore",
]


def _class_statements(text: str) -> list[ast.stmt]:
    return _statements(_top_class(ast.parse(text)))


def add_comment_line(text: str, seed: int) -> str:
    stmts = _class_statements(text)
    line = _first_line(stmts[seed % len(stmts)])
    ind = _indent(_lines(text)[line - 1])
    return _insert(text, line, f"{ind}{COMMENTS[seed % len(COMMENTS)]}\n")


def add_end_of_line_comment(text: str, seed: int) -> str:
    simple = [s for s in _class_statements(text) if not hasattr(s, "body")]
    stmt = simple[seed % len(simple)]
    lines = _lines(text)
    i = stmt.end_lineno - 1
    body = lines[i].rstrip("\r\n")
    if "#" in body or body.endswith("\\"):
        return text
    note = "# fp32patch: nemotron-h-fp32-lm-head [runtime-gate]" if seed % 3 == 0 else "# note"
    lines[i] = f"{body}  {note}" + lines[i][len(body) :]
    return "".join(lines)


def add_blank_lines(text: str, seed: int) -> str:
    stmts = _class_statements(text)
    return _insert(text, _first_line(stmts[seed % len(stmts)]), "\n" * (1 + seed % 3))


DECORATORS = ["@torch.no_grad()", "@staticmethod_like", "@functools.lru_cache(\n{ind}    maxsize=None,\n{ind})"]


def add_decorator(text: str, seed: int) -> str:
    func = _method(_top_class(ast.parse(text)), ("compute_logits", "load_weights")[seed % 2])
    line = _first_line(func)
    ind = _indent(_lines(text)[line - 1])
    deco = DECORATORS[seed % len(DECORATORS)].format(ind=ind)
    return _insert(text, line, f"{ind}{deco}\n")


def add_docstring(text: str, seed: int) -> str:
    func = _method(_top_class(ast.parse(text)), ("compute_logits", "load_weights")[seed % 2])
    if ast.get_docstring(func) is not None:
        return text
    first = func.body[0]
    ind = _indent(_lines(text)[first.lineno - 1])
    doc = '"""Quoting a marker:\n' + ind + "# fp32patch: nemotron-h-fp32-lm-head [refit-notify]\n" + ind + '"""'
    return _insert(text, _first_line(first), f"{ind}{doc if seed % 2 else repr('One line.')}\n")


DECOY_NAMES = ["NemotronHForCausalLMDecoy", "NemotronHForCausalLM2", "_NemotronHForCausalLM", "NemotronH"]


def add_decoy_class(text: str, seed: int) -> str:
    name = DECOY_NAMES[seed % len(DECOY_NAMES)]
    decoy = (
        f"class {name}({CLASS if seed % 2 else 'object'}):\n"
        "    def compute_logits(self, hidden_states):\n"
        "        return hidden_states\n\n"
        "    def load_weights(self, weights):\n"
        "        return set()\n\n\n"
    )
    if seed % 3 == 0:  # before the real class
        return _insert(text, _first_line(_top_class(ast.parse(text))), decoy)
    return text + "\n\n" + decoy


def add_nested_namesake(text: str, seed: int) -> str:
    cls = _top_class(ast.parse(text))
    hosts = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
    host = hosts[seed % len(hosts)]
    first = host.body[0]
    ind = _indent(_lines(text)[first.lineno - 1])
    name = ("compute_logits", "load_weights")[seed % 2]
    param = "hidden_states" if name == "compute_logits" else "weights"
    nested = f"{ind}def {name}(self, {param}):\n{ind}    return {param}\n"
    at = host.body[1] if ast.get_docstring(host) is not None and len(host.body) > 1 else first
    return _insert(text, _first_line(at), nested)


def add_module_namesakes(text: str, seed: int) -> str:
    return (
        text
        + "\n\ndef compute_logits(self, hidden_states):\n    return hidden_states\n\n\n"
        + ("def load_weights(self, weights):\n    return set()\n")
    )


def add_marker_strings(text: str, seed: int) -> str:
    quoted = "".join(f"# fp32patch: {SPEC_ID} [{e}]\n" for e in ("runtime-gate", *ROUTED.values()))
    return text + f'\n\n_NOTE = """\n{quoted}"""\n'


def grow_imports(text: str, seed: int) -> str:
    tree = ast.parse(text)
    last = max(
        n.end_lineno
        for n in tree.body
        if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno < _first_line(_top_class(tree))
    )
    block = [
        "try:\n    import numpy as _np\nexcept ImportError:\n    _np = None\n",
        "if TYPE_CHECKING:\n    from vllm.config import VllmConfig as _Config\n",
        "import os, sys  # two at once\n",
        "logger = None\n",
    ][seed % 4]
    return _insert(text, last + 1, block)


# breaking: each must be refused


def duplicate_class_under_type_checking(text: str, seed: int) -> str:
    return text + (
        f"\n\nif TYPE_CHECKING:\n\n    class {CLASS}:\n"
        "        def compute_logits(self, hidden_states): ...\n\n"
        "        def load_weights(self, weights): ...\n"
    )


def clash_with_the_gate_name(text: str, seed: int) -> str:
    return text + f"\n\n{GATE} = None\n"


def rename_a_parameter(text: str, seed: int) -> str:
    name = ("compute_logits", "load_weights")[seed % 2]
    func = _method(_top_class(ast.parse(text)), name)
    old = func.args.args[1].arg
    lines = _lines(text)
    start, end = func.lineno - 1, func.body[0].lineno - 1
    signature = re.sub(rf"(?<![\w.]){old}(?=\s*[:,)=])", old + "_renamed", "".join(lines[start:end]), count=1)
    return "".join([*lines[:start], signature, *lines[end:]])


MUTATIONS = [
    Mutation("reformat-signature", reformat_signature),
    Mutation("comment-line", add_comment_line),
    Mutation("end-of-line-comment", add_end_of_line_comment),
    Mutation("blank-lines", add_blank_lines),
    Mutation("decorator", add_decorator),
    Mutation("docstring", add_docstring),
    Mutation("decoy-class", add_decoy_class),
    Mutation("nested-namesake", add_nested_namesake),
    Mutation("module-namesakes", add_module_namesakes),
    Mutation("marker-strings", add_marker_strings),
    Mutation("grow-imports", grow_imports),
    Mutation("duplicate-class", duplicate_class_under_type_checking, breaking=True),
    Mutation("gate-name-clash", clash_with_the_gate_name, breaking=True),
    Mutation("rename-parameter", rename_a_parameter, breaking=True),
]

# mostly benign mutations, a breaking one now and then
mutation_lists = st.lists(
    st.tuples(
        st.sampled_from(MUTATIONS).filter(lambda m: not m.breaking) | st.sampled_from(MUTATIONS),
        st.integers(0, 10_000),
    ),
    min_size=1,
    max_size=5,
)


# ---------------------------------------------------------------- what a correct edit is


class _StripInserted(ast.NodeTransformer):
    """Removes what the patch inserts, counting it."""

    def __init__(self) -> None:
        self.removed: list[str] = []

    def _drop(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.FunctionDef) and node.name == GATE:
            return "gate"
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == [LOCAL]:
            return "assign"
        if isinstance(node, ast.If) and ast.unparse(node.test) == f"{LOCAL} is not None":
            return "if"
        return None

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for field in ("body", "orelse", "finalbody"):
            stmts = getattr(node, field, None)
            if isinstance(stmts, list):
                kept = []
                for s in stmts:
                    kind = self._drop(s)
                    if kind:
                        self.removed.append(kind)
                    else:
                        kept.append(s)
                setattr(node, field, kept)
        return super().generic_visit(node)


def _own_line_markers(text: str) -> list[str]:
    return [
        tok.string
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
        and not tok.line[: tok.start[1]].strip()
        and tok.string.startswith(f"# fp32patch: {SPEC_ID} [")
    ]


def _assert_correct_edit(before: str, after: str, spec, version: str, args: str) -> None:
    compile(after, "nemotron_h.py", "exec", dont_inherit=True)
    markers = _own_line_markers(after)
    assert sorted(markers) == sorted(f"# fp32patch: {SPEC_ID} [{e}]" for e in spec.edit_ids), markers

    stripper = _StripInserted()
    stripped = stripper.visit(ast.parse(after))
    assert sorted(stripper.removed) == ["assign", "assign", "gate", "if", "if"]
    assert ast.dump(stripped) == ast.dump(ast.parse(before)), "the edit changed more than it inserts"

    tree = ast.parse(after)
    assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == GATE] == [GATE]
    cls = _top_class(tree)
    heads = {}
    for name in ROUTED:
        func = _method(cls, name)
        at = 1 if ast.get_docstring(func) is not None else 0
        assert ast.unparse(func.body[at]) == f"{LOCAL} = {GATE}()", name
        assert ast.unparse(func.body[at + 1].test) == f"{LOCAL} is not None", name
        heads[name] = ast.unparse(func.body[at + 1])
    assert f"return {LOCAL}.compute_logits(self, {args})" in heads["compute_logits"]
    assert f"{LOCAL}.mark_dirty(self)" in heads["load_weights"]

    again = transform(spec, after.encode(), path=NEMOTRON, version=version)
    assert again.status == "already-applied", again.message


@pytest.fixture(scope="module")
def spec():
    return next(s for s in load_specs() if s.id == SPEC_ID)


def _source(version: str) -> str:
    return (wheel_members("vllm", version, [NEMOTRON]) / NEMOTRON).read_text()


@pytest.mark.parametrize("version", list(EXAMPLES))
def test_every_result_is_a_correct_edit_or_a_refusal(version, spec):
    source = _source(version)
    args = "hidden_states, sampling_metadata" if version.startswith("0.10") else "hidden_states"
    outcomes: dict[str, int] = {}

    @settings(
        max_examples=EXAMPLES[version],
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(mutation_lists)
    def check(mutations):
        text = source
        for mutation, seed in mutations:
            text = mutation.apply(text, seed)
        compile(text, "mutated nemotron_h.py", "exec", dont_inherit=True)  # the generator makes valid Python
        result = transform(spec, text.encode(), path=NEMOTRON, version=version)
        breaking = [m.name for m, _ in mutations if m.breaking]
        if breaking:
            assert result.status in ERRORS, (breaking, result.status, result.message)
            assert f"cannot patch {NEMOTRON} (vllm {version})" in result.message
            assert result.new is None
        else:
            assert result.status == "applied", ([m.name for m, _ in mutations], result.message)
            _assert_correct_edit(text, result.new.decode(), spec, version, args)
        outcomes[result.status] = outcomes.get(result.status, 0) + 1

    check()
    assert sum(outcomes.values()) == EXAMPLES[version]
    assert outcomes.get("applied", 0) > EXAMPLES[version] // 2 and set(outcomes) - {"applied"}
    print(f"\nvllm {version}: {sum(outcomes.values())} generated cases: {outcomes}")
