"""skyrl-fp32-lm-head on SkyRL 0.4.0, beside the vLLM patches on the vLLM it pins (0.30.0).

The import root holds SkyRL 0.4.0's real target files and ``.dist-info`` (from its PyPI wheel,
laid out as pip installs it) with ``nemotron_h.py`` and ``logits_processor.py`` of vLLM 0.30.0, as
one image would: ``apply`` patches them all; every edit sits where it belongs and nothing else
changed; ``verify`` is green; re-applying changes nothing; a hand edit reads ``drifted``;
``revert`` restores every byte. SkyRL 0.3.0 (it pins vLLM 0.23.0, which has no ``head_dtype``) is
refused by name, nothing written. With the switch off, the gate each patched file carries hands
back what it was given and never imports fp32patch.
"""

from __future__ import annotations

import ast
import sys
import types
from pathlib import Path

import pytest

import fp32patch
from fp32patch.runtime.skyrl import MARK
from tests.conftest import LOGITS_PROCESSOR, NEMOTRON, tree_digest
from tests.support.lifecycle import drifted_then_forced, lifecycle, neighbour, without_ours
from tests.support.lifecycle import gate_namespace as _gate
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

SPEC = "skyrl-fp32-lm-head"
VERSION, VLLM = "0.4.0", "0.30.0"
SNIPPETS = Path(fp32patch.__file__).parent / "patches" / "snippets"
VLLM_SPECS = ("nemotron-h-fp32-lm-head", "vllm-fp32-logits")
FILES = {
    "config": "skyrl/train/config/config.py",
    "validate": "skyrl/train/utils/utils.py",
    "server_args": "skyrl/backends/skyrl_train/inference_servers/utils.py",
    "setup": "skyrl/backends/skyrl_train/inference_servers/setup.py",
    "worker": "skyrl/backends/skyrl_train/inference_servers/new_inference_worker_wrap.py",
    "fsdp": "skyrl/backends/skyrl_train/workers/fsdp/fsdp_worker.py",
    "wrapper": "skyrl/backends/skyrl_train/workers/model_wrapper.py",
    "megatron": "skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py",
    "model_utils": "skyrl/backends/skyrl_train/distributed/megatron/model_utils.py",
}
MODEL_CALL = "_fp32patch_model(self, sequences_rolled, temperature, support_channels is None, compute_entropy)"

# (file, class, function, the statement it sits next to, "after"/"before", the inserted statement's start)
EDITS = [
    ("config", "TrainerConfig", None, "def __post_init__(self)", "before", "'fp32patch: fp32 LM-head logits"),
    ("validate", None, "validate_cfg", "_fp32patch_check_config(cfg)", "at", "_fp32patch_check_config(cfg)"),
    ("server_args", None, "build_vllm_cli_args", "return args", "before", "_fp32patch_engine_args(args, cfg)"),
    ("setup", None, "build_new_inference_client", "client = RemoteInferenceClient(", "before",
     "_fp32patch_probe_servers(cfg, server_setup.server_urls)"),
    ("worker", "NewInferenceWorkerWrap", None, "def fetch_weights(self", "before", "def fp32patch_probe_lm_head(self)"),
    ("fsdp", "FSDPPolicyWorkerBase", "init_model", "self.model, self.optimizer, self.scheduler = strategy.prepare(",
     "after", "_fp32patch_wire(self.model, self.cfg, 'policy')"),
    ("fsdp", "FSDPRefWorkerBase", "init_model", "self.model = strategy.prepare(wrapped_model)", "after",
     "_fp32patch_wire(self.model, self.cfg, 'reference model')"),
    ("megatron", "MegatronModelWrapper", "__init__", "self._fused_lm_head_backend = ", "after",
     "_fp32patch_wire_megatron(self)"),
    ("model_utils", None, "_fused_lm_head_logprob_apply", "if (_fp32patch_out := _fp32patch_fused_logprobs(", "at",
     "if (_fp32patch_out := _fp32patch_fused_logprobs(hidden, weight, target, vocab_start_index, tp_group"),
    ("model_utils", None, "_fused_vocab_parallel_entropy_from_hidden", "if (_fp32patch_out := _fp32patch_fused_entropy(",
     "at", "if (_fp32patch_out := _fp32patch_fused_entropy(hidden, lm_head_weight, tp_group, temperature))"),
]  # fmt: skip
SCALED = "_fp32patch_scaled_weight(lm_head_weight, temperature)"


def _root(version: str, vllm: str, where: Path) -> Path:
    import_root_from_members("skyrl", version, list(FILES.values()), where)
    return import_root_from_members("vllm", vllm, [NEMOTRON, LOGITS_PROCESSOR], where)


def _scope(tree: ast.Module, cls: str | None, name: str | None) -> ast.AST:
    node: ast.AST = tree
    if cls is not None:
        node = next(n for n in tree.body if getattr(n, "name", "") == cls)
    if name is not None:
        node = next(n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
    return node


def _is_ours(stmt: ast.stmt) -> bool:
    """A statement the patch inserts: the gate's helpers, the probe's method, a gate call, the field."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return stmt.name.startswith(("_fp32patch_", "fp32patch_"))
    if isinstance(stmt, ast.AnnAssign) and getattr(stmt.target, "id", "") == "fp32_lm_head":
        return True
    first = ast.unparse(stmt).split("\n")[0]
    if isinstance(stmt, ast.If):  # the fused path's gates: the stock code runs where they give None
        return first.startswith("if (_fp32patch_out := _fp32patch_fused_")
    return isinstance(stmt, ast.Expr) and (first.startswith("_fp32patch_") or first.startswith("'fp32patch: "))


class _Stock(ast.NodeTransformer):
    """The replacing edits undone: each gate call read as the expression it stands in for."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name == "_fp32patch_model":
            return ast.Attribute(value=ast.Name("self", ast.Load()), attr="model", ctx=ast.Load())
        if name in ("_fp32patch_log_probs_fn", "_fp32patch_entropy_fn"):
            return node.args[1]
        if name == "_fp32patch_scaled_weight":
            return ast.BinOp(left=node.args[0], op=ast.Div(), right=node.args[1])
        return node


def _check_edits(originals: dict[str, bytes], patched: dict[str, bytes]) -> None:
    gate = [n.name for n in ast.parse((SNIPPETS / "skyrl_gate.py").read_text()).body]
    assert {k for k, path in FILES.items() if patched[path] != originals[path]} == set(FILES)
    trees = {key: ast.parse(patched[path]) for key, path in FILES.items()}
    inserted = dict.fromkeys(FILES, 0)
    for key, cls, func, anchor, where, ours in EDITS:
        found = neighbour(_scope(trees[key], cls, func), anchor, where)
        assert found.startswith(ours), (key, anchor, found[:200])
        inserted[key] += 1
    inserted["config"] += 1  # the field and its docstring
    forward = ast.unparse(_scope(trees["wrapper"], "HFModelWrapper", "forward"))
    assert forward.count(MODEL_CALL) == 4
    assert "_fp32patch_log_probs_fn(self, logprobs_from_logits)(logits_BSV, sequences_rolled" in forward
    assert "_fp32patch_entropy_fn(self, self.chunked_entropy_from_logits_fn)(logits_BSV" in forward
    for func in ("from_parallel_hidden_to_logprobs", "from_parallel_hidden_to_logprobs_packed_sequences"):
        body = ast.unparse(_scope(trees["model_utils"], None, func))
        assert f"lm_head_weight = {SCALED}" in body and "lm_head_weight / temperature" not in body, func

    for key, path in FILES.items():
        names = [n.name for n in trees[key].body if getattr(n, "name", "").startswith("_fp32patch_")]
        assert names == ([] if key == "config" else gate), path
        stripped, removed = without_ours(_Stock().visit(ast.parse(patched[path])), _is_ours)
        assert removed == (0 if key == "config" else len(gate)) + inserted[key], (path, removed)
        assert ast.dump(stripped) == ast.dump(ast.parse(originals[path])), f"{path}: more changed than the edits"
        compile(patched[path], path, "exec", dont_inherit=True)


def _run_gate_off(source: bytes, monkeypatch) -> list[str]:
    """Every gate function with the switch off in each spelling, as SkyRL's code calls it."""
    ns, imported = _gate(source)
    wrapper = types.SimpleNamespace(model=object(), cfg=None, chunked_entropy_from_logits_fn=object())
    stock = object()
    for off in (None, False, "", "false", "False", "no", "0", "off"):
        trainer = types.SimpleNamespace(fp32_lm_head=off)
        cfg = types.SimpleNamespace(trainer=trainer)
        wrapper.cfg = trainer
        args = types.SimpleNamespace(hf_overrides=None)
        assert ns["_fp32patch_check_config"](cfg) is None
        assert ns["_fp32patch_engine_args"](args, cfg) is None and args.hf_overrides is None
        assert ns["_fp32patch_probe_servers"](cfg, ["http://127.0.0.1:1"]) is None
        assert ns["_fp32patch_wire"](wrapper, trainer, "policy") is None
        assert ns["_fp32patch_wire_megatron"](wrapper) is None
        assert ns["_fp32patch_model"](wrapper, None, 1.0, True, True) is wrapper.model
        assert ns["_fp32patch_log_probs_fn"](wrapper, stock) is stock
        assert ns["_fp32patch_entropy_fn"](wrapper, stock) is stock
        # the fused path's gates: no head is wired, so SkyRL's own code runs
        assert ns["_fp32patch_scaled_weight"](6.0, 2.0) == 3.0
        assert ns["_fp32patch_fused_logprobs"](None, object(), None, 0, None, False, 1024) is None
        assert ns["_fp32patch_fused_entropy"](None, object(), None, 0.7) is None
    assert not hasattr(wrapper, MARK)
    return imported


def test_lifecycle_beside_the_vllm_patches(tmp_path, cli, monkeypatch):
    for name in ("NRL_VLLM_FP32_LM_HEAD", "FP32PATCH_VLLM_LM_HEAD"):
        monkeypatch.delenv(name, raising=False)
    root = _root(VERSION, VLLM, tmp_path / "site-packages")

    def check(originals, patched):
        _check_edits(originals, patched)
        for key, path in FILES.items():
            if key != "config":
                imported = _run_gate_off(patched[path], monkeypatch)
                assert not [n for n in imported if n.startswith("fp32patch")], (key, imported)
        ns, imported = _gate(patched[FILES["wrapper"]])
        wrapper = types.SimpleNamespace(model=object())
        setattr(wrapper, MARK, "fp32out")
        assert ns["_fp32patch_log_probs_fn"](wrapper, object()).__name__ == "logprobs_from_logits"
        assert "fp32patch.runtime.skyrl" in imported

    lifecycle(
        cli,
        root,
        spec=SPEC,
        version=VERSION,
        variant="all",
        vllm=VLLM,
        vllm_specs=VLLM_SPECS,
        paths=FILES.values(),
        check=check,
    )


def test_a_hand_edited_file_is_drifted_and_reverted_only_by_force(tmp_path, cli):
    root = import_root_from_members("skyrl", VERSION, list(FILES.values()), tmp_path / "site-packages")
    drifted_then_forced(cli, root, spec=SPEC, paths=FILES.values(), edit=FILES["wrapper"])


def test_the_release_before_is_refused_by_name(tmp_path, cli):
    """0.3.0 (it pins vLLM 0.23.0, before vLLM's own head_dtype): refused with the range the patch
    supports; nothing written, the vLLM patches' files included."""
    root = _root("0.3.0", "0.23.0", tmp_path / "site-packages")
    before = tree_digest(root)
    result = cli("apply", "-s", root)
    assert result.exit_code == 3, result.stdout + result.stderr
    said = " ".join((result.stdout + result.stderr).split())
    assert "skyrl-fp32-lm-head: cannot patch skyrl/train/config/config.py (skyrl 0.3.0)" in said
    assert "this patch supports skyrl >=0.4.0" in said and "nothing was written" in said
    assert tree_digest(root) == before
    assert "fp32patch.runtime.skyrl" in sys.modules  # imported by this module, never by the CLI's run
