"""Property: whatever the formatting, comments and code around an anchor, the result is a correct edit or a refusal.

For every shipped spec, hypothesis starts from a real file of its target and applies a
few mutations: signatures and statements re-wrapped, comments, blank lines, decorators
and docstrings added, decoys (a class with a similar name, a nested or module-level def
of the same name, marker text inside strings and inline comments), import blocks grown.
Each mutation is *benign* (the patch must still apply) or *breaking* (it must be refused).
A correct edit is: every edit's marker exactly once, output that compiles, re-applying
is already-applied, the edits in the right functions, and the output's AST equal to the
input's once the edits are taken out again.

The files: vLLM's nemotron_h.py from its 0.33.0 and 0.10.2 wheels (one per spec
variant), its logits_processor.py from 0.33.0, 0.25.1 and 0.10.2 (both variants, and the
GEMM on one line and on three) and, for NeMo-RL (no release of it carries the files), the
project's own fixtures: vllm_worker_async.py (tests/fixtures/nemo_rl/pre_fix.py), and the
Megatron setup.py of the stand-in checkout (tests/fixtures/nemo_rl_shapes.py) for
nemo-rl-fp32-lm-head, whose other files go along unchanged; there a breaking mutation must
also never let an older variant, which leaves the inference model out, take over. For
verl-fp32-lm-head, verl 0.9.1's FSDP engine and vLLM rollout server from its wheel, each with
the release's other target files unchanged beside it. For trl-fp32-lm-head, TRL 1.16.0's
trl/generation/vllm_generation.py (vLLM's switch before the colocated LLM is built, the probes
after it and after the server's client) and trl/trainer/utils.py (add_fused_lm_head's chunked
kernel) from its wheel, likewise each with the other six target files unchanged beside it. For
openrlhf-fp32-lm-head, OpenRLHF 0.11.2's models/actor.py (Actor.forward's model call, entropy and
log-probs, each replaced through the gate) from its wheel, with the other five target files.
For slime-fp32-lm-head (slime is not on PyPI), the stand-in checkout's sglang_engine.py (tests/fixtures/
slime_src: each server's arguments, the probe after the server is launched or reached, one of them
in an ``else`` branch), the other two target files unchanged beside it. For prime-rl-fp32-lm-head (not
on PyPI either), the stand-in checkout's rl/train.py (tests/fixtures/prime_rl_src: the wiring right
after setup_model), the other six target files unchanged beside it. For skyrl-fp32-lm-head,
SkyRL 0.4.0's workers/model_wrapper.py (HFModelWrapper.forward's model calls, log-probs and entropy,
each replaced through the gate) from its wheel, with the other seven target files.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fp32patch.patcher.model import REFUSALS as ERRORS
from fp32patch.patcher.model import Spec
from fp32patch.patcher.spec import load_specs
from fp32patch.patcher.transform import transform
from tests.conftest import LOGITS_PROCESSOR, NEMOTRON
from tests.support.pypi import wheel_members

pytestmark = pytest.mark.network

FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


# ---------------------------------------------------------------- reading and editing the text


@functools.cache
def _spec(spec_id: str) -> Spec:
    """A shipped spec, loaded once per worker (the correctness checks ask for it every example)."""
    return next(s for s in load_specs() if s.id == spec_id)


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _child(node: ast.AST, name: str, kinds: tuple[type, ...] = (ast.ClassDef, *FUNCS)) -> ast.AST:
    return next(n for n in node.body if isinstance(n, kinds) and n.name == name)  # type: ignore[attr-defined]


def _path(tree: ast.AST, *names: str) -> ast.AST:
    for name in names:
        tree = _child(tree, name)
    return tree


def _first_line(node: ast.stmt) -> int:
    """1-based first line of a statement, its decorators included."""
    return min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])


def _statements(node: ast.AST) -> list[ast.stmt]:
    return [n for n in ast.walk(node) if isinstance(n, ast.stmt)]


def _insert(text: str, line: int, block: str) -> str:
    """Insert ``block`` (whole lines) before 1-based ``line``."""
    lines = _lines(text)
    return "".join([*lines[: line - 1], block, *lines[line - 1 :]])


def _signature(text: str, func: ast.AST) -> tuple[int, int, list[str], str, str]:
    """The def's line span (0-based, end exclusive), its parameters, return annotation, what follows ':'."""
    lines = _lines(text)
    start = func.lineno - 1  # type: ignore[attr-defined]
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
    raise AssertionError("no end of signature")


def _untokenize(toks: list[tokenize.TokenInfo]) -> str:
    out = ""
    for prev, tok in zip([None, *toks[:-1]], toks, strict=True):
        gap = prev is not None and prev.end != tok.start and tok.string not in ".[](),:" and prev.string not in ".[("
        out += (" " if gap else "") + tok.string
    return out


# ---------------------------------------------------------------- mutations, generic over a region


@dataclass(frozen=True)
class Mutation:
    name: str
    apply: Callable[[str, int], str]
    breaking: bool = False


Find = Callable[[ast.Module], ast.AST]


def reformat_signature(find_funcs: list[Find]) -> Callable[[str, int], str]:
    def mutate(text: str, seed: int) -> str:
        func = find_funcs[seed % len(find_funcs)](ast.parse(text))
        start, end, params, ret, rest = _signature(text, func)
        ind = _indent(_lines(text)[start])
        head = f"{ind}{'async ' if isinstance(func, ast.AsyncFunctionDef) else ''}def {func.name}"
        ret = f" {ret}" if ret else ""
        style = (seed // len(find_funcs)) % 5
        if style == 0:  # one line
            sig = f"{head}({', '.join(params)}){ret}:"
        elif style == 1:  # one parameter per line, trailing comma
            sig = f"{head}(\n" + "".join(f"{ind}        {p},\n" for p in params) + f"{ind}){ret}:"
        elif style == 2:  # hanging, aligned under the parenthesis
            pad = " " * len(f"{head}(")
            sig = f"{head}(" + f",\n{pad}".join(params) + f"){ret}:"
        elif style == 3:  # generous spacing
            sig = f"{head} (  {' ,  '.join(params)}  ) {ret.replace('->', ' ->  ')} :"
        else:  # a comment on every parameter line
            sig = f"{head}(  # why\n" + "".join(f"{ind}    {p},  # {p.split(':')[0]}\n" for p in params)
            sig += f"{ind}){ret}:  # returns"
        lines = _lines(text)
        return "".join([*lines[:start], sig + rest, *lines[end:]])

    return mutate


COMMENTS = [
    "# a comment",
    "# def compute_logits(self, hidden_states):",
    "# except VLLMValidationError: raise ValueError(...) is what upstream does",
    "# fp32patch: nemotron-h-fp32-lm-head",
    "#: sphinx comment with ... and `...`",
    "# type: ignore",
]


def comment_line(region: Find) -> Callable[[str, int], str]:
    def mutate(text: str, seed: int) -> str:
        stmts = _statements(region(ast.parse(text)))
        line = _first_line(stmts[seed % len(stmts)])
        return _insert(text, line, f"{_indent(_lines(text)[line - 1])}{COMMENTS[seed % len(COMMENTS)]}\n")

    return mutate


def end_of_line_comment(region: Find, marker: str) -> Callable[[str, int], str]:
    def mutate(text: str, seed: int) -> str:
        simple = [s for s in _statements(region(ast.parse(text))) if not hasattr(s, "body")]
        stmt = simple[seed % len(simple)]
        lines = _lines(text)
        i = stmt.end_lineno - 1
        body = lines[i].rstrip("\r\n")
        if "#" in body or body.endswith("\\"):
            return text
        lines[i] = f"{body}  {marker if seed % 3 == 0 else '# note'}" + lines[i][len(body) :]
        return "".join(lines)

    return mutate


def blank_lines(region: Find) -> Callable[[str, int], str]:
    def mutate(text: str, seed: int) -> str:
        stmts = _statements(region(ast.parse(text)))
        return _insert(text, _first_line(stmts[seed % len(stmts)]), "\n" * (1 + seed % 3))

    return mutate


DECORATORS = ["@torch.no_grad()", "@staticmethod_like", "@functools.lru_cache(\n{ind}    maxsize=None,\n{ind})"]


def decorator(find_funcs: list[Find]) -> Callable[[str, int], str]:
    def mutate(text: str, seed: int) -> str:
        func = find_funcs[seed % len(find_funcs)](ast.parse(text))
        line = _first_line(func)
        ind = _indent(_lines(text)[line - 1])
        return _insert(text, line, f"{ind}{DECORATORS[seed % len(DECORATORS)].format(ind=ind)}\n")

    return mutate


def docstring(find_funcs: list[Find], marker: str) -> Callable[[str, int], str]:
    def mutate(text: str, seed: int) -> str:
        func = find_funcs[seed % len(find_funcs)](ast.parse(text))
        if ast.get_docstring(func) is not None:
            return text
        first = func.body[0]
        ind = _indent(_lines(text)[first.lineno - 1])
        doc = f'"""Quoting a marker:\n{ind}{marker}\n{ind}"""' if seed % 2 else repr("One line.")
        return _insert(text, _first_line(first), f"{ind}{doc}\n")

    return mutate


def marker_strings(spec: Spec) -> Callable[[str, int], str]:
    def mutate(text: str, seed: int) -> str:
        quoted = "".join(f"# fp32patch: {spec.id} [{e}]\n" for e in spec.edit_ids)
        return text + f'\n\n_NOTE = """\n{quoted}"""\n'

    return mutate


def insert_at(find: Find, block: Callable[[str, int], str], *, where: str = "before") -> Callable[[str, int], str]:
    """Insert ``block(indent, seed)`` before the node ``find`` returns, or as its body's first statement."""

    def mutate(text: str, seed: int) -> str:
        node = find(ast.parse(text))
        if where == "before":
            line = _first_line(node)
            ind = _indent(_lines(text)[line - 1])
        else:
            first = node.body[1] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body[0]
            line = _first_line(first)
            ind = _indent(_lines(text)[line - 1])
        return _insert(text, line, block(ind, seed))

    return mutate


def _block(code: str) -> Callable[[str, int], str]:
    """A code block (written at indent 0) re-indented where it is inserted."""
    return lambda ind, seed: "".join(ind + line if line.strip() else line for line in _lines(code)) + "\n"


def moved_into_nested(find: Find, name: str) -> Callable[[str, int], str]:
    """The statement ``find`` returns, moved (not copied) into a new def nested where it stood: it
    runs only if something calls that def, so an edit anchored on it there would never run."""

    def mutate(text: str, seed: int) -> str:
        node = find(ast.parse(text))
        lines = _lines(text)
        first, last = _first_line(node) - 1, node.end_lineno  # type: ignore[attr-defined]
        ind = _indent(lines[first])
        body = "".join("    " + line if line.strip() else line for line in lines[first:last])
        return "".join([*lines[:first], f"{ind}def {name}():\n", body, *lines[last:]])

    return mutate


def append(code: str) -> Callable[[str, int], str]:
    return lambda text, seed: text + "\n\n" + code


def rename_parameter(find: Find) -> Callable[[str, int], str]:
    def mutate(text: str, seed: int) -> str:
        func = find(ast.parse(text))
        old = func.args.args[-1].arg
        lines = _lines(text)
        start, end = func.lineno - 1, func.body[0].lineno - 1
        signature = re.sub(rf"(?<![\w.]){old}(?=\s*[:,)=])", old + "_renamed", "".join(lines[start:end]), count=1)
        return "".join([*lines[:start], signature, *lines[end:]])

    return mutate


# ---------------------------------------------------------------- nemotron-h-fp32-lm-head on vLLM's file


CLASS = "NemotronHForCausalLM"
GATE, LOCAL = "_fp32patch_lm_head_runtime", "_fp32patch_runtime"


def _nemotron_class(tree: ast.Module) -> ast.ClassDef:
    return _child(tree, CLASS, (ast.ClassDef,))


def _nemotron_funcs() -> list[Find]:
    return [lambda t, n=n: _child(_nemotron_class(t), n, FUNCS) for n in ("compute_logits", "load_weights")]


def _grow_imports_before(find_class: Callable[[ast.Module], ast.ClassDef]) -> Callable[[str, int], str]:
    return lambda text, seed: _grow_imports(text, seed, find_class)


def _grow_imports(text: str, seed: int, find_class: Callable[[ast.Module], ast.ClassDef] = _nemotron_class) -> str:
    tree = ast.parse(text)
    first_class = _first_line(find_class(tree))
    last = max(
        n.end_lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno < first_class
    )
    block = [
        "try:\n    import numpy as _np\nexcept ImportError:\n    _np = None\n",
        "if TYPE_CHECKING:\n    from vllm.config import VllmConfig as _Config\n",
        "import os, sys  # two at once\n",
        "logger = None\n",
    ][seed % 4]
    return _insert(text, last + 1, block)


def _decoy_class(text: str, seed: int) -> str:
    name = ["NemotronHForCausalLMDecoy", "NemotronHForCausalLM2", "_NemotronHForCausalLM", "NemotronH"][seed % 4]
    decoy = (
        f"class {name}({CLASS if seed % 2 else 'object'}):\n"
        "    def compute_logits(self, hidden_states):\n        return hidden_states\n\n"
        "    def load_weights(self, weights):\n        return set()\n\n\n"
    )
    if seed % 3 == 0:  # before the real class
        return _insert(text, _first_line(_nemotron_class(ast.parse(text))), decoy)
    return text + "\n\n" + decoy


def _nested_namesake(text: str, seed: int) -> str:
    hosts = [f for f in _nemotron_class(ast.parse(text)).body if isinstance(f, FUNCS)]
    name = ("compute_logits", "load_weights")[seed % 2]
    param = "hidden_states" if name == "compute_logits" else "weights"
    code = f"def {name}(self, {param}):\n    return {param}\n"
    host = hosts[seed % len(hosts)]
    return insert_at(lambda t: _child(_nemotron_class(t), host.name, FUNCS), _block(code), where="body")(text, seed)


class _StripGated(ast.NodeTransformer):
    """Takes out what a vLLM spec inserts (its gate, and each use of the runtime it returns), counting it."""

    def __init__(self, gate: str = GATE) -> None:
        self.gate = gate
        self.removed: list[str] = []

    def _kind(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.FunctionDef) and node.name == self.gate:
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
                kinds = [self._kind(s) for s in stmts]
                self.removed += [k for k in kinds if k]
                setattr(node, field, [s for s, k in zip(stmts, kinds, strict=True) if not k])
        return super().generic_visit(node)


def _nemotron_correct(before: str, after: str, args: str) -> None:
    stripper = _StripGated()
    stripped = stripper.visit(ast.parse(after))
    assert sorted(stripper.removed) == ["assign", "assign", "gate", "if", "if"]
    assert ast.dump(stripped) == ast.dump(ast.parse(before)), "the edit changed more than it inserts"
    tree = ast.parse(after)
    assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == GATE] == [GATE]
    heads = {}
    for name in ("compute_logits", "load_weights"):
        func = _child(_nemotron_class(tree), name, FUNCS)
        at = 1 if ast.get_docstring(func) is not None else 0
        assert ast.unparse(func.body[at]) == f"{LOCAL} = {GATE}()", name
        heads[name] = ast.unparse(func.body[at + 1])
    assert f"return {LOCAL}.compute_logits(self, {args})" in heads["compute_logits"]
    assert f"{LOCAL}.mark_dirty(self)" in heads["load_weights"]


def _nemotron_mutations(spec: Spec) -> list[Mutation]:
    region = _nemotron_class
    funcs = _nemotron_funcs()
    marker = f"# fp32patch: {spec.id} [{spec.edit_ids[-1]}]"
    return [
        Mutation("reformat-signature", reformat_signature(funcs)),
        Mutation("comment-line", comment_line(region)),
        Mutation("end-of-line-comment", end_of_line_comment(region, f"# fp32patch: {spec.id} [{spec.edit_ids[0]}]")),
        Mutation("blank-lines", blank_lines(region)),
        Mutation("decorator", decorator(funcs)),
        Mutation("docstring", docstring(funcs, marker)),
        Mutation("decoy-class", _decoy_class),
        Mutation("nested-namesake", _nested_namesake),
        Mutation(
            "module-namesakes",
            append(
                "def compute_logits(self, hidden_states):\n    return hidden_states\n\n\n"
                "def load_weights(self, weights):\n    return set()\n"
            ),
        ),
        Mutation("marker-strings", marker_strings(spec)),
        Mutation("grow-imports", _grow_imports),
        # breaking: each must be refused
        Mutation(
            "duplicate-class",
            append(
                f"if TYPE_CHECKING:\n\n    class {CLASS}:\n        def compute_logits(self, hidden_states): ...\n\n"
                "        def load_weights(self, weights): ...\n"
            ),
            breaking=True,
        ),
        Mutation("gate-name-clash", append(f"{GATE} = None\n"), breaking=True),
        Mutation("rename-parameter", lambda t, s: rename_parameter(funcs[s % 2])(t, s), breaking=True),
    ]


# ---------------------------------------------------------------- vllm-fp32-logits on vLLM's file


LP_CLASS, LP_GATE = "LogitsProcessor", "_fp32patch_lm_head_runtime"
GEMM = "logits = lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)"
# the functions each variant edits: (the head route's, the processor-way's)
LP_FUNCS = {"head-gemm": ("_get_logits", "forward"), "native-head-dtype": ("_apply_head", "__init__")}


def _lp_class(tree: ast.Module) -> ast.ClassDef:
    return _child(tree, LP_CLASS, (ast.ClassDef,))


def _lp_funcs(variant: str) -> list[Find]:
    return [lambda t, n=n: _child(_lp_class(t), n, FUNCS) for n in LP_FUNCS[variant]]


def _lp_variant(text: str) -> str:
    return "native-head-dtype" if "def _apply_head" in text else "head-gemm"


def _lp_decoy_class(text: str, seed: int) -> str:
    name = ["LogitsProcessorWithLoRA", "LogitsProcessor2", "_LogitsProcessor", "Logits"][seed % 4]
    decoy = (
        f"class {name}({LP_CLASS if seed % 2 else 'object'}):\n"
        "    def _get_logits(self, hidden_states, lm_head, embedding_bias):\n"
        f"        {GEMM}\n        return logits\n\n\n"
    )
    if seed % 3 == 0:
        return _insert(text, _first_line(_lp_class(ast.parse(text))), decoy)
    return text + "\n\n" + decoy


def _lp_gemm_twice(text: str, seed: int) -> str:
    """A second head GEMM in the function the route anchors on: which one is the head's?"""
    variant = _lp_variant(text)
    find = _lp_funcs(variant)[0]
    code = (
        GEMM
        if variant == "head-gemm"
        else "if self.head_dtype is None or self.head_dtype == hidden_states.dtype:\n    pass"
    )
    return insert_at(find, _block(code), where="body")(text, seed)


def _logits_correct(before: str, after: str, variant: str) -> None:
    stripper = _StripGated(LP_GATE)
    stripped = stripper.visit(ast.parse(after))
    assert sorted(stripper.removed) == ["assign", "assign", "gate", "if", "if"]
    assert ast.dump(stripped) == ast.dump(ast.parse(before)), "the edit changed more than it inserts"
    cls = _lp_class(ast.parse(after))
    route, way = (ast.unparse(_child(cls, n, FUNCS)) for n in LP_FUNCS[variant])
    if variant == "head-gemm":
        # the head swapped right before vLLM's own GEMM line; the LoRA note after forward's logits
        assert f"{LOCAL}.fp32_head(self, lm_head, hidden_states)\n{GEMM}" in route.replace("    ", "")
        assert f"{LOCAL}.note_processor(self, lm_head, hidden_states)" in way
    else:
        body = _child(cls, "_apply_head", FUNCS).body
        at = 1 if ast.get_docstring(_child(cls, "_apply_head", FUNCS)) is not None else 0
        assert ast.unparse(body[at]) == f"{LOCAL} = {LP_GATE}()" and f"{LOCAL}.apply_head(" in ast.unparse(body[at + 1])
        assert ast.unparse(body[at + 2]).startswith("if self.head_dtype is None or")
        assert way.rstrip().endswith(f"self.head_dtype = {LOCAL}.native_head_dtype(self, model_config)")


def _logits_mutations(spec: Spec, variant: str) -> list[Mutation]:
    region = _lp_class
    funcs = _lp_funcs(variant)
    marker = f"# fp32patch: {spec.id} [{spec.edit_ids[-1]}]"
    return [
        Mutation("reformat-signature", reformat_signature(funcs)),
        Mutation("comment-line", comment_line(region)),
        Mutation("end-of-line-comment", end_of_line_comment(region, f"# fp32patch: {spec.id} [{spec.edit_ids[0]}]")),
        Mutation("blank-lines", blank_lines(region)),
        Mutation("decorator", decorator(funcs)),
        Mutation("docstring", docstring(funcs, marker)),
        Mutation("decoy-class", _lp_decoy_class),
        Mutation(
            "module-namesakes",
            append(f"def _get_logits(self, hidden_states, lm_head, embedding_bias):\n    {GEMM}\n    return logits\n"),
        ),
        Mutation("marker-strings", marker_strings(spec)),
        Mutation("grow-imports", _grow_imports_before(_lp_class)),
        # breaking: each must be refused
        Mutation(
            "duplicate-class",
            append(
                f"if TYPE_CHECKING:\n\n    class {LP_CLASS}:\n"
                "        def _get_logits(self, hidden_states, lm_head, embedding_bias):\n"
                f"            {GEMM}\n\n"
                "        def _apply_head(self, lm_head, hidden_states, embedding_bias):\n"
                "            if self.head_dtype is None or self.head_dtype == hidden_states.dtype:\n"
                "                pass\n"
            ),
            breaking=True,
        ),
        Mutation("gate-name-clash", append(f"{LP_GATE} = None\n"), breaking=True),
        Mutation("rename-parameter", rename_parameter(funcs[0]), breaking=True),
        Mutation("head-gemm-twice", _lp_gemm_twice, breaking=True),
    ]


# ---------------------------------------------------------------- nemo-rl-context-length-400 on NeMo-RL's file


def _setup(tree: ast.Module) -> ast.FunctionDef:
    return _path(tree, "VllmAsyncGenerationWorkerImpl", "_setup_vllm_openai_api_server")


def _clamp(tree: ast.Module) -> ast.FunctionDef:
    return _path(_setup(tree), "NeMoRLOpenAIServingMixin", "_clamp_max_tokens")


def _route(tree: ast.Module) -> ast.AsyncFunctionDef:
    return _child(_setup(tree), "create_chat_completion", FUNCS)


def _rewrap_raise(text: str, seed: int) -> str:
    """The clamp's ``raise ValueError(<message>)`` on one line, or the message on a line of its own."""
    clamp = _clamp(ast.parse(text))
    stmt = next(s for s in ast.walk(clamp) if isinstance(s, ast.Raise))
    lines = _lines(text)
    ind = _indent(lines[stmt.lineno - 1])
    message = ast.unparse(stmt.exc.args[0])
    new = (
        f"{ind}raise ValueError({message})\n"
        if seed % 2
        else f"{ind}raise ValueError(\n{ind}    {message}  # said once\n{ind})\n"
    )
    return "".join([*lines[: stmt.lineno - 1], new, *lines[stmt.end_lineno :]])


def _handler_gone(text: str, seed: int) -> str:
    """The route's try no longer catches VLLMValidationError (the handler the edit goes after)."""
    [try_] = [n for n in ast.walk(_route(ast.parse(text))) if isinstance(n, ast.Try)]
    handler = next(h for h in try_.handlers if ast.unparse(h.type) == "VLLMValidationError")
    lines = _lines(text)
    i = handler.type.lineno - 1
    lines[i] = lines[i].replace("VLLMValidationError", "RuntimeError", 1)
    return "".join(lines)


ROUTE_DECOY = """\
@app.post("/v1/completions")
async def create_completion(request, raw_request):
    try:
        generator = await openai_serving_chat.create_chat_completion(request, raw_request)
    except VLLMValidationError as e:
        return JSONResponse(content={"error": str(e)}, status_code=400)
    return JSONResponse(content=generator.model_dump())

"""

MIXIN_DECOY = """\
class NeMoRLOpenAIServingMixinV2:
    def _clamp_max_tokens(self, request, request_max_tokens, prompt_token_ids):
        if self.model_config.max_model_len < len(prompt_token_ids):
            raise ValueError(f"too long for {self.model_config.max_model_len}")

"""

SECOND_ROUTE = """\
@app.post("/v2/chat/completions")
async def create_chat_completion(request, raw_request):
    try:
        generator = await openai_serving_chat.create_chat_completion(request, raw_request)
    except VLLMValidationError as e:
        return JSONResponse(content={"error": str(e)}, status_code=400)
    return JSONResponse(content=generator.model_dump())

"""


def _nemo_rl_mutations(spec: Spec) -> list[Mutation]:
    funcs: list[Find] = [_clamp, _route]
    marker = f"# fp32patch: {spec.id} [{spec.edit_ids[-1]}]"
    return [
        Mutation("reformat-signature", reformat_signature(funcs)),
        Mutation("rewrap-raise", _rewrap_raise),
        Mutation("comment-line", comment_line(_setup)),
        Mutation("end-of-line-comment", end_of_line_comment(_setup, f"# fp32patch: {spec.id} [{spec.edit_ids[0]}]")),
        Mutation("blank-lines", blank_lines(_setup)),
        Mutation("decorator", decorator(funcs)),
        Mutation("docstring", docstring([_route], marker)),
        Mutation("decoy-route", insert_at(_route, _block(ROUTE_DECOY))),
        Mutation("decoy-mixin", insert_at(lambda t: _path(_setup(t), "NeMoRLOpenAIServingMixin"), _block(MIXIN_DECOY))),
        Mutation(
            "module-namesakes",
            append(
                "async def create_chat_completion(request):\n    try:\n        pass\n"
                "    except VLLMValidationError:\n        return JSONResponse({})\n"
            ),
        ),
        Mutation("marker-strings", marker_strings(spec)),
        # breaking: each must be refused
        Mutation("second-route-same-name", insert_at(_route, _block(SECOND_ROUTE)), breaking=True),
        Mutation("rename-parameter", rename_parameter(_clamp), breaking=True),
        Mutation("handler-gone", _handler_gone, breaking=True),
    ]


class _StripNemoRl(ast.NodeTransformer):
    """Takes out the inserted handler and blanks every clamp message, so only the rest is compared."""

    def __init__(self) -> None:
        self.removed = 0

    def visit_Try(self, node: ast.Try) -> ast.AST:
        kept = [h for h in node.handlers if not (h.type is not None and ast.unparse(h.type) == "ValueError")]
        self.removed += len(node.handlers) - len(kept)
        node.handlers = kept
        return self.generic_visit(node)


def _blank_raises(tree: ast.Module) -> ast.Module:
    for node in ast.walk(_clamp(tree)):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            node.exc.args = []
    return tree


def _nemo_rl_correct(before: str, after: str, args: str) -> None:
    tree = ast.parse(after)
    raises = [n for n in ast.walk(_clamp(tree)) if isinstance(n, ast.Raise)]
    assert len(raises) == 1 and "maximum context length" in ast.unparse(raises[0])
    [try_] = [n for n in ast.walk(_route(tree)) if isinstance(n, ast.Try)]
    types = [ast.unparse(h.type) for h in try_.handlers]
    assert types[types.index("VLLMValidationError") + 1] == "ValueError"  # right after the 400 handler
    stripper = _StripNemoRl()
    stripped = _blank_raises(stripper.visit(ast.parse(after)))
    assert stripper.removed == 1
    assert ast.dump(stripped) == ast.dump(_blank_raises(ast.parse(before))), "the edit changed more than it should"


# ---------------------------------------------------------------- nemo-rl-fp32-lm-head on NeMo-RL's Megatron setup

SETUP = "nemo_rl/models/megatron/setup.py"
WIRE = "_fp32patch_wire_megatron"


def _nemo_rl_checkout() -> dict[str, str]:
    """The project's stand-in NeMo-RL checkout at its newest shape (no release carries the files)."""
    from tests.fixtures.nemo_rl_shapes import SHAPES, files_at

    return files_at(SHAPES[0].name)


def _top(name: str) -> Find:
    return lambda tree: _child(tree, name, FUNCS)


_SETUP_FUNCS = [_top(n) for n in ("validate_and_set_config", "_apply_precision_config", "build_inference_model")]
_SETUP_FUNCS.append(_top("setup_model_and_optimizer"))


def _get_model_line(func: str, target: str) -> Callable[[str, int], str]:
    """Rename the variable that ``target = get_model(...)`` in ``func`` assigns (the anchor moves)."""

    def mutate(text: str, seed: int) -> str:
        node = _top(func)(ast.parse(text))
        stmt = next(
            n
            for n in ast.walk(node)
            if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == target and "get_model(" in ast.unparse(n)
        )
        lines = _lines(text)
        i = stmt.lineno - 1
        lines[i] = lines[i].replace(f"{target} = get_model(", f"{target}_chunks = get_model(", 1)
        return "".join(lines)

    return mutate


def _rename_first_parameter(func: str) -> Callable[[str, int], str]:
    """The function's first parameter (policy_cfg, config) gets another name: the inserted code's is gone."""

    def mutate(text: str, seed: int) -> str:
        node = _top(func)(ast.parse(text))
        old = node.args.args[0].arg
        lines = _lines(text)
        start, end = node.lineno - 1, node.body[0].lineno - 1
        signature = re.sub(rf"(?<![\w.]){old}(?=\s*[:,)=])", "cfg", "".join(lines[start:end]), count=1)
        body = "".join(lines[end : node.end_lineno]).replace(old, "cfg")
        return "".join([*lines[:start], signature, body, *lines[node.end_lineno :]])

    return mutate


NESTED_NAMESAKE = """\
def _helpers():
    def setup_model_and_optimizer(policy_cfg, megatron_cfg):
        model = get_model(megatron_cfg.model, megatron_cfg.ddp)
        return model

    return setup_model_and_optimizer

"""

REFERENCE_DECOY = """\
def setup_reference_model_state(config, megatron_cfg):
    reference_model = get_model(megatron_cfg.model, megatron_cfg.ddp)
    model = get_model(megatron_cfg.model, megatron_cfg.ddp)
    return reference_model[0].state_dict(), model

"""

SECOND_GET_MODEL = """\
model = get_model(megatron_cfg.model, megatron_cfg.ddp)
"""


def _setup_mutations(spec: Spec) -> list[Mutation]:
    marker = f"# fp32patch: {spec.id} [wire-policy]"
    smo = _top("setup_model_and_optimizer")
    return [
        Mutation("reformat-signature", reformat_signature(_SETUP_FUNCS)),
        Mutation("comment-line", comment_line(smo)),
        Mutation("end-of-line-comment", end_of_line_comment(_top("_apply_precision_config"), marker)),
        Mutation("blank-lines", blank_lines(_top("build_inference_model"))),
        Mutation("decorator", decorator(_SETUP_FUNCS)),
        Mutation("docstring", docstring([_top("validate_and_set_config"), smo], marker)),
        Mutation("nested-namesake", insert_at(smo, _block(NESTED_NAMESAKE))),
        Mutation("reference-model-decoy", insert_at(smo, _block(REFERENCE_DECOY))),
        Mutation("marker-strings", marker_strings(spec)),
        # breaking: each must be refused, never patched by an older variant that leaves a model out
        Mutation("policy-get-model-moved", _get_model_line("setup_model_and_optimizer", "model"), breaking=True),
        Mutation(
            "inference-get-model-moved", _get_model_line("build_inference_model", "inference_model"), breaking=True
        ),
        Mutation(
            "second-get-model",
            insert_at(
                lambda t: next(
                    n for n in ast.walk(smo(t)) if isinstance(n, ast.Assign) and "get_model(" in ast.unparse(n)
                ),
                _block(SECOND_GET_MODEL),
            ),
            breaking=True,
        ),
        Mutation("policy-cfg-renamed", _rename_first_parameter("setup_model_and_optimizer"), breaking=True),
    ]


def _ours(stmt: ast.stmt) -> bool:
    """A statement of the patch: a call of our helpers, or the residual's ``if``."""
    text = ast.unparse(stmt)
    return "_fp32patch_" in text.split("\n")[0] or (isinstance(stmt, ast.If) and "fp32_residual_connection" in text)


class _StripSetup(ast.NodeTransformer):
    def __init__(self) -> None:
        self.removed: list[str] = []

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(node, name, None)
            if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
                kept = []
                for stmt in stmts:
                    is_helper = isinstance(stmt, ast.FunctionDef) and stmt.name.startswith("_fp32patch_")
                    if is_helper or (not isinstance(stmt, (ast.FunctionDef, ast.ClassDef)) and _ours(stmt)):
                        self.removed.append(ast.unparse(stmt).split("\n")[0])
                    else:
                        kept.append(stmt)
                setattr(node, name, kept)
        return super().generic_visit(node)


def _follows(func: ast.AST, first: str, then: str, *, step: int = 1) -> None:
    """In ``func``, the statement right after (``step=-1``: right before) the one that starts with ``first`` is ``then``."""
    for node in ast.walk(func):
        for body in (getattr(node, name, None) for name in ("body", "orelse", "finalbody")):
            if not isinstance(body, list):
                continue
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.stmt) and ast.unparse(stmt).startswith(first) and 0 <= i + step < len(body):
                    assert ast.unparse(body[i + step]) == then, (first, ast.unparse(body[i + step]))
                    return
    raise AssertionError(f"no statement starting with {first!r}")


def _setup_correct(before: str, after: str, args: str) -> None:
    tree = ast.parse(after)
    _follows(_top("setup_model_and_optimizer")(tree), "model = get_model(", f"model = {WIRE}(model, policy_cfg)")
    _follows(
        _top("build_inference_model")(tree),
        "inference_model = get_model(",
        f"inference_model = {WIRE}(inference_model, policy_cfg)",
    )
    guard = _top("validate_and_set_config")(tree)
    first = guard.body[1] if ast.get_docstring(guard) is not None else guard.body[0]
    assert ast.unparse(first) == "_fp32patch_check_config(config, f'megatron worker rank {rank}')"
    _follows(_top("_apply_precision_config")(tree), "model_cfg.pipeline_dtype = ", ast.unparse(_residual_if()))
    stripper = _StripSetup()
    stripped = stripper.visit(ast.parse(after))
    assert len(stripper.removed) == 4 + len(
        [n for n in ast.parse(after).body if isinstance(n, ast.FunctionDef) and n.name.startswith("_fp32patch_")]
    )
    assert ast.dump(stripped) == ast.dump(ast.parse(before)), "the edit changed more than it should"


def _residual_if() -> ast.stmt:
    spec = _spec("nemo-rl-fp32-lm-head")
    (edit,) = [e for e in spec.variants[0].edits if e.id == "residual"]
    return ast.parse(edit.code).body[0]


# ---------------------------------------------------------------- nemo-rl-fp32-lm-head on NeMo-RL's DTensor workers

DTENSOR = "nemo_rl/models/policy/workers/dtensor_policy_worker.py"
DTENSOR_V2 = "nemo_rl/models/policy/workers/dtensor_policy_worker_v2.py"
# each worker file: its class, the statement the guard comes first or before, the one the wiring follows or precedes
_WORKERS = {
    DTENSOR: ("DTensorPolicyWorkerImpl", "if is_tied_lm_head:", "after"),
    DTENSOR_V2: ("DTensorPolicyWorkerV2Impl", "if init_reference_model:", "before"),
}

OTHER_CLASS_WITH_INIT = """\
class _Buffers:
    def __init__(self):
        self.items = []

"""

MODULE_LEVEL_NAMESAKES = """\
def __init__(config, is_tied_lm_head=False, init_reference_model=False):
    if is_tied_lm_head:
        pass
    if init_reference_model:
        pass
    runtime_config = validate_and_prepare_config(config)
    return runtime_config

"""

OTHER_METHOD = """\
def _rebuild(self, config, is_tied_lm_head=False, init_reference_model=False):
    if is_tied_lm_head:
        self.model.tie_weights()
    if init_reference_model:
        pass
    runtime_config = validate_and_prepare_config(config)
    return runtime_config

"""


def _dtensor_mutations(path: str) -> Callable[[Spec], list[Mutation]]:
    cls, anchor, _ = _WORKERS[path]

    def init(tree: ast.Module) -> ast.AST:
        return _path(tree, cls, "__init__")

    def anchor_stmt(tree: ast.Module) -> ast.AST:
        return next(n for n in ast.walk(init(tree)) if isinstance(n, ast.If) and ast.unparse(n).startswith(anchor))

    def mutations(spec: Spec) -> list[Mutation]:
        return [
            Mutation("reformat-signature", reformat_signature([init])),
            Mutation("comment-line", comment_line(init)),
            Mutation("blank-lines", blank_lines(init)),
            Mutation("decorator", decorator([init])),
            Mutation("module-level-namesakes", insert_at(lambda t: _path(t, cls), _block(MODULE_LEVEL_NAMESAKES))),
            Mutation("other-method", insert_at(init, _block(OTHER_METHOD))),
            Mutation("marker-strings", marker_strings(spec)),
            # breaking: which statement is the anchor is never guessed
            # another class's __init__: v1's guard goes first in "the" __init__ (ambiguous now), v2's
            # anchors are statements only the worker's __init__ holds
            Mutation(
                "other-class-with-init",
                insert_at(lambda t: _path(t, cls), _block(OTHER_CLASS_WITH_INIT)),
                breaking=path == DTENSOR,
            ),
            Mutation("anchor-twice", insert_at(anchor_stmt, _block(f"{anchor}\n    pass\n")), breaking=True),
        ]

    return mutations


def _dtensor_correct(path: str) -> Callable[[str, str, str], None]:
    cls, anchor, where = _WORKERS[path]

    def correct(before: str, after: str, args: str) -> None:
        init = _path(ast.parse(after), cls, "__init__")
        body = init.body[1:] if ast.get_docstring(init) is not None else init.body
        texts = [ast.unparse(s) for s in body]
        guards = [i for i, s in enumerate(texts) if s.startswith("_fp32patch_check_config(config, ")]
        wires = [i for i, s in enumerate(texts) if s.startswith("self.model = _fp32patch_wire_dtensor(self.model, ")]
        (anchor_at,) = [i for i, s in enumerate(texts) if s.startswith(anchor)]
        assert len(guards) == 1 and len(wires) == 1, texts
        if path == DTENSOR:
            assert guards == [0]  # first thing in __init__
        else:
            assert texts[guards[0] + 1].startswith("runtime_config = validate_and_prepare_config(")
        assert wires[0] == (anchor_at + 1 if where == "after" else anchor_at - 1)
        stripper = _StripSetup()
        stripped = stripper.visit(ast.parse(after))
        helpers = [
            n for n in ast.parse(after).body if isinstance(n, ast.FunctionDef) and n.name.startswith("_fp32patch_")
        ]
        assert len(stripper.removed) == 2 + len(helpers)
        assert ast.dump(stripped) == ast.dump(ast.parse(before)), "the edit changed more than it should"

    return correct


# ---------------------------------------------------------------- verl-fp32-lm-head on verl's FSDP engine and vLLM server

VERL = "0.9.1"
VERL_FSDP = "verl/workers/engine/fsdp/transformer_impl.py"
VERL_SERVER = "verl/workers/rollout/vllm_rollout/vllm_async_server.py"
WRAP = "module = self._build_fsdp_module(module)"
VISIBLE = "os.environ[get_visible_devices_keyword()] = cuda_visible_devices"
MONKEY_PATCH = "await engine_client.collective_rpc(method='monkey_patch_model', "


def _release_files(spec_id: str, version: str) -> dict[str, str]:
    """The files the spec names, as its distribution's wheel of ``version`` holds them (those it holds)."""
    spec = _spec(spec_id)
    paths = [p for _, p in spec.target.files]
    src = wheel_members(spec.target.distribution, version, paths)
    return {p: (src / p).read_text() for p in paths if (src / p).exists()}


def _verl_files() -> dict[str, str]:
    """verl 0.9.1's files that the spec names, as its wheel holds them (the legacy workers are gone)."""
    return _release_files("verl-fp32-lm-head", VERL)


def _first_def(tree: ast.Module) -> ast.AST:
    return next(n for n in tree.body if isinstance(n, (ast.ClassDef, *FUNCS)))


def _on_line(find: Find, old: str, new: str) -> Callable[[str, int], str]:
    """``old`` replaced by ``new`` once, on the first line of the node ``find`` returns that holds it."""

    def mutate(text: str, seed: int) -> str:
        node = find(ast.parse(text))
        lines = _lines(text)
        i = next(i for i in range(node.lineno - 1, node.end_lineno) if old in lines[i])  # type: ignore[attr-defined]
        lines[i] = lines[i].replace(old, new, 1)
        return "".join(lines)

    return mutate


def _stmt_in(func: Find, start: str) -> Find:
    """The statement in ``func`` whose source (as ast.unparse writes it) starts with ``start``."""
    return lambda tree: next(s for s in _statements(func(tree)) if ast.unparse(s).startswith(start))


def _shared_benign(spec: Spec, funcs: list[Find], region: Find) -> list[Mutation]:
    """What the verl and TRL files take and must still be patched through: layout, comments, imports, marker text
    (``funcs``: the functions around the anchors; ``region``: the class or def whose lines take end-of-line comments)."""
    marker = f"# fp32patch: {spec.id} [{spec.edit_ids[-1]}]"
    return [
        Mutation("reformat-signature", reformat_signature(funcs)),
        Mutation("comment-line", comment_line(funcs[0])),
        Mutation("comment-line-2", comment_line(funcs[-1])),
        Mutation(
            "end-of-line-comment",
            end_of_line_comment(region, f"# fp32patch: {spec.id} [{spec.edit_ids[0]}]"),
        ),
        Mutation("blank-lines", blank_lines(funcs[-1])),
        Mutation("decorator", decorator(funcs)),
        Mutation("docstring", docstring(funcs, marker)),
        Mutation("marker-strings", marker_strings(spec)),
        # the gate goes after the last import before the first def or class, wherever that is
        Mutation("grow-imports", _grow_imports_before(_first_def)),  # type: ignore[arg-type]
        Mutation("late-import", insert_at(_first_def, lambda ind, seed: "import json as _json_late\n\n\n")),
        Mutation("import-after-defs", append("import json as _json_after\n")),
    ]


FSDP_OVERRIDE = f"""\
def _build_model_optimizer(self):
    module = self._build_module()
    {WRAP}
    self.module = module

"""

FSDP_OTHER_METHOD = f"""\
def _rewrap(self, module):
    {WRAP}
    return module

"""

FSDP_NESTED_WRAP = f"""\
def _rewrap(module):
    {WRAP}
    return module
"""


def _fsdp_build(tree: ast.Module) -> ast.AST:
    return _path(tree, "FSDPEngine", "_build_model_optimizer")


def _fsdp_mutations(spec: Spec) -> list[Mutation]:
    wrap = _stmt_in(_fsdp_build, WRAP)
    override_in_class = "".join("    " + line if line.strip() else line for line in _lines(FSDP_OVERRIDE))
    return [
        *_shared_benign(
            spec,
            [lambda t: _path(t, "FSDPEngine", "_build_fsdp_module"), _fsdp_build],
            lambda t: _path(t, "FSDPEngine"),
        ),
        # decoys: the wrap statement where the spec does not look
        Mutation(
            "subclass-override",
            insert_at(lambda t: _path(t, "FSDPEngineWithLMHead"), _block(FSDP_OVERRIDE), where="body"),
        ),
        Mutation("other-method", insert_at(_fsdp_build, _block(FSDP_OTHER_METHOD))),
        Mutation("module-level-namesake", append(FSDP_OVERRIDE)),
        Mutation("decoy-class", append(f"class FSDPEngine2(FSDPEngine):\n{override_in_class}")),
        # breaking: each must be refused
        Mutation("wrap-twice", insert_at(wrap, _block(WRAP)), breaking=True),
        Mutation("wrap-in-nested-def", insert_at(wrap, _block(FSDP_NESTED_WRAP)), breaking=True),
        Mutation("wrap-changed", _on_line(wrap, "(module)", "(module, self.device_mesh)"), breaking=True),
        Mutation(
            "method-renamed",
            _on_line(_fsdp_build, "def _build_model_optimizer", "def _build_model_and_optimizer"),
            breaking=True,
        ),
        # the inserted code tells the critic by its class: without that class, an undefined name
        Mutation(
            "value-head-class-renamed",
            _on_line(lambda t: _path(t, "FSDPEngineWithValueHead"), "FSDPEngineWithValueHead", "FSDPValueEngine"),
            breaking=True,
        ),
        Mutation(
            "duplicate-class",
            append(
                "if TYPE_CHECKING:\n\n    class FSDPEngine:\n        def _build_model_optimizer(self):\n"
                f"            {WRAP}\n"
            ),
            breaking=True,
        ),
        Mutation("gate-name-clash", append("_fp32patch_wire_hf = None\n"), breaking=True),
    ]


SERVER_DECOY = f"""\
class vLLMHttpServerDecoy:
    def __init__(self, config, model_config, cuda_visible_devices):
        {VISIBLE}

    async def run_server(self, args):
        engine_client = None
        await engine_client.collective_rpc(method="monkey_patch_model", kwargs={{"vocab_size": 1}})


"""

SERVER_NESTED_PATCH = """\
async def _again():
    await engine_client.collective_rpc(method="monkey_patch_model", kwargs={})
"""


def _server_init(tree: ast.Module) -> ast.AST:
    return _path(tree, "vLLMHttpServer", "__init__")


def _server_run(tree: ast.Module) -> ast.AST:
    return _path(tree, "vLLMHttpServer", "run_server")


def _server_mutations(spec: Spec) -> list[Mutation]:
    visible = _stmt_in(_server_init, VISIBLE)
    patch_call = _stmt_in(_server_run, MONKEY_PATCH)
    return [
        *_shared_benign(spec, [_server_init, _server_run], lambda t: _path(t, "vLLMHttpServer")),
        # decoys: the anchors where the spec does not look
        Mutation("decoy-class", insert_at(lambda t: _path(t, "vLLMHttpServer"), _block(SERVER_DECOY))),
        Mutation(
            "module-level-namesakes",
            append(
                f"def __init__(model_config, cuda_visible_devices):\n    {VISIBLE}\n\n\n"
                "async def run_server(engine_client):\n"
                '    await engine_client.collective_rpc(method="monkey_patch_model", kwargs={})\n'
            ),
        ),
        Mutation(
            "other-rpc",
            insert_at(patch_call, _block('await engine_client.collective_rpc(method="report_device_id", kwargs={})')),
        ),
        # breaking: each must be refused
        Mutation("visible-devices-twice", insert_at(visible, _block(VISIBLE)), breaking=True),
        Mutation("visible-devices-changed", _on_line(visible, "= cuda_visible_devices", "= str(gpus)"), breaking=True),
        Mutation("monkey-patch-in-nested-def", insert_at(patch_call, _block(SERVER_NESTED_PATCH)), breaking=True),
        Mutation("monkey-patch-renamed", _on_line(patch_call, '"monkey_patch_model"', '"patch_model"'), breaking=True),
        # the variable's call reads __init__'s model_config: renamed in the signature, an undefined name
        Mutation("model-config-renamed", _on_line(_server_init, "model_config,", "model_cfg,"), breaking=True),
        Mutation("run-server-renamed", _on_line(_server_run, "def run_server", "def serve"), breaking=True),
        Mutation(
            "class-renamed",
            _on_line(lambda t: _path(t, "vLLMHttpServer"), "class vLLMHttpServer", "class vLLMServer"),
            breaking=True,
        ),
        Mutation("gate-name-clash", append("def _fp32patch_vllm_env(*args):\n    pass\n"), breaking=True),
    ]


# an anchored edit to check: the path of the scope it is in, the start of its anchor statement, the edit's id
Anchored = tuple[tuple[str, ...], str, str]


def _expr(code: str) -> ast.expr:
    return ast.parse(code.strip(), mode="eval").body


class _PutBack(ast.NodeTransformer):
    """Puts back what each expression ``replace`` wrote (its code) as what it replaced (its match), counting them."""

    def __init__(self, pairs: dict[str, str]) -> None:
        self.pairs = {ast.dump(_expr(code)): _expr(match) for code, match in pairs.items()}
        self.kinds = tuple({type(_expr(code)) for code in pairs})
        self.count = 0

    def visit(self, node: ast.AST) -> ast.AST:
        if isinstance(node, self.kinds) and ast.dump(node) in self.pairs:
            self.count += 1
            return self.pairs[ast.dump(node)]
        return super().visit(node)


def _anchored_correct(
    spec_id: str, path: str, edits: list[Anchored], replaced: tuple[tuple[tuple[str, ...], str], ...] = ()
) -> Callable[[str, str, str], None]:
    """The variant's (``args``) edits of the file ``path``, every one of them checked: each of ``edits``
    right after its anchor statement (insert_after) or right before it (insert_before), each expression
    ``replaced`` (the path of its scope, the edit's id) rewritten as many times as its count, in its scope, the gate whole right
    after the imports, and nothing else changed: the AST, once the edits are taken out or put back, is the input's."""

    def correct(before: str, after: str, args: str) -> None:
        spec = _spec(spec_id)
        variant = next(v for v in spec.variants if v.name == args)
        own = {e.id: e for e in variant.edits if spec.target.path_of(e.file) == path}
        (gate_edit,) = [e for e in own.values() if e.op == "insert_after_imports"]
        checked = {gate_edit.id, *(i for _, _, i in edits), *(i for _, i in replaced)}
        assert set(own) == checked, f"edits of {path} the checker does not know: {sorted(set(own) - checked)}"
        tree = ast.parse(after)
        for scope, anchor, edit_id in edits:
            step = {"insert_after": 1, "insert_before": -1}[own[edit_id].op]
            _follows(_path(tree, *scope), anchor, ast.unparse(ast.parse(own[edit_id].code).body[0]), step=step)
        for scope, edit_id in replaced:
            wrote = _expr(own[edit_id].code)

            def written(node: ast.AST, wrote: ast.expr = wrote) -> int:
                return sum(isinstance(n, type(wrote)) and ast.dump(n) == ast.dump(wrote) for n in ast.walk(node))

            assert written(_path(tree, *scope)) == written(tree) == own[edit_id].count, edit_id
        # the gate: the snippet whole, after the last import that comes before the first def or class
        gate = ast.parse(gate_edit.code).body
        original = ast.parse(before)
        first = original.body.index(_first_def(original))
        at = 1 + max(i for i, n in enumerate(original.body[:first]) if isinstance(n, (ast.Import, ast.ImportFrom)))
        assert [ast.dump(n) for n in tree.body[at : at + len(gate)]] == [ast.dump(n) for n in gate]
        put_back = _PutBack({own[i].code: own[i].anchor.match for _, i in replaced})
        stripper = _StripSetup()
        stripped = stripper.visit(put_back.visit(ast.parse(after)))
        assert put_back.count == sum(own[i].count for _, i in replaced)
        assert len(stripper.removed) == len(gate) + len(edits), stripper.removed
        assert ast.dump(stripped) == ast.dump(ast.parse(before)), "the edit changed more than it should"

    return correct


_fsdp_correct = _anchored_correct(
    "verl-fp32-lm-head", VERL_FSDP, [(("FSDPEngine", "_build_model_optimizer"), WRAP, "wire-fsdp")]
)
_server_correct = _anchored_correct(
    "verl-fp32-lm-head",
    VERL_SERVER,
    [
        (("vLLMHttpServer", "__init__"), VISIBLE, "vllm-env"),
        (("vLLMHttpServer", "run_server"), MONKEY_PATCH, "probe-server"),
    ],
)


# ---------------------------------------------------------------- trl-fp32-lm-head on TRL's vLLM generation and fused LM head

TRL = "1.16.0"
TRL_GENERATION = "trl/generation/vllm_generation.py"
TRL_UTILS = "trl/trainer/utils.py"
QUANTIZATION = "quantization = None"
BUILD_LLM = "self.llm = LLM("
CLIENT = "self.vllm_client = VLLMClient("
KERNEL = "per_token = _ChunkedLogProbFunction.apply("
# the scopes a breaking mutation renames, with their new names: a benign mutation after it still finds them
TRL_RENAMED = {
    "VLLMGeneration": "VLLMGenerator",
    "_init_vllm": "_init_engine",
    "add_fused_lm_head": "add_chunked_lm_head",
    "_fused_forward": "_chunked_forward",
}


def _trl_files() -> dict[str, str]:
    """TRL 1.16.0's files that the spec names, as its wheel holds them."""
    return _release_files("trl-fp32-lm-head", TRL)


def _trl_scope(*names: str) -> Find:
    """The class or def at the path ``names``, each found by its name or the one TRL_RENAMED gives it."""

    def find(tree: ast.AST) -> ast.AST:
        for name in names:
            tree = next(
                n
                for n in tree.body  # type: ignore[attr-defined]
                if isinstance(n, (ast.ClassDef, *FUNCS)) and n.name in (name, TRL_RENAMED.get(name))
            )
        return tree

    return find


def _rename(find: Find, pattern: str, new: str) -> Callable[[str, int], str]:
    """Every match of the regular expression ``pattern`` in the lines of the node ``find`` returns becomes ``new``."""

    def mutate(text: str, seed: int) -> str:
        node = find(ast.parse(text))
        lines = _lines(text)
        start, end = node.lineno - 1, node.end_lineno  # type: ignore[attr-defined]
        return "".join([*lines[:start], re.sub(pattern, new, "".join(lines[start:end])), *lines[end:]])

    return mutate


def _indented(code: str, by: str) -> str:
    return "".join(by + line if line.strip() else line for line in _lines(code))


_generation = _trl_scope("VLLMGeneration")
_init_vllm = _trl_scope("VLLMGeneration", "_init_vllm")

# the three anchors of _init_vllm, in code the spec must not look at
INIT_VLLM_ANCHORS = """\
def _init_vllm(self):
    model = self.model
    if self.mode == "server":
        self.vllm_client = VLLMClient(base_url=self.server_base_url)
    quantization = None
    self.llm = LLM(model=model.name_or_path, quantization=quantization)

"""


def _generation_mutations(spec: Spec) -> list[Mutation]:
    llm, client, quantization = (_stmt_in(_init_vllm, s) for s in (BUILD_LLM, CLIENT, QUANTIZATION))
    other = INIT_VLLM_ANCHORS.replace("def _init_vllm", "def _reinit_vllm")
    return [
        *_shared_benign(spec, [_trl_scope("VLLMGeneration", "__init__"), _init_vllm], _generation),
        # decoys: the anchors where the spec does not look
        Mutation(
            "decoy-class",
            insert_at(_generation, _block("class VLLMGenerationDecoy:\n" + _indented(INIT_VLLM_ANCHORS, "    "))),
        ),
        Mutation(
            "subclass-override",
            append("class AsyncVLLMGeneration(VLLMGeneration):\n" + _indented(INIT_VLLM_ANCHORS, "    ")),
        ),
        Mutation("other-method", insert_at(_init_vllm, _block(other))),
        Mutation("module-level-namesake", append(INIT_VLLM_ANCHORS)),
        Mutation(
            "anchors-in-a-string",
            insert_at(
                _init_vllm,
                _block(
                    'logger.debug("quantization = None, then self.llm = LLM(...) or self.vllm_client = VLLMClient(...)")'
                ),
                where="body",
            ),
        ),
        # breaking: each must be refused
        Mutation("llm-twice", insert_at(llm, _block("self.llm = LLM(model=model.name_or_path)")), breaking=True),
        Mutation(
            "llm-in-nested-def",
            insert_at(llm, _block("def _rebuild():\n    self.llm = LLM(model=model.name_or_path)\n")),
            breaking=True,
        ),
        Mutation("llm-changed", _on_line(llm, "= LLM(", "= self._build_llm("), breaking=True),
        # a second `quantization = None`, in the server branch: which one does vLLM's switch go before?
        Mutation("quantization-twice", insert_at(client, _block(QUANTIZATION)), breaking=True),
        Mutation(
            "quantization-changed",
            _on_line(quantization, QUANTIZATION, "quantization = self.quantization"),
            breaking=True,
        ),
        Mutation(
            "client-twice",
            insert_at(llm, _block("self.vllm_client = VLLMClient(base_url=self.server_base_url)")),
            breaking=True,
        ),
        Mutation("client-changed", _on_line(client, "VLLMClient(", "VLLMClient.connect("), breaking=True),
        Mutation("method-renamed", _rename(_generation, r"\b_init_vllm\b", "_init_engine"), breaking=True),
        Mutation("class-renamed", _on_line(_generation, "class VLLMGeneration", "class VLLMGenerator"), breaking=True),
        # the inserted calls read _init_vllm's local `model`: renamed there (keywords `model=` kept), an undefined name
        Mutation("model-renamed", _rename(_init_vllm, r"(?<![\w.])model(?![\w=])", "policy"), breaking=True),
        Mutation(
            "duplicate-class",
            append("if TYPE_CHECKING:\n\n    class VLLMGeneration:\n" + _indented(INIT_VLLM_ANCHORS, "        ")),
            breaking=True,
        ),
        Mutation("gate-name-clash", append("def _fp32patch_probe_colocated(llm, model):\n    pass\n"), breaking=True),
        # an anchor moved (not copied) into a def nested in the scope: an edit there would never run
        Mutation("quantization-moved-into-nested-def", moved_into_nested(quantization, "_unused"), breaking=True),
        Mutation("llm-moved-into-nested-def", moved_into_nested(llm, "_build"), breaking=True),
    ]


_fused_outer = _trl_scope("add_fused_lm_head")
_fused_forward = _trl_scope("add_fused_lm_head", "_fused_forward")

FUSED_NAMESAKE = """\
def _fused_forward(self, hidden_states, weight, labels):
    return _ChunkedLogProbFunction.apply(hidden_states, weight, None, labels)

"""


def _fused_mutations(spec: Spec) -> list[Mutation]:
    kernel = _stmt_in(_fused_forward, KERNEL)
    return [
        *_shared_benign(spec, [_fused_outer, _fused_forward], _fused_outer),
        # decoys: the kernel where the spec does not look (its scope is the nested _fused_forward only)
        Mutation(
            "kernel-in-outer-function",
            insert_at(_fused_outer, _block("_stock_kernel = _ChunkedLogProbFunction.apply"), where="body"),
        ),
        Mutation(
            "sibling-nested-def",
            insert_at(_fused_forward, _block(FUSED_NAMESAKE.replace("_fused_forward", "_fused_eval"))),
        ),
        Mutation(
            "other-function",
            insert_at(
                _fused_outer, _block(FUSED_NAMESAKE.replace("def _fused_forward", "def chunked_log_probs") + "\n")
            ),
        ),
        Mutation("module-level-namesake", append(FUSED_NAMESAKE)),
        Mutation(
            "decoy-outer-function",
            append(
                "def add_fused_value_head(model):\n" + _indented(FUSED_NAMESAKE, "    ") + "    return _fused_forward\n"
            ),
        ),
        # breaking: each must be refused
        Mutation(
            "kernel-twice",
            insert_at(
                kernel, _block("ref_per_token = _ChunkedLogProbFunction.apply(hidden_states, weight, bias, labels)")
            ),
            breaking=True,
        ),
        Mutation(
            "kernel-in-nested-def",
            insert_at(
                kernel,
                _block(
                    "def _reference(hidden_states):\n    return _ChunkedLogProbFunction.apply(hidden_states, weight)\n"
                ),
            ),
            breaking=True,
        ),
        Mutation(
            "kernel-changed", _on_line(kernel, "_ChunkedLogProbFunction.apply(", "chunked_log_probs("), breaking=True
        ),
        Mutation("nested-def-renamed", _rename(_fused_outer, r"\b_fused_forward\b", "_chunked_forward"), breaking=True),
        Mutation(
            "function-renamed",
            _on_line(_fused_outer, "def add_fused_lm_head", "def add_chunked_lm_head"),
            breaking=True,
        ),
        # the replacement reads _fused_forward's `self`: renamed there, an undefined name
        Mutation("self-renamed", _rename(_fused_forward, r"(?<![\w.])self\b", "module"), breaking=True),
        # a second definition (a fallback without Triton, say): which one runs?
        Mutation(
            "duplicate-function",
            append(
                "if not is_triton_available():\n\n"
                + _indented("def add_fused_lm_head(model):\n" + _indented(FUSED_NAMESAKE, "    "), "    ")
            ),
            breaking=True,
        ),
        Mutation("gate-name-clash", append("_fp32patch_fused_kernel = None\n"), breaking=True),
        Mutation("kernel-moved-into-nested-def", moved_into_nested(kernel, "_later"), breaking=True),
    ]


_generation_correct = _anchored_correct(
    "trl-fp32-lm-head",
    TRL_GENERATION,
    [
        (("VLLMGeneration", "_init_vllm"), QUANTIZATION, "vllm-env"),
        (("VLLMGeneration", "_init_vllm"), BUILD_LLM, "probe-colocated"),
        (("VLLMGeneration", "_init_vllm"), CLIENT, "probe-server"),
    ],
)
_fused_correct = _anchored_correct(
    "trl-fp32-lm-head", TRL_UTILS, [], replaced=((("add_fused_lm_head", "_fused_forward"), "fused-kernel"),)
)


# ---------------------------------------------------------------- sglang-fp32-lm-head on SGLang's logits processor

SGL_PROCESSOR = "sglang/srt/layers/logits_processor.py"
SGL_VERSION = "0.5.15.post1"  # slime's pin
SGL_GEMM = "torch.matmul(hidden_states.to(torch.float32), lm_head.weight.to(torch.float32).T)"
SGL_OURS = "_fp32patch_sglang_fp32_logits(hidden_states, lm_head.weight)"
SGL_GATE = "_fp32patch_sglang_fp32_logits"


def _sgl_head(tree: ast.Module) -> ast.AST:
    return _child(_lp_class(tree), "_compute_lm_head", FUNCS)


def _sgl_branch(tree: ast.Module) -> ast.stmt:
    """The flag's GEMM statement (``logits = ...``) in ``_compute_lm_head``."""
    return next(n for n in ast.walk(_sgl_head(tree)) if isinstance(n, ast.Assign) and ast.unparse(n.value) == SGL_GEMM)


class _UnpatchSglang(ast.NodeTransformer):
    def visit_Module(self, node: ast.Module) -> ast.Module:
        node.body = [s for s in node.body if not (isinstance(s, FUNCS) and s.name == SGL_GATE)]
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        return ast.parse(SGL_GEMM, mode="eval").body if ast.unparse(node) == SGL_OURS else self.generic_visit(node)


def _sglang_correct(before: str, after: str, args: str) -> None:
    assert ast.dump(_UnpatchSglang().visit(ast.parse(after))) == ast.dump(ast.parse(before)), "more than the GEMM"
    head = ast.unparse(_sgl_head(ast.parse(after)))
    assert head.count(SGL_OURS) == 1 and SGL_GEMM not in head


def _sgl_gemm_changed(text: str, seed: int) -> str:
    """The flag's branch computes another expression (a release that changed it): no anchor."""
    return re.sub(r"lm_head\.weight\.to\(torch\.float32\)\.T", "lm_head.weight.float().T", text, count=1)


def _sglang_mutations(spec: Spec) -> list[Mutation]:
    funcs = [_sgl_head]
    decoy = f"    def _compute_lm_head(self, hidden_states, lm_head, embedding_bias=None):\n        return {SGL_GEMM}\n"
    return [
        Mutation("reformat-signature", reformat_signature(funcs)),
        Mutation("comment-line", comment_line(_lp_class)),
        Mutation("end-of-line-comment", end_of_line_comment(_sgl_head, f"# fp32patch: {spec.id} [fp32out-head]")),
        Mutation("blank-lines", blank_lines(_sgl_head)),
        Mutation("decorator", decorator(funcs)),
        Mutation("docstring", docstring(funcs, f"# fp32patch: {spec.id} [fp32out-head]")),
        Mutation("decoy-class", append(f"class LogitsProcessorForDraft(object):\n{decoy}")),
        Mutation("module-namesakes", append(f"def _compute_lm_head(hidden_states, lm_head):\n    return {SGL_GEMM}\n")),
        Mutation("marker-strings", marker_strings(spec)),
        Mutation("grow-imports", _grow_imports_before(_lp_class)),
        # breaking: each must be refused
        Mutation(
            "duplicate-class",
            append(f"if TYPE_CHECKING:\n\n    class {LP_CLASS}:\n" + _indented(decoy, "    ")),
            breaking=True,
        ),
        Mutation("gate-name-clash", append(f"{SGL_GATE} = None\n"), breaking=True),
        Mutation("head-gemm-twice", insert_at(_sgl_branch, _block(f"logits = {SGL_GEMM}")), breaking=True),
        Mutation("head-gemm-changed", _sgl_gemm_changed, breaking=True),
        Mutation("head-gemm-moved-into-nested-def", moved_into_nested(_sgl_branch, "_later"), breaking=True),
    ]


# ---------------------------------------------------------------- openrlhf-fp32-lm-head on OpenRLHF's Actor.forward

OPENRLHF = "0.11.2"
OPENRLHF_ACTOR = "openrlhf/models/actor.py"
ACTOR_FORWARD_NAMESAKE = """\
def forward(self, sequences, attention_mask=None):
    output = self.model(sequences, attention_mask=attention_mask)
    entropy = compute_entropy(output["logits"])
    return log_probs_from_logits(output["logits"], sequences), entropy

"""


def _openrlhf_files() -> dict[str, str]:
    """OpenRLHF 0.11.2's files that the spec names, as its wheel holds them (laid out as installed)."""
    return _release_files("openrlhf-fp32-lm-head", OPENRLHF)


def _actor_forward(tree: ast.Module) -> ast.AST:
    return _path(tree, "Actor", "forward")


def _actor_mutations(spec: Spec) -> list[Mutation]:
    call = _stmt_in(_actor_forward, "output = self.model(")
    log_probs = _stmt_in(_actor_forward, "log_probs = log_probs_from_logits(")
    return [
        *_shared_benign(spec, [lambda t: _path(t, "Actor", "__init__"), _actor_forward], lambda t: _path(t, "Actor")),
        # decoys: the anchors where the spec does not look
        Mutation("module-level-namesake", append(ACTOR_FORWARD_NAMESAKE)),
        Mutation("decoy-class", append("class CriticActor(nn.Module):\n" + _indented(ACTOR_FORWARD_NAMESAKE, "    "))),
        Mutation(
            "other-method",
            insert_at(_actor_forward, _block(ACTOR_FORWARD_NAMESAKE.replace("def forward", "def forward_value"))),
        ),
        # breaking: each must be refused
        Mutation("model-called-twice", insert_at(call, _block("_warm = self.model(sequences)")), breaking=True),
        Mutation(
            "log-probs-twice",
            insert_at(log_probs, _block("_again = log_probs_from_logits(output['logits'], rolled_sequences)")),
            breaking=True,
        ),
        Mutation("entropy-renamed", _rename(_actor_forward, r"\bcompute_entropy\b", "entropy_of"), breaking=True),
        # the replacement reads forward's rolled_sequences and return_entropy: renamed there, undefined names
        Mutation("rolled-renamed", _rename(_actor_forward, r"\brolled_sequences\b", "shifted"), breaking=True),
        Mutation("entropy-flag-renamed", _rename(_actor_forward, r"\breturn_entropy\b", "with_entropy"), breaking=True),
        Mutation("forward-renamed", _on_line(_actor_forward, "def forward", "def forward_logprobs"), breaking=True),
        Mutation(
            "class-renamed", _on_line(lambda t: _path(t, "Actor"), "class Actor", "class PolicyActor"), breaking=True
        ),
        Mutation("gate-name-clash", append("_fp32patch_model = None\n"), breaking=True),
    ]


_actor_correct = _anchored_correct(
    "openrlhf-fp32-lm-head",
    OPENRLHF_ACTOR,
    [],
    replaced=tuple((("Actor", "forward"), edit) for edit in ("model-call", "log-probs", "entropy")),
)


# ---------------------------------------------------------------- skyrl-fp32-lm-head on SkyRL's HFModelWrapper.forward

SKYRL = "0.4.0"
SKYRL_WRAPPER = "skyrl/backends/skyrl_train/workers/model_wrapper.py"
WRAPPER_FORWARD_NAMESAKE = """\
def forward(self, sequences, temperature=1.0):
    output = self.model(sequences)
    return logprobs_from_logits(output["logits"], sequences), self.chunked_entropy_from_logits_fn(output["logits"])

"""


def _skyrl_files() -> dict[str, str]:
    """SkyRL 0.4.0's files that the spec names, as its wheel holds them (laid out as installed)."""
    return _release_files("skyrl-fp32-lm-head", SKYRL)


def _wrapper_forward(tree: ast.Module) -> ast.AST:
    return _path(tree, "HFModelWrapper", "forward")


def _wrapper_mutations(spec: Spec) -> list[Mutation]:
    call = _stmt_in(_wrapper_forward, "output = self.model(sequences_fwd, attention_mask=attention_mask_fwd")
    return [
        *_shared_benign(
            spec,
            [lambda t: _path(t, "HFModelWrapper", "__init__"), _wrapper_forward],
            lambda t: _path(t, "HFModelWrapper"),
        ),
        Mutation("module-level-namesake", append(WRAPPER_FORWARD_NAMESAKE)),
        Mutation(
            "decoy-class", append("class CriticWrapper(nn.Module):\n" + _indented(WRAPPER_FORWARD_NAMESAKE, "    "))
        ),
        # breaking: each must be refused
        Mutation("model-called-once-more", insert_at(call, _block("_warm = self.model(sequences_fwd)")), breaking=True),
        Mutation(
            "entropy-renamed",
            _rename(_wrapper_forward, r"\bself\.chunked_entropy_from_logits_fn\b", "self.entropy_fn"),
            breaking=True,
        ),
        # the replacement reads forward's sequences_rolled and support_channels: renamed there, undefined names
        Mutation("rolled-renamed", _rename(_wrapper_forward, r"\bsequences_rolled\b", "shifted"), breaking=True),
        # (no scope renamed: the benign mutations drawn after a breaking one still find their functions)
        Mutation(
            "log-probs-renamed", _rename(_wrapper_forward, r"\blogprobs_from_logits\b", "logprobs_of"), breaking=True
        ),
        Mutation("gate-name-clash", append("_fp32patch_model = None\n"), breaking=True),
    ]


_wrapper_correct = _anchored_correct(
    "skyrl-fp32-lm-head",
    SKYRL_WRAPPER,
    [],
    replaced=tuple((("HFModelWrapper", "forward"), edit) for edit in ("model-call", "log-probs", "entropy")),
)


# ---------------------------------------------------------------- slime-fp32-lm-head on the stand-in slime checkout

SLIME_ENGINE = "slime/backends/sglang_utils/sglang_engine.py"
INIT_NORMAL = "self._init_normal(server_args_dict)"
INIT_EXTERNAL = "self._init_external("
SERVER_ARGS_RETURN = "return kwargs, external_engine_need_check_fields"


def _slime_checkout() -> dict[str, str]:
    """The stand-in slime checkout's target files (tests/fixtures/slime_src: slime's shapes, not its code)."""
    from tests.fixtures.slime_shapes import PATCHED, SRC

    return {p: (SRC / p).read_text() for p in PATCHED}


def _engine_init(tree: ast.Module) -> ast.AST:
    return _path(tree, "SGLangEngine", "init")


def _compute_server_args(tree: ast.Module) -> ast.AST:
    return _path(tree, "_compute_server_args")


def _slime_engine_mutations(spec: Spec) -> list[Mutation]:
    normal = _stmt_in(_engine_init, INIT_NORMAL)
    returned = _stmt_in(_compute_server_args, "return (kwargs, external_engine_need_check_fields)")
    return [
        *_shared_benign(spec, [_engine_init, _compute_server_args], lambda t: _path(t, "SGLangEngine")),
        # decoys: the anchors where the spec does not look
        Mutation(
            "module-level-namesakes",
            append(
                f"def init(self, server_args_dict):\n    {INIT_NORMAL}\n\n\n"
                f"def _compute_router_args(kwargs, external_engine_need_check_fields):\n    {SERVER_ARGS_RETURN}\n"
            ),
        ),
        Mutation("other-return", insert_at(returned, _block("if not kwargs:\n    return ({}, [])"))),
        # breaking: each must be refused
        Mutation("init-normal-twice", insert_at(normal, _block(INIT_NORMAL)), breaking=True),
        Mutation("init-normal-moved-into-nested-def", moved_into_nested(normal, "_later"), breaking=True),
        Mutation("return-changed", _on_line(returned, "return kwargs,", "return dict(kwargs),"), breaking=True),
        Mutation("init-renamed", _on_line(_engine_init, "def init(", "def start("), breaking=True),
        Mutation("gate-name-clash", append("def _fp32patch_probe_engine(*args):\n    pass\n"), breaking=True),
    ]


_slime_engine_correct = _anchored_correct(
    "slime-fp32-lm-head",
    SLIME_ENGINE,
    [
        (("SGLangEngine", "init"), INIT_NORMAL, "probe"),
        (("SGLangEngine", "init"), INIT_EXTERNAL, "probe-external"),
        (("_compute_server_args",), "return (kwargs, external_engine_need_check_fields)", "server-args"),
    ],
)


# ---------------------------------------------------------------- prime-rl-fp32-lm-head on the stand-in Prime-RL checkout

PRIME_TRAIN = "src/prime_rl/trainer/rl/train.py"
SETUP_MODEL = "model = setup_model(config.model, parallel_dims, loading_from_ckpt_later)"


def _prime_rl_checkout() -> dict[str, str]:
    """The stand-in Prime-RL checkout's target files (tests/fixtures/prime_rl_src: its shapes, not its code)."""
    from tests.fixtures.prime_rl_shapes import PATCHED, SRC

    return {p: (SRC / p).read_text() for p in PATCHED}


def _prime_train(tree: ast.Module) -> ast.AST:
    return _path(tree, "train")


def _prime_rl_train_mutations(spec: Spec) -> list[Mutation]:
    setup = _stmt_in(_prime_train, SETUP_MODEL)
    return [
        *_shared_benign(spec, [_prime_train], _prime_train),
        # decoys: the anchor where the spec does not look
        Mutation(
            "module-level-namesake",
            append(
                f"def build(config, parallel_dims, loading_from_ckpt_later):\n    {SETUP_MODEL}\n    return model\n"
            ),
        ),
        # breaking: each must be refused
        Mutation("setup-twice", insert_at(setup, _block(SETUP_MODEL)), breaking=True),
        Mutation("setup-moved-into-nested-def", moved_into_nested(setup, "_later"), breaking=True),
        Mutation("setup-renamed", _on_line(setup, "setup_model(", "build_model("), breaking=True),
        Mutation("gate-name-clash", append("def _fp32patch_wire_trainer(*args):\n    pass\n"), breaking=True),
    ]


_prime_rl_train_correct = _anchored_correct("prime-rl-fp32-lm-head", PRIME_TRAIN, [(("train",), SETUP_MODEL, "wire")])


# ---------------------------------------------------------------- areal-fp32-lm-head on AReaL 1.0.4's rl_trainer.py

AREAL = "1.0.4"
AREAL_TRAINER = "areal/trainer/rl_trainer.py"
AREAL_SGLANG_ARGS = "server_args = SGLangConfig.build_args("
AREAL_VLLM_ARGS = "server_args = vLLMConfig.build_args("
AREAL_INITIALIZE = "controller.initialize(**init_kwargs)"


def _areal_files() -> dict[str, str]:
    """AReaL 1.0.4's files that the spec names, as its wheel holds them (laid out as installed)."""
    return _release_files("areal-fp32-lm-head", AREAL)


def _init_rollout(tree: ast.Module) -> ast.AST:
    return _path(tree, "PPOTrainer", "_init_rollout")


def _areal_mutations(spec: Spec) -> list[Mutation]:
    initialize = _stmt_in(_init_rollout, AREAL_INITIALIZE)
    return [
        *_shared_benign(spec, [_init_rollout], lambda t: _path(t, "PPOTrainer")),
        # decoys: the anchors where the spec does not look (the teacher's rollout has the same calls)
        Mutation(
            "module-level-namesake",
            append("def _init_rollout(self, config):\n    controller.initialize(**init_kwargs)\n"),
        ),
        # breaking: each must be refused
        Mutation("initialize-twice", insert_at(initialize, _block(AREAL_INITIALIZE)), breaking=True),
        Mutation(
            "init-rollout-renamed", _on_line(_init_rollout, "def _init_rollout", "def _start_rollout"), breaking=True
        ),
        # the probe reads _init_rollout's rollout_backend: renamed there, an undefined name
        Mutation("backend-renamed", _rename(_init_rollout, r"\brollout_backend\b", "gen_backend"), breaking=True),
        Mutation("gate-name-clash", append("_fp32patch_probe_rollout = None\n"), breaking=True),
    ]


_areal_correct = _anchored_correct(
    "areal-fp32-lm-head",
    AREAL_TRAINER,
    [
        (("PPOTrainer", "_init_rollout"), AREAL_SGLANG_ARGS, "server-args-sglang"),
        (("PPOTrainer", "_init_rollout"), AREAL_VLLM_ARGS, "server-args-vllm"),
        (("PPOTrainer", "_init_rollout"), AREAL_INITIALIZE, "probe"),
    ],
)


# ---------------------------------------------------------------- the property


@dataclass(frozen=True)
class Case:
    spec_id: str
    label: str
    source: Callable[[], str]
    version: str | None
    path: str
    mutations: Callable[[Spec], list[Mutation]]
    correct: Callable[[str, str, str], None]
    args: str
    examples: int
    # a spec over several files: the others, unchanged (the mutated one is ``path``)
    others: Callable[[], dict[str, bytes]] | None = None


CASES = [
    Case(
        "nemotron-h-fp32-lm-head",
        "vllm-0.33.0",
        lambda: (wheel_members("vllm", "0.33.0", [NEMOTRON]) / NEMOTRON).read_text(),
        "0.33.0",
        NEMOTRON,
        _nemotron_mutations,
        _nemotron_correct,
        "hidden_states",
        40,
    ),
    Case(
        "nemotron-h-fp32-lm-head",
        "vllm-0.10.2",
        lambda: (wheel_members("vllm", "0.10.2", [NEMOTRON]) / NEMOTRON).read_text(),
        "0.10.2",
        NEMOTRON,
        _nemotron_mutations,
        _nemotron_correct,
        "hidden_states, sampling_metadata",
        30,
    ),
    *(
        Case(
            "vllm-fp32-logits",
            f"logits-processor-{version}",
            lambda version=version: (wheel_members("vllm", version, [LOGITS_PROCESSOR]) / LOGITS_PROCESSOR).read_text(),
            version,
            LOGITS_PROCESSOR,
            lambda spec, variant=variant: _logits_mutations(spec, variant),
            _logits_correct,
            variant,
            30,
        )
        for version, variant in (("0.33.0", "native-head-dtype"), ("0.25.1", "head-gemm"), ("0.10.2", "head-gemm"))
    ),
    Case(
        "nemo-rl-context-length-400",
        "nemo-rl-fixture",
        lambda: (Path(__file__).parent / "fixtures" / "nemo_rl" / "pre_fix.py").read_text(),
        None,
        "nemo_rl/models/generation/vllm/vllm_worker_async.py",
        _nemo_rl_mutations,
        _nemo_rl_correct,
        "",
        120,
    ),
    Case(
        "nemo-rl-fp32-lm-head",
        "nemo-rl-fixture-setup",
        lambda: _nemo_rl_checkout()[SETUP],
        None,
        SETUP,
        _setup_mutations,
        _setup_correct,
        "",
        25,
        others=lambda: {p: t.encode() for p, t in _nemo_rl_checkout().items() if p != SETUP},
    ),
    *(
        Case(
            "nemo-rl-fp32-lm-head",
            f"nemo-rl-fixture-{label}",
            lambda path=path: _nemo_rl_checkout()[path],
            None,
            path,
            _dtensor_mutations(path),
            _dtensor_correct(path),
            "",
            12,
            others=lambda path=path: {p: t.encode() for p, t in _nemo_rl_checkout().items() if p != path},
        )
        for label, path in (("dtensor", DTENSOR), ("dtensor-v2", DTENSOR_V2))
    ),
    *(
        Case(
            "verl-fp32-lm-head",
            f"verl-{VERL}-{label}",
            lambda path=path: _verl_files()[path],
            VERL,
            path,
            mutations,
            correct,
            "engine-workers",
            6,
            others=lambda path=path: {p: t.encode() for p, t in _verl_files().items() if p != path},
        )
        for label, path, mutations, correct in (
            ("fsdp-engine", VERL_FSDP, _fsdp_mutations, _fsdp_correct),
            ("vllm-server", VERL_SERVER, _server_mutations, _server_correct),
        )
    ),
    *(
        Case(
            "trl-fp32-lm-head",
            f"trl-{TRL}-{label}",
            lambda path=path: _trl_files()[path],
            TRL,
            path,
            mutations,
            correct,
            "chunked-logprobs",
            examples,
            others=lambda path=path: {p: t.encode() for p, t in _trl_files().items() if p != path},
        )
        for label, path, mutations, correct, examples in (
            ("vllm-generation", TRL_GENERATION, _generation_mutations, _generation_correct, 5),
            ("fused-lm-head", TRL_UTILS, _fused_mutations, _fused_correct, 5),
        )
    ),
    Case(
        "slime-fp32-lm-head",
        "slime-fixture-sglang-engine",
        lambda: _slime_checkout()[SLIME_ENGINE],
        None,
        SLIME_ENGINE,
        _slime_engine_mutations,
        _slime_engine_correct,
        "all",
        8,
        others=lambda: {p: t.encode() for p, t in _slime_checkout().items() if p != SLIME_ENGINE},
    ),
    Case(
        "prime-rl-fp32-lm-head",
        "prime-rl-fixture-train",
        lambda: _prime_rl_checkout()[PRIME_TRAIN],
        None,
        PRIME_TRAIN,
        _prime_rl_train_mutations,
        _prime_rl_train_correct,
        "all",
        5,
        others=lambda: {p: t.encode() for p, t in _prime_rl_checkout().items() if p != PRIME_TRAIN},
    ),
    Case(
        "areal-fp32-lm-head",
        f"areal-{AREAL}-trainer",
        lambda: _areal_files()[AREAL_TRAINER],
        AREAL,
        AREAL_TRAINER,
        _areal_mutations,
        _areal_correct,
        "1.0.4",
        # each example transforms all seven of AReaL's files (~7 s of libcst): few, beside its release tests
        5,
        others=lambda: {p: t.encode() for p, t in _areal_files().items() if p != AREAL_TRAINER},
    ),
    Case(
        "sglang-fp32-lm-head",
        f"sglang-{SGL_VERSION}",
        lambda: (wheel_members("sglang", SGL_VERSION, [SGL_PROCESSOR]) / SGL_PROCESSOR).read_text(),
        SGL_VERSION,
        SGL_PROCESSOR,
        _sglang_mutations,
        _sglang_correct,
        "",
        12,
    ),
    Case(
        "openrlhf-fp32-lm-head",
        f"openrlhf-{OPENRLHF}-actor",
        lambda: _openrlhf_files()[OPENRLHF_ACTOR],
        OPENRLHF,
        OPENRLHF_ACTOR,
        _actor_mutations,
        _actor_correct,
        "entropy-after-temperature",
        6,
        others=lambda: {p: t.encode() for p, t in _openrlhf_files().items() if p != OPENRLHF_ACTOR},
    ),
    Case(
        "skyrl-fp32-lm-head",
        f"skyrl-{SKYRL}-wrapper",
        lambda: _skyrl_files()[SKYRL_WRAPPER],
        SKYRL,
        SKYRL_WRAPPER,
        _wrapper_mutations,
        _wrapper_correct,
        "all",
        6,
        others=lambda: {p: t.encode() for p, t in _skyrl_files().items() if p != SKYRL_WRAPPER},
    ),
]


def _own_line_markers(text: str, spec_id: str) -> list[str]:
    """The spec's own-line markers in ``text``; an edit whose anchor has a count of N (SkyRL's
    four ``self.model`` reads) must carry exactly N of them, and is listed once."""
    found = [
        tok.string
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
        and not tok.line[: tok.start[1]].strip()
        and tok.string.startswith(f"# fp32patch: {spec_id} [")
    ]
    spec = _spec(spec_id)
    counted = {f"# fp32patch: {spec.id} [{e.id}]": e.count for v in spec.variants for e in v.edits if e.count > 1}
    for marker, count in counted.items():
        if marker in found:
            assert found.count(marker) == count, (marker, found.count(marker), count)
            found = [m for m in found if m != marker] + [marker]
    return found


def test_every_shipped_spec_has_a_case():
    assert {s.id for s in load_specs()} == {c.spec_id for c in CASES}


@pytest.mark.parametrize("case", CASES, ids=[c.label for c in CASES])
def test_every_result_is_a_correct_edit_or_a_refusal(case: Case):
    spec = _spec(case.spec_id)
    source = case.source()
    mutations = case.mutations(spec)
    outcomes: dict[str, int] = {}

    # a few benign mutations; a third of the lists (at least one) carry one breaking mutation among
    # them (two breaking ones can cancel out: a signature renamed next to a same-named stub leaves one
    # match). The two kinds are drawn apart, so the mix is the same for any seed: Hypothesis's draws
    # are far from uniform (one strategy mixing them gave 1 breaking list of 40 on some seeds)
    seeds = st.integers(0, 10_000)
    benign = st.tuples(st.sampled_from([m for m in mutations if not m.breaking]), seeds)
    breaking = st.tuples(st.sampled_from([m for m in mutations if m.breaking]), seeds)
    benign_lists = st.lists(benign, min_size=1, max_size=5)
    breaking_lists = st.builds(
        lambda before, bad, at: [*before[:at], bad, *before[at:]],
        st.lists(benign, min_size=1, max_size=4),
        breaking,
        st.integers(0, 4),
    )
    n_breaking = max(1, case.examples // 3)

    def check(chosen):
        text = source
        for i, (mutation, seed) in enumerate(chosen):
            try:
                text = mutation.apply(text, seed)
            except StopIteration:  # the region it edits is gone: a breaking mutation renamed it
                if not any(m.breaking for m, _ in chosen[:i]):
                    raise
        compile(text, "mutated", "exec", dont_inherit=True)  # the generator makes valid Python
        others = case.others() if case.others else None
        inputs = {**others, case.path: text.encode()} if others else text.encode()
        result = transform(spec, inputs, path=case.path, version=case.version)
        breaking = [m.name for m, _ in chosen if m.breaking]
        if breaking:
            assert result.status in ERRORS, (breaking, result.status, result.message)
            assert f"{spec.id}: cannot patch {spec.target.path if others else case.path}" in result.message
            assert result.new is None
        else:
            assert result.status == "applied", ([m.name for m, _ in chosen], result.message)
            after = (result.files[case.path] if others else result.new).decode()
            compile(after, "patched", "exec", dont_inherit=True)
            variant = next(v for v in spec.variants if v.name == result.variant)
            own = [e.id for e in variant.edits if spec.target.path_of(e.file) == case.path]
            assert sorted(_own_line_markers(after, spec.id)) == sorted(
                f"# fp32patch: {spec.id} [{e}]" for e in (own if others else spec.edit_ids)
            )
            case.correct(text, after, case.args)
            patched = {**inputs, **result.files} if others else result.new
            again = transform(spec, patched, path=case.path, version=case.version)
            assert again.status == "already-applied", again.message
        outcomes[result.status] = outcomes.get(result.status, 0) + 1

    for lists, examples in ((benign_lists, case.examples - n_breaking), (breaking_lists, n_breaking)):

        @settings(
            max_examples=examples,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        @given(lists)
        def generated(chosen):
            check(chosen)

        generated()
    assert sum(outcomes.values()) == case.examples
    assert outcomes.get("applied", 0) == case.examples - n_breaking, outcomes
    print(f"\n{case.label}: {case.examples} generated cases: {outcomes}")
