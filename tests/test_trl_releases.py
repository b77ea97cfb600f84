"""trl-fp32-lm-head on every supported TRL release, beside the vLLM patches on the vLLM that release accepts.

Each import root holds a TRL release's real target files and ``.dist-info`` (from its PyPI wheel)
together with ``nemotron_h.py`` and ``logits_processor.py`` of a vLLM release its ``vllm`` extra
allows (the newest, and for 1.16 also the oldest), as one image would: ``apply`` patches all
three, in the variant the release needs; ``verify`` is green; every edit sits where it belongs
and nothing else changed; re-applying changes nothing; ``revert`` restores every byte. With the
switch off, the gate each patched file carries hands back what it was given and never imports
fp32patch. Releases before 1.12 (TRL's own vLLM server script) are refused, nothing written.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

import pytest

import fp32patch
from fp32patch.patcher.spec import load_specs
from fp32patch.runtime.trl.fused import MARK
from tests.conftest import LOGITS_PROCESSOR, NEMOTRON, tree_digest
from tests.support.lifecycle import gate_namespace as _gate
from tests.support.lifecycle import lifecycle, neighbour, without_ours
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

SPEC = "trl-fp32-lm-head"
SNIPPETS = Path(fp32patch.__file__).parent / "patches" / "snippets"
VLLM_SPECS = ("nemotron-h-fp32-lm-head", "vllm-fp32-logits")

# (TRL release, a vLLM release its vllm extra allows) -> the variant
PAIRS = {
    ("1.12.0", "0.27.1"): "full-logits",  # vllm>=0.19.0,<=0.27.1
    ("1.13.0", "0.28.0"): "full-logits",  # vllm>=0.19.1,<=0.28.0
    ("1.14.0", "0.30.0"): "full-logits",  # vllm>=0.20.0,<=0.30.0
    ("1.14.1", "0.30.0"): "full-logits",
    ("1.14.2", "0.30.0"): "full-logits",
    ("1.15.0", "0.31.0"): "chunked-logprobs",  # vllm>=0.21.0,<=0.31.0
    ("1.16.0", "0.31.0"): "chunked-logprobs",  # vllm>=0.22.0,<=0.31.0
    ("1.16.0", "0.22.0"): "chunked-logprobs",
}
# the release before the range (TRL's own FastAPI vLLM server; vllm>=0.17.0,<=0.26.0): refused
REFUSED = {"1.10.0": "0.26.0"}
FUSED = "1.15.0"  # the first release with chunked log-probs (add_fused_lm_head)

FILES = {
    "config": "trl/trainer/base_config.py",
    "trainer": "trl/trainer/base_trainer.py",
    "utils": "trl/trainer/utils.py",
    "grpo": "trl/trainer/grpo_trainer.py",
    "rloo": "trl/trainer/rloo_trainer.py",
    "generation": "trl/generation/vllm_generation.py",
    "serve": "trl/scripts/vllm_serve.py",
}
METRICS = 'self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}'


def _is_fused(version: str) -> bool:
    return tuple(map(int, version.split("."))) >= tuple(map(int, FUSED.split(".")))


def _edits(version: str) -> list[tuple[str, str, str, str, str, str]]:
    """Where each inserted statement must be: (file, class, method, the statement it sits next to
    (its start, as ast.unparse writes it), "after" or "before", the inserted statement)."""
    path = "fused" if _is_fused(version) else "logits"
    return [
        ("trainer", "_BaseTrainer", "__init__", "super().__init__(*args, **kwargs)", "after",
         f"_fp32patch_check_trainer(self, '{path}')"),
        ("grpo", "GRPOTrainer", "__init__", ast.unparse(ast.parse(METRICS)), "before",
         f"_fp32patch_wire_trainer(self, '{path}')"),
        ("rloo", "RLOOTrainer", "__init__", ast.unparse(ast.parse(METRICS)), "before",
         f"_fp32patch_wire_trainer(self, '{path}')"),
        ("generation", "VLLMGeneration", "_init_vllm", "quantization = None", "before", "_fp32patch_vllm_env(model)"),
        ("generation", "VLLMGeneration", "_init_vllm", "self.llm = LLM(", "after",
         "_fp32patch_probe_colocated(self.llm, model)"),
        ("generation", "VLLMGeneration", "_init_vllm", "self.vllm_client = VLLMClient(", "after",
         "_fp32patch_probe_server(self.vllm_client, model)"),
        ("serve", None, "main", "env['VLLM_SERVER_DEV_MODE'] = '1'", "after",
         "command = _fp32patch_serve(script_args, command, env)"),
    ]  # fmt: skip


def _spec():
    return next(s for s in load_specs() if s.id == SPEC)


def _root(version: str, vllm: str, where: Path) -> Path:
    """TRL ``version``'s target files and vLLM ``vllm``'s, in one import root."""
    import_root_from_members("trl", version, [p for _, p in _spec().target.files], where)
    return import_root_from_members("vllm", vllm, [NEMOTRON, LOGITS_PROCESSOR], where)


def _function(tree: ast.Module, cls: str | None, name: str) -> ast.AST:
    body = tree.body if cls is None else next(n for n in tree.body if getattr(n, "name", "") == cls).body
    return next(n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def _field_after(tree: ast.Module, cls: str, name: str) -> str:
    body = next(n for n in tree.body if getattr(n, "name", "") == cls).body
    names = [ast.unparse(s.target) if isinstance(s, ast.AnnAssign) else None for s in body]
    return ast.unparse(body[names.index(name) + 1])


def _is_ours(stmt: ast.stmt) -> bool:
    """A statement the patch inserts: the gate's helpers, a call of them, the switch's field."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return stmt.name.startswith("_fp32patch_")
    if isinstance(stmt, ast.AnnAssign) and ast.unparse(stmt.target) == "fp32_lm_head":
        return True
    return not isinstance(stmt, (ast.ClassDef, ast.With)) and "_fp32patch_" in ast.unparse(stmt).split("\n")[0]


class _StockKernel(ast.NodeTransformer):
    """The fused-kernel edit undone: ``_fp32patch_fused_kernel(self, K).apply`` read as ``K.apply``."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        if isinstance(node.func, ast.Name) and node.func.id == "_fp32patch_fused_kernel":
            return node.args[1]
        return node


def _changed(version: str) -> set[str]:
    return set(FILES) - (set() if _is_fused(version) else {"utils"})


def _check_edits(version: str, originals: dict[str, bytes], patched: dict[str, bytes]) -> None:
    gate = [n.name for n in ast.parse((SNIPPETS / "trl_gate.py").read_text()).body]
    changed = _changed(version)
    assert {k for k, path in FILES.items() if patched[path] != originals[path]} == changed
    trees = {key: ast.parse(patched[FILES[key]]) for key in changed}
    inserted = dict.fromkeys(changed, 0)
    for key, cls, func, anchor, where, ours in _edits(version):
        assert neighbour(_function(trees[key], cls, func), anchor, where) == ours, (version, key, func)
        inserted[key] += 1
    # the switch is a field of every TRL config (_BaseConfig) and of trl vllm-serve's arguments, off by default
    for key, cls, before in (
        ("config", "_BaseConfig", "torch_empty_cache_steps"),
        ("serve", "ScriptArguments", "speculative_config"),
    ):
        assert _field_after(trees[key], cls, before).startswith("fp32_lm_head: str | None = field(default=None, "), key
        inserted[key] += 1
    if _is_fused(version):  # TRL's chunked kernel, called through the gate in the fused forward
        forward = _function(trees["utils"], None, "add_fused_lm_head")
        calls = [
            ast.unparse(n.func)
            for n in ast.walk(forward)
            if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(".apply")
        ]
        assert calls == ["_fp32patch_fused_kernel(self, _ChunkedLogProbFunction).apply"], calls

    for key, tree in trees.items():
        path = FILES[key]
        helpers = [] if key == "config" else gate
        assert [n.name for n in tree.body if getattr(n, "name", "").startswith("_fp32patch_")] == helpers, path
        stripped, removed = without_ours(_StockKernel().visit(ast.parse(patched[path])), _is_ours)
        assert removed == len(helpers) + inserted[key], (path, removed)
        assert ast.dump(stripped) == ast.dump(ast.parse(originals[path])), f"{path}: more changed than the edits"
        compile(patched[path], path, "exec", dont_inherit=True)  # fmt: skip


# ---------------------------------------------------------------- the gate with the switch off


class _Model:
    """A model as TRL's code hands it over: no mark, unless fp32patch's wiring set one."""


def _run_gate_off(source: bytes) -> list[str]:
    """Every gate function with the switch off in each spelling, as TRL's code calls it; returns what was imported."""
    ns, imported = _gate(source)
    model, llm, client, stock = _Model(), object(), object(), object()
    command, env = ["python", "-m", "vllm.entrypoints.cli.main", "serve", "m"], {"VLLM_SERVER_DEV_MODE": "1"}
    for off in (None, False, "", "false", "False", "no", "0"):
        args = types.SimpleNamespace(fp32_lm_head=off, cast_lm_head_to_fp32=False, use_vllm=True)
        trainer = types.SimpleNamespace(args=args, model=model, ref_model=None)
        assert ns["_fp32patch_check_trainer"](trainer, "fused") is None
        assert ns["_fp32patch_wire_trainer"](trainer, "fused") is None
        assert ns["_fp32patch_fused_kernel"](model, stock) is stock
        assert ns["_fp32patch_vllm_env"](model) is None
        assert ns["_fp32patch_probe_colocated"](llm, model) is None
        assert ns["_fp32patch_probe_server"](client, model) is None
        assert ns["_fp32patch_serve"](types.SimpleNamespace(fp32_lm_head=off), command, env) is command
    assert command[-1] == "m" and env == {"VLLM_SERVER_DEV_MODE": "1"}
    assert not hasattr(model, MARK)
    return imported


def _run_gate_on(source: bytes) -> list[str]:
    """The control: a model the wiring marked goes through fp32patch's runtime."""
    ns, imported = _gate(source)
    model = _Model()
    setattr(model, MARK, "fp32out")
    assert repr(ns["_fp32patch_fused_kernel"](model, object())) == "ChunkedLogProbs(mode='fp32out')"
    return imported


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize(("version", "vllm"), sorted(PAIRS), ids=lambda v: v)
def test_lifecycle_beside_the_vllm_patches(version, vllm, tmp_path, cli, monkeypatch):
    for name in ("NRL_VLLM_FP32_LM_HEAD", "FP32PATCH_VLLM_LM_HEAD"):
        monkeypatch.delenv(name, raising=False)
    variant = PAIRS[version, vllm]
    root = _root(version, vllm, tmp_path / "site-packages")

    def check(originals, patched):
        _check_edits(version, originals, patched)
        # with the switch off, no patched path imports fp32patch, and every gate hands back what it got
        for key in _changed(version) - {"config"}:
            imported = _run_gate_off(patched[FILES[key]])
            assert not [n for n in imported if n.startswith("fp32patch")], (key, imported)
        assert "fp32patch.runtime.trl" in _run_gate_on(patched[FILES["generation"]])

    lifecycle(
        cli,
        root,
        spec=SPEC,
        version=version,
        variant=variant,
        vllm=vllm,
        vllm_specs=VLLM_SPECS,
        paths=FILES.values(),
        check=check,
    )


@pytest.mark.parametrize("version", sorted(REFUSED))
def test_a_release_before_the_range_is_refused(version, tmp_path, cli):
    """Refused with the range the patch supports; nothing written, the vLLM patches' files included."""
    root = _root(version, REFUSED[version], tmp_path / "site-packages")
    before = tree_digest(root)
    result = cli("apply", "-s", root)
    assert result.exit_code == 3, result.stdout + result.stderr
    said = " ".join((result.stdout + result.stderr).split())
    assert f"trl-fp32-lm-head: cannot patch trl/trainer/base_config.py (trl {version})" in said
    assert "this patch supports trl >=1.12.0" in said
    assert "nothing was written" in said
    assert tree_digest(root) == before
