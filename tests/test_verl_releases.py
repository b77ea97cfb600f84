"""verl-fp32-lm-head on every supported verl release, beside the vLLM patches on the vLLM that release pins.

Each import root holds a verl release's real target files and ``.dist-info`` (from its PyPI
wheel) together with ``nemotron_h.py`` and ``logits_processor.py`` of the vLLM release its
``vllm`` extra allows, as one image would: ``apply`` patches all three, in the variant the
release needs; ``verify`` is green; every edit sits in the function it belongs to and nothing
else changed; re-applying changes nothing; ``revert`` restores every byte. With the key off,
the gate each patched file carries returns what it was given and never imports fp32patch.
Releases before the rollout server (0.6.1, 0.7.0) are refused, nothing written.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import fp32patch
from fp32patch.patcher.spec import load_specs
from tests.conftest import LOGITS_PROCESSOR, NEMOTRON, tree_digest
from tests.support.lifecycle import gate_namespace as _gate
from tests.support.lifecycle import lifecycle, neighbour, without_ours
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

SPEC = "verl-fp32-lm-head"
SNIPPETS = Path(fp32patch.__file__).parent / "patches" / "snippets"
VLLM_SPECS = ("nemotron-h-fp32-lm-head", "vllm-fp32-logits")

# verl release -> (the vLLM release its vllm extra allows, newest first where it is a range; the variant it needs)
RELEASES = {
    "0.6.1": ("0.11.0", "in-process-vllm-spmd"),  # vllm>=0.8.5,<=0.11.0
    "0.7.0": ("0.12.0", "in-process-vllm"),  # vllm>=0.8.5,<=0.12.0
    "0.7.1": ("0.12.0", "legacy-and-engine-workers"),  # vllm>=0.8.5,<=0.12.0
    "0.8.0": ("0.12.0", "engine-workers-0.8"),  # vllm>=0.8.5,<=0.12.0
    "0.9.0": ("0.18.0", "engine-workers"),  # vllm>=0.18.0
    "0.9.1": ("0.24.0", "engine-workers"),  # vllm==0.24.0
}
# the release before the range (its vLLM extra: <=0.11.0): refused, nothing written
REFUSED = {"0.6.0": "0.11.0"}

FILES = {
    "model": "verl/workers/config/model.py",
    "guard": "verl/utils/config.py",
    "fsdp": "verl/workers/engine/fsdp/transformer_impl.py",
    "megatron": "verl/workers/engine/megatron/transformer_impl.py",
    "server": "verl/workers/rollout/vllm_rollout/vllm_async_server.py",
    "extension": "verl/workers/rollout/vllm_rollout/utils.py",
    "sglang": "verl/workers/rollout/sglang_rollout/async_sglang_server.py",
    "fsdp_workers": "verl/workers/fsdp_workers.py",
    "megatron_workers": "verl/workers/megatron_workers.py",
    "rollout": "verl/workers/rollout/vllm_rollout/vllm_rollout.py",
    "rollout_spmd": "verl/workers/rollout/vllm_rollout/vllm_rollout_spmd.py",
    "fused_torch": "verl/utils/experimental/torch_functional.py",
    "fused_triton": "verl/utils/kernel/linear_cross_entropy.py",
}
ALL = set(RELEASES)
LEGACY = {"0.6.1", "0.7.0", "0.7.1"}  # the legacy workers (their files are gone from 0.8.0)
SERVER = {"0.7.1", "0.8.0", "0.9.0", "0.9.1"}  # vLLM in a rollout server of its own
# where vLLM's worker runs inside the trainer's worker: the file that holds it
IN_PROCESS = {"0.6.1": "rollout_spmd", "0.7.0": "rollout"}

VISIBLE = "os.environ[get_visible_devices_keyword()] = cuda_visible_devices"
MONKEY_PATCH = "await engine_client.collective_rpc(method='monkey_patch_model', "
WORKER_MODEL = "self.inference_engine.worker.model_runner.model"

# where each inserted statement must be: (the releases, file, class, method, the statement it sits
# next to (its start, as ast.unparse writes it), "after" or "before", the inserted statement)
EDITS = [
    (
        ALL,
        "fsdp",
        "FSDPEngine",
        "_build_model_optimizer",
        "module = self._build_fsdp_module(module)",
        "after",
        "module = _fp32patch_wire_hf(module, self.model_config, 'critic' if isinstance(self, FSDPEngineWithValueHead) "
        "else 'ref' if self.engine_config.forward_only else 'actor')",
    ),
    (
        ALL,
        "megatron",
        "MegatronEngine",
        "initialize",
        "self.module = self._build_megatron_module()",
        "after",
        "self.module = _fp32patch_wire_megatron(self.module, self.model_config, 'critic' if getattr(self, "
        "'is_value_model', False) else 'ref' if self.engine_config.forward_only else 'actor')",
    ),
    (
        ALL,
        "sglang",
        "SGLangHttpServer",
        "launch_server",
        "server_args = ServerArgs(**args)",
        "before",
        "args = _fp32patch_sglang_args(args, self.model_config, ServerArgs)",
    ),
    (
        ALL,
        "sglang",
        "SGLangHttpServer",
        "launch_server",
        "self.tokenizer_manager.server_status = ServerStatus.Up",
        "after",
        "await _fp32patch_probe_sglang(self.tokenizer_manager, self.model_config, 'SGLang rollout server')",
    ),
    (
        SERVER,
        "server",
        "vLLMHttpServer",
        "__init__",
        VISIBLE,
        "after",
        "_fp32patch_vllm_env(model_config, 'vLLM rollout server')",
    ),
    (
        SERVER,
        "server",
        "vLLMHttpServer",
        "run_server",
        MONKEY_PATCH,
        "after",
        "await _fp32patch_probe_server(engine_client, self.model_config, 'vLLM rollout server')",
    ),
    (
        LEGACY,
        "fsdp_workers",
        "ActorRolloutRefWorker",
        "_build_model_optimizer",
        "log_gpu_memory_usage(f'After {role} FSDP init', logger=logger)",
        "after",
        "actor_module_fsdp = _fp32patch_wire_hf(actor_module_fsdp, self.config.model, role)",
    ),
    (
        LEGACY,
        "megatron_workers",
        "ActorRolloutRefWorker",
        "_build_model_optimizer",
        "return (actor_module, actor_optimizer, actor_optimizer_scheduler, self.hf_config, optim_config)",
        "before",
        "actor_module = _fp32patch_wire_megatron(actor_module, self.config.model, 'actor')",
    ),
    (
        LEGACY,
        "megatron_workers",
        "ActorRolloutRefWorker",
        "_build_model_optimizer",
        "return (ref_module, self.hf_config)",
        "before",
        "ref_module = _fp32patch_wire_megatron(ref_module, self.config.model, 'ref')",
    ),
    *(
        (
            {version},
            key,
            "vLLMAsyncRollout",
            method,
            anchor,
            where,
            ours,
        )
        for version, key in IN_PROCESS.items()
        for method, anchor, where, ours in (
            (
                "_init_worker",
                "self.inference_engine = WorkerWrapperBase(vllm_config=self.vllm_config)",
                "before",
                "_fp32patch_vllm_env(self.model_config, 'vLLM rollout worker')",
            ),
            (
                "_load_model",
                f"_monkey_patch_compute_logits({WORKER_MODEL}, len(self.tokenizer))",
                "after",
                f"_fp32patch_probe_model({WORKER_MODEL}, self.model_config, 'vLLM rollout worker')",
            ),
        )
    ),
    # 0.6.1's synchronous rollout: the variable before vLLM's LLM is built, the probe once it is
    (
        {"0.6.1"},
        "rollout_spmd",
        "vLLMRollout",
        "__init__",
        "load_format = 'dummy' if config.load_format.startswith('dummy') else config.load_format",
        "after",
        "_fp32patch_vllm_env(self.model_config, 'vLLM rollout')",
    ),
    (
        {"0.6.1"},
        "rollout_spmd",
        "vLLMRollout",
        "__init__",
        "self.inference_engine = LLM(",
        "after",
        "_fp32patch_probe_model(self.inference_engine.llm_engine.model_executor.driver_worker.worker.model_runner.model"
        ", self.model_config, 'vLLM rollout')",
    ),
]


def _spec():
    return next(s for s in load_specs() if s.id == SPEC)


def _root(version: str, where: Path) -> Path:
    """verl ``version``'s target files (those its wheel holds) and the pinned vLLM's, in one import root."""
    paths = [p for _, p in _spec().target.files]
    import_root_from_members("verl", version, paths, where)
    vllm = RELEASES[version][0] if version in RELEASES else REFUSED[version]
    return import_root_from_members("vllm", vllm, [NEMOTRON, LOGITS_PROCESSOR], where)


def _method(tree: ast.Module, cls: str, name: str) -> ast.AST:
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    return next(n for n in klass.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def _first_statement(func: ast.AST) -> str:
    body = func.body[1:] if ast.get_docstring(func) is not None else func.body  # type: ignore[attr-defined]
    return ast.unparse(body[0])


def _is_ours(stmt: ast.stmt) -> bool:
    """A statement the patch inserts: the gate's helpers, a call of them, the probe's method, the key's field."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return stmt.name.startswith("_fp32patch_") or stmt.name == "fp32patch_probe_lm_head"
    if isinstance(stmt, ast.AnnAssign) and ast.unparse(stmt.target) == "fp32_lm_head":
        return True
    return not isinstance(stmt, ast.ClassDef) and "_fp32patch_" in ast.unparse(stmt).split("\n")[0]


def _changed(version: str) -> set[str]:
    """The files the patch changes in ``version``."""
    keys = {"model", "guard", "fsdp", "megatron", "sglang", "fused_torch", "fused_triton"}
    keys |= {"server", "extension"} if version in SERVER else set()
    keys |= {"fsdp_workers", "megatron_workers"} if version in LEGACY else set()
    return keys | ({IN_PROCESS[version]} if version in IN_PROCESS else set())


def _check_edits(version: str, originals: dict[str, bytes], patched: dict[str, bytes]) -> None:
    gate = [n.name for n in ast.parse((SNIPPETS / "verl_gate.py").read_text()).body]
    changed = _changed(version)
    present = {key for key, path in FILES.items() if path in originals}
    legacy = {"fsdp_workers", "megatron_workers"}
    assert present & legacy == (legacy if version in LEGACY else set())  # the legacy files are gone from 0.8.0
    assert {k for k in present if patched[FILES[k]] != originals[FILES[k]]} == changed
    trees = {key: ast.parse(patched[FILES[key]]) for key in changed}
    inserted = dict.fromkeys(changed, 0)

    for versions, key, cls, func, anchor, where, ours in EDITS:
        if version in versions:
            assert neighbour(_method(trees[key], cls, func), anchor, where) == ours, (version, key, func)
            inserted[key] += 1
    # the key is a field of HFModelConfig (verl's structured config refuses unknown keys), off by default
    model = next(n for n in trees["model"].body if getattr(n, "name", "") == "HFModelConfig")
    fields = [ast.unparse(s) for s in model.body]
    at = fields.index("fused_kernel_options: dict = field(default_factory=dict)")
    assert fields[at + 1] == "fp32_lm_head: Any = False"
    # the guard runs first in verl's validate_config
    validate = next(n for n in trees["guard"].body if getattr(n, "name", "") == "validate_config")
    assert _first_statement(validate) == "_fp32patch_check_config(config)"
    inserted["model"] += 1
    inserted["guard"] += 1
    # the fused kernels: fp32patch's path first in FusedLinearForPPO.forward (torch, liger), and
    # linear_cross_entropy (triton) wrapped right where the module binds it
    forward = _method(trees["fused_torch"], "FusedLinearForPPO", "forward")
    assert _first_statement(forward).startswith(
        "_fp32patch_out = _fp32patch_fused_logprobs(hidden_states, vocab_weights"
    )
    inserted["fused_torch"] += 2
    module = [ast.unparse(n) for n in trees["fused_triton"].body]
    at = module.index("linear_cross_entropy = LinearCrossEntropy.apply")
    assert module[at + 1] == "linear_cross_entropy = _fp32patch_linear_cross_entropy(linear_cross_entropy)"
    inserted["fused_triton"] += 1
    if version in SERVER:  # the probe's method in the worker extension, right after verl's monkey_patch_model
        extension = next(n for n in trees["extension"].body if getattr(n, "name", "") == "vLLMColocateWorkerExtension")
        names = [n.name for n in extension.body if isinstance(n, ast.FunctionDef)]
        assert names[names.index("monkey_patch_model") + 1] == "fp32patch_probe_lm_head"
        inserted["extension"] += 1

    # every changed file: the gate whole at module level (model.py takes the field alone), the
    # statements above once each, nothing else changed, and it compiles
    for key, tree in trees.items():
        path = FILES[key]
        helpers = [] if key == "model" else gate
        assert [n.name for n in tree.body if getattr(n, "name", "").startswith("_fp32patch_")] == helpers, path
        stripped, removed = without_ours(ast.parse(patched[path]), _is_ours)
        assert removed == len(helpers) + inserted[key], (path, removed)
        assert ast.dump(stripped) == ast.dump(ast.parse(originals[path])), f"{path}: more changed than the edits"
        compile(patched[path], path, "exec", dont_inherit=True)


# ---------------------------------------------------------------- the gate with the key off


class _DictConfigLike(Mapping):
    """Reads like OmegaConf's DictConfig: keys(), get(), [] and attributes; nested sections wrapped."""

    def __init__(self, data: dict[str, Any]):
        self._data = data

    def __getitem__(self, key: str) -> Any:
        value = self._data[key]
        return _DictConfigLike(value) if isinstance(value, dict) else value

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


@dataclasses.dataclass
class _ModelConfigLike:
    """An attribute-only model config (verl's dataclasses read by attribute)."""

    path: str = "Qwen/Qwen3-0.6B"
    fp32_lm_head: Any = False


class _Engine:
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def collective_rpc(self, method: str, *args: Any, **kwargs: Any) -> list[dict[str, str]]:
        self.calls.append(method)
        return [{"dtype": "float32", "way": "fp32out"}]


def _run_gate_off(source: bytes) -> list[str]:
    """Every gate function, the key off in each spelling, as verl's code calls them; returns what was imported."""
    ns, imported = _gate(source)
    module, chunks, args = object(), [object(), object()], {"tp_size": 1}
    engine = _Engine()
    for off in (False, None, "", "  "):
        for model in (_DictConfigLike({"path": "m", "fp32_lm_head": off}), _ModelConfigLike(fp32_lm_head=off)):
            assert ns["_fp32patch_wire_hf"](module, model, "actor") is module
            assert ns["_fp32patch_wire_megatron"](chunks, model, "ref") is chunks
            assert ns["_fp32patch_vllm_env"](model, "vLLM rollout server") is None
            asyncio.run(ns["_fp32patch_probe_server"](engine, model, "vLLM rollout server"))
            assert ns["_fp32patch_sglang_args"](args, model, object) is args and args == {"tp_size": 1}
            assert ns["_fp32patch_probe_model"](module, model, "vLLM rollout worker") is None
            assert asyncio.run(ns["_fp32patch_probe_sglang"](engine, model, "SGLang rollout server")) is None
    # the fused kernels: no head is wired, so verl's own kernel gets the call, untouched
    stock_calls = []
    wrapped = ns["_fp32patch_linear_cross_entropy"](lambda *args: stock_calls.append(args) or "stock")
    assert wrapped("h", "w", "labels") == "stock" and stock_calls == [("h", "w", "labels", 1.0, "none", None)]
    assert ns["_fp32patch_fused_logprobs"](object(), object(), object(), 0.7, "torch") is None
    for config in (
        {"actor_rollout_ref": {"model": {"path": "m"}, "rollout": {"name": "vllm"}}},
        {
            "actor_rollout_ref": {"model": {"fp32_lm_head": False}, "rollout": {"engine_kwargs": {"sglang": {}}}},
            "ray_kwargs": {"ray_init": {"runtime_env": {"env_vars": {"NRL_VLLM_FP32_LM_HEAD": "0"}}}},
        },
        {"trainer": {"n_gpus_per_node": 8}},
    ):
        assert ns["_fp32patch_check_config"](_DictConfigLike(config)) is None
    assert engine.calls == []
    return imported


def _run_gate_on(source: bytes) -> list[str]:
    """The control: the key on, a critic's module goes through fp32patch's runtime (and is left as it is)."""
    ns, imported = _gate(source)
    module = object()
    assert ns["_fp32patch_wire_hf"](module, _DictConfigLike({"fp32_lm_head": "fp32out"}), "critic") is module
    return imported


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_lifecycle_beside_the_vllm_patches(version, tmp_path, cli, monkeypatch):
    monkeypatch.delenv("NRL_VLLM_FP32_LM_HEAD", raising=False)
    vllm, variant = RELEASES[version]
    root = _root(version, tmp_path / "site-packages")

    def check(originals, patched):
        _check_edits(version, originals, patched)
        # with the key off, no patched path imports fp32patch, and every gate hands back what it got
        for key in _changed(version) - {"model"}:
            imported = _run_gate_off(patched[FILES[key]])
            assert not [n for n in imported if n.startswith("fp32patch")], (key, imported)
        assert "fp32patch.runtime.verl" in _run_gate_on(patched[FILES["fsdp"]])

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
    root = _root(version, tmp_path / "site-packages")
    before = tree_digest(root)
    result = cli("apply", "-s", root)
    assert result.exit_code == 3, result.stdout + result.stderr
    said = " ".join((result.stdout + result.stderr).split())
    assert f"verl-fp32-lm-head: cannot patch verl/workers/config/model.py (verl {version})" in said
    assert "this patch supports verl >=0.6.1" in said
    assert "nothing was written" in said
    assert tree_digest(root) == before

    code, out = cli.json("apply", "-s", root)
    assert code == 3
    [entry] = [p for p in out["patches"] if p["id"] == SPEC]
    assert (entry["status"], entry["version"]) == ("unsupported-version", version)
    assert "verl >=0.6.1" in entry["message"]
    assert tree_digest(root) == before


# ---------------------------------------------------------------- the fused kernels, run


V_FUSED, H_FUSED = 96, 32


class _TinyLM(torch.nn.Module):
    """What verl's fused forward reads of a causal LM: its head (``lm_head``), tied or not."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        self.embed_tokens = torch.nn.Embedding(V_FUSED, H_FUSED, dtype=torch.bfloat16)
        self.lm_head = torch.nn.Linear(H_FUSED, V_FUSED, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.randn(V_FUSED, H_FUSED, generator=gen) * 0.6)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
            with torch.no_grad():
                self.embed_tokens.weight.copy_(torch.randn(V_FUSED, H_FUSED, generator=gen) * 0.6)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


def _fused_inputs():
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, 40, H_FUSED, generator=gen).bfloat16()  # verl's packed batch of one row
    return hidden, torch.randint(0, V_FUSED, (1, 40), generator=gen)


def _fused_reference(hidden, weight, ids, temperature):
    z = hidden.double() @ weight.detach().double().t() / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, ids[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


def _load(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", params=["0.7.1", "0.9.1"])
def fused_modules(request, tmp_path_factory):
    """verl's torch_functional.py and linear_cross_entropy.py, stock and patched, imported."""
    from tests.conftest import Cli

    version = request.param
    stock, patched = (_root(version, tmp_path_factory.mktemp(name)) for name in ("stock", "patched"))
    code, out = Cli().json("apply", "-s", patched, "--patch", SPEC)
    assert code == 0, out
    return {
        "version": version,
        **{
            f"{kind}_torch": _load(root / FILES["fused_torch"], f"verl_tf_{kind}_{version}")
            for kind, root in (("stock", stock), ("patched", patched))
        },
        "patched_triton": _load(patched / FILES["fused_triton"], f"verl_lce_{version}"),
    }


def _ppo(module, weight, backend="torch"):
    hidden, ids = _fused_inputs()
    hidden.requires_grad_()
    fused = (
        module.FusedLinearForPPO(impl_backend=backend)
        if "impl_backend" in module.FusedLinearForPPO.__init__.__code__.co_varnames
        else module.FusedLinearForPPO()
    )
    log_probs, entropy = fused.forward(hidden, weight, ids, temperature=0.7)
    (log_probs.sum() + 0.3 * entropy.float().sum()).backward()
    return log_probs, entropy, hidden, ids


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_without_a_wired_head_the_fused_kernel_is_verls_bit_for_bit(fused_modules, tied):
    outputs = []
    for kind in ("stock", "patched"):
        model = _TinyLM(tied)
        log_probs, entropy, hidden, _ = _ppo(fused_modules[f"{kind}_torch"], model.lm_head.weight)
        outputs.append((log_probs, entropy, hidden.grad, model.lm_head.weight.grad))
    for a, b in zip(*outputs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_wired_head_gets_fp32_log_probs_and_entropy_from_every_backend(fused_modules, tied):
    from fp32patch.runtime.verl import wire_hf

    stock = _TinyLM(tied)
    hidden, ids = _fused_inputs()
    want_logp, want_entropy = _fused_reference(hidden, stock.lm_head.weight, ids, 0.7)
    stock_logp, stock_entropy, _, _ = _ppo(fused_modules["stock_torch"], stock.lm_head.weight)
    stock_error = (stock_logp.double() - want_logp).abs().max()
    backends = ["torch", "liger"] if fused_modules["version"] == "0.9.1" else ["torch"]
    for backend in backends:
        model = wire_hf(_TinyLM(tied), {"fp32_lm_head": "fp32out"}, role="actor")
        log_probs, entropy, hidden, ids = _ppo(fused_modules["patched_torch"], model.lm_head.weight, backend)
        assert log_probs.dtype == entropy.dtype == torch.float32 and log_probs.shape == ids.shape
        error = (log_probs.double() - want_logp).abs().max()
        assert error < 1e-5 and stock_error > 100 * error, (backend, error, stock_error)
        assert (entropy.double() - want_entropy).abs().max() < 1e-5
        assert hidden.grad is not None and model.lm_head.weight.grad.any()
    # triton's linear_cross_entropy, called as verl's FSDP forward calls it: flat, as the kernel's
    model = wire_hf(_TinyLM(tied), {"fp32_lm_head": "fp32out"}, role="ref")
    hidden, ids = _fused_inputs()
    log_probs, entropy = fused_modules["patched_triton"].linear_cross_entropy(
        hidden, model.lm_head.weight, ids, 0.7, "none"
    )
    assert log_probs.shape == entropy.shape == (ids.numel(),)
    assert (log_probs.double() - want_logp.reshape(-1)).abs().max() < 1e-5
