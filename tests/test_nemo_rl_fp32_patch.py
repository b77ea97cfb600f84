"""nemo-rl-fp32-lm-head: the spec through the CLI on stand-in NeMo-RL checkouts, then the
patched code run.

tests/fixtures/nemo_rl_shapes.py builds a checkout for each shape the spec supports (one
per change of the anchors over 2026) and one where upstream merged its own
apply_fp32_lm_head. Here: what lands on disk, the statuses and exit codes, and what the
inserted code does when NeMo-RL runs it: the patched files are imported and their
functions called with Megatron, Ray and vLLM doubles and the real
fp32patch.runtime.nemo_rl (real megatron-core and vLLM runs are the runtime's heavy
suites). The opt-in test at the end runs over a real NeMo-RL checkout.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
from collections import namedtuple
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from fp32patch.patcher.spec import load_specs
from tests.fixtures.nemo_rl_shapes import (
    ASYNC_WORKER,
    DTENSOR,
    DTENSOR_V2,
    GENERATION,
    MERGED,
    MODEL_UTILS,
    NEWEST_SHAPES,
    PATCHES,
    SETUP,
    SHAPES,
    TRAIN,
    WORKER,
    checkout,
    files_at,
)
from tests.nemo_rl_harness import cli, load_module

PATCH_ID = "nemo-rl-fp32-lm-head"
CONTEXT_ID = "nemo-rl-context-length-400"
POLICY = "nemo_rl/models/policy/lm_policy.py"
BACKEND = "nemo_rl/models/generation/vllm/vllm_backend.py"
FILES = [SETUP, POLICY, BACKEND, WORKER, ASYNC_WORKER, GENERATION, PATCHES, DTENSOR, DTENSOR_V2, MODEL_UTILS, TRAIN]
FUSED_EDITS = {"fused-logprobs", "fused-temperature", "fused-temperature-once"}
UTILS = "nemo_rl/models/policy/utils.py"  # patched on checkouts after the September 2026 rework
VAR = "NRL_VLLM_FP32_LM_HEAD"

ENGINE_V2 = (resources.files("fp32patch.patches") / f"{PATCH_ID}.toml").is_file()
needs_engine = pytest.mark.skipif(
    not ENGINE_V2, reason="the spec waits in fp32patch/patches/pending for Engine v2 (several files per spec)"
)


def _run(command: str, root: Path, *patch_ids: str) -> tuple[int, dict]:
    """``fp32patch <command> -s root --patch ...``: exit code and this patch's outcome."""
    args = [command, "-s", str(root)]
    for patch_id in patch_ids or (PATCH_ID,):
        args += ["--patch", patch_id]
    code, data = cli(*args)
    (outcome,) = [p for p in data["patches"] if p["id"] == PATCH_ID]
    return code, outcome


def _sources(root: Path) -> dict[str, bytes]:
    """The checkout's Python files and their bytes (bytecode the engine refreshes is not source)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.py"))}


def _markers(text: str) -> set[str]:
    prefix = f"# fp32patch: {PATCH_ID} ["
    return {line.strip()[len(prefix) : -1] for line in text.splitlines() if line.strip().startswith(prefix)}


SHAPE_IDS = [f"{s.date}-{s.name}" for s in SHAPES]


# ---------------------------------------------------------------- the CLI, shape by shape


@needs_engine
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_apply_verify_revert_reapply_on_every_shape(tmp_path, shape):
    root = checkout(shape.name, tmp_path / "nemo-rl")
    before = _sources(root)

    code, out = _run("apply", root)
    assert (code, out["status"]) == (0, "applied"), out
    patched = _sources(root)
    # every file the shape has is patched, and only those (model_utils.py is left alone before it
    # had the fused path); each edit left its marker once
    unfused = shape.variant == "before-fused-logprobs"
    present = [f for f in FILES if f in before and not (unfused and f == MODEL_UTILS)]
    assert sorted(p for p in patched if patched[p] != before[p]) == sorted(present)
    edits = set().union(*(_markers(patched[f].decode()) for f in present))
    assert "wire-policy" in edits and "probe-driver" in edits and "guard-driver" in edits
    assert {"guard-dtensor", "wire-dtensor", "guard-dtensor-v2", "wire-dtensor-v2"} <= edits
    assert ("wire-inference-model" in edits) == (shape.variant == "inference-model")
    assert ("env-copy" in edits) == (PATCHES in before)
    assert ("env-copy-in-worker" in edits) == (PATCHES not in before)
    # the fused log-prob path (2026-03-19 on) and its temperature
    assert (FUSED_EDITS <= edits) == (not unfused) and not (unfused and FUSED_EDITS & edits)
    for path in present:
        compile(patched[path], path, "exec", dont_inherit=True)

    code, out = _run("verify", root)
    assert (code, out["status"]) == (0, "applied"), out
    code, out = _run("apply", root)
    assert (code, out["status"]) == (0, "already-applied"), out
    assert _sources(root) == patched

    code, out = _run("revert", root)
    assert code == 0, out
    assert _sources(root) == before  # byte for byte, every file
    code, out = _run("verify", root)
    assert (code, out["status"]) == (1, "not-applied")

    code, out = _run("apply", root)
    assert (code, out["status"]) == (0, "applied")
    assert _sources(root) == patched  # the same edits again, byte for byte


@needs_engine
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_each_shape_gets_its_own_variant(tmp_path, shape):
    root = checkout(shape.name, tmp_path / "nemo-rl")
    code, data = cli("apply", "-s", str(root), "--patch", PATCH_ID, "--dry-run")
    assert code == 0, data
    (out,) = data["patches"]
    assert (out["status"], out["variant"]) == ("would-apply", shape.variant), out


@needs_engine
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[-1]], ids=[SHAPE_IDS[0], SHAPE_IDS[-1]])
def test_together_with_the_context_length_patch(tmp_path, shape):
    # both NeMo-RL patches edit vllm_worker_async.py: one chain, applied and reverted together
    root = checkout(shape.name, tmp_path / "nemo-rl")
    before = _sources(root)
    code, data = cli("apply", "-s", str(root), "--patch", PATCH_ID, "--patch", CONTEXT_ID)
    assert code == 0, data
    assert {p["id"]: p["status"] for p in data["patches"]} == {PATCH_ID: "applied", CONTEXT_ID: "applied"}
    text = (root / ASYNC_WORKER).read_text()
    assert f"# fp32patch: {PATCH_ID} [probe-worker-async]" in text
    assert f"# fp32patch: {CONTEXT_ID} [route-overflow-400]" in text

    code, data = cli("verify", "-s", str(root))
    assert code == 0 and {p["status"] for p in data["patches"] if p["id"] in (PATCH_ID, CONTEXT_ID)} == {"applied"}

    # one patch out, the other stays
    code, data = cli("revert", "-s", str(root), "--patch", PATCH_ID)
    assert code == 0, data
    text = (root / ASYNC_WORKER).read_text()
    assert PATCH_ID not in text and f"# fp32patch: {CONTEXT_ID} [route-overflow-400]" in text
    code, data = cli("revert", "-s", str(root))
    assert code == 0, data
    assert _sources(root) == before


@needs_engine
def test_upstream_first_fp32_head_is_refused_by_name_and_nothing_is_written(tmp_path):
    """NeMo-RL's first fp32 head (2026-08-31 to the rework) is not `obsolete`: its Megatron head
    is not fp32out and its vLLM side is NemotronH only. No variant was built against its files,
    so the patch refuses it by name, says what to do, and writes nothing."""
    root = checkout(MERGED.name, tmp_path / "nemo-rl")
    before = _sources(root)
    code, out = _run("apply", root)
    assert (code, out["status"]) == (3, "unsupported-version"), out
    assert "first fp32 LM head" in out["message"] and "apply_fp32_lm_head" in out["message"]
    assert "--patch vllm-fp32-logits --patch nemotron-h-fp32-lm-head" in out["message"]
    assert _sources(root) == before
    assert not (root / ".fp32patch").exists() or not any((root / ".fp32patch").rglob("*.py"))
    code, out = _run("verify", root)
    assert (code, out["status"]) == (1, "unsupported-version")


def _replace(path: str, old: str, new: str):
    def mutate(root: Path) -> None:
        target = root / path
        text = target.read_text()
        assert text.count(old) == 1, f"the mutation's target moved: {old!r}"
        target.write_text(text.replace(old, new))

    mutate.path, mutate.old = path, old  # where it moves what, for choosing the shapes it applies to
    return mutate


# a NeMo-RL that moved an anchor: edit -> (what changed, what the refusal must name)
MUTATIONS = {
    "wire-policy": (_replace(SETUP, "    model = get_model(", "    chunks = get_model("), "get_model"),
    "wire-inference-model": (
        _replace(SETUP, "        inference_model = get_model(", "        built = get_model("),
        "build_inference_model",
    ),
    "residual": (_replace(SETUP, "model_cfg.pipeline_dtype = ", "model_cfg.pipe_dtype = "), "_apply_precision_config"),
    "guard-driver": (_replace(POLICY, "class Policy:", "class LMPolicy:"), "Policy.__init__"),
    "probe-extension": (
        _replace(BACKEND, "def report_device_id(self) -> str:", "def device_uuid(self) -> str:"),
        "report_device_id",
    ),
    "probe-driver": (
        _replace(
            GENERATION,
            "            self.device_uuids = self._report_device_id()",
            "            self.device_uuids = list(self._report_device_id())",
        ),
        "self.device_uuids = self._report_device_id()",
    ),
    "env-copy": (_replace(PATCHES, "env_vars_to_copy = [", "names_to_copy = ["), "env_vars_to_copy"),
    # a second class with an __init__ in the v1 file: which one is the worker's is not guessed
    "guard-dtensor": (
        _replace(
            DTENSOR,
            "class DTensorPolicyWorkerImpl:",
            "class _Helper:\n    def __init__(self):\n        pass\n\n\nclass DTensorPolicyWorkerImpl:",
        ),
        "*.__init__",
    ),
    "wire-dtensor": (
        _replace(DTENSOR, "        if is_tied_lm_head:\n", "        if is_tied_lm_head and self.model is not None:\n"),
        "if is_tied_lm_head",
    ),
    "guard-dtensor-v2": (
        _replace(DTENSOR_V2, "runtime_config = validate_and_prepare_config(", "runtime_config = prepare_config("),
        "validate_and_prepare_config",
    ),
    "wire-dtensor-v2": (
        _replace(
            DTENSOR_V2, "        if init_reference_model:\n", "        if init_reference_model and self.optimizer:\n"
        ),
        "if init_reference_model",
    ),
}


def _moved_cases() -> list:
    """(shape, edit) for every edit of every shape's variant that MUTATIONS can move there."""
    spec = next(s for s in load_specs() if s.id == "nemo-rl-fp32-lm-head")
    variants = {v.name: v for v in spec.variants}
    cases = []
    for shape in [*SHAPES, *NEWEST_SHAPES]:
        files = files_at(shape.name)
        for edit in variants[shape.variant].edits:
            mutate = MUTATIONS.get(edit.id, (None,))[0]
            if mutate is not None and files.get(mutate.path, "").count(mutate.old) == 1:
                cases.append(pytest.param(shape.name, edit.id, id=f"{shape.name}-{edit.id}"))
    return cases


# A checkout of any shape whose anchor moved exits 3 naming it, nothing written: never patched by
# another variant that leaves that edit out. (In the rework with DTensor v1 still there, the variant
# made for after v1's removal held in every other file and left the v1 worker's head in bf16:
# found 2026-12-06, when these cases went from the first shape to all of them.)
@needs_engine
@pytest.mark.parametrize(("shape", "edit"), _moved_cases())
def test_a_moved_anchor_exits_3_naming_it_never_left_out_by_a_variant_without_it(tmp_path, shape, edit):
    root = checkout(shape, tmp_path / "nemo-rl")
    mutate, named = MUTATIONS[edit]
    mutate(root)
    before = _sources(root)
    code, out = _run("apply", root)
    assert code == 3, out
    assert out["status"] in ("anchor-missing", "anchor-ambiguous"), out
    assert edit in out["message"] and named in out["message"], out["message"]
    assert _sources(root) == before


def test_the_moved_anchor_cases_reach_every_shape_and_every_mutation():
    cases = {(p.values[0], p.values[1]) for p in _moved_cases()}
    assert {edit for shape, edit in cases if shape == SHAPES[0].name} == set(MUTATIONS)
    for shape in [*SHAPES, *NEWEST_SHAPES]:
        assert sum(s == shape.name for s, _ in cases) >= 7, shape.name
    for shape in NEWEST_SHAPES:
        assert (shape.name, "wire-dtensor-v2") in cases
        assert ((shape.name, "wire-dtensor") in cases) == (shape.variant == "logit-dtype"), shape.name


# The older variants hold only where a def is absent (an older checkout, not a newer one whose
# anchor moved): that def however it is spelled. Before, a def written `name (` let a newer
# checkout fall back to an older variant that leaves its inference model unwired or its deferred
# start unprobed (found by the anchor-property cases).
DEF_SPELLINGS = {"space": "{name} (", "continuation": "{name} \\\n        (", "tab": "{name}\t("}
FALLBACKS = {
    # shape, the def the older variants must not find, and the anchor moved out of it
    "wire-inference-model": (SHAPES[0].name, SETUP, "build_inference_model", MUTATIONS["wire-inference-model"][0]),
    "probe-driver": (
        next(s.name for s in SHAPES if s.variant == "env-in-worker"),
        GENERATION,
        "load_and_start",
        _replace(
            GENERATION,
            "        self._post_init()\n        self.device_uuids = self._report_device_id()",
            "        self._post_init()\n        self.device_uuids = list(self._report_device_id())",
        ),
    ),
}


@needs_engine
@pytest.mark.parametrize("spelling", DEF_SPELLINGS)
@pytest.mark.parametrize("edit", FALLBACKS)
def test_a_moved_anchor_beside_a_def_spelled_otherwise_is_refused_not_patched_by_an_older_variant(
    tmp_path, edit, spelling
):
    shape, path, name, move_anchor = FALLBACKS[edit]
    root = checkout(shape, tmp_path / "nemo-rl")
    _replace(path, f"def {name}(", "def " + DEF_SPELLINGS[spelling].format(name=name))(root)
    move_anchor(root)
    compile((root / path).read_text(), path, "exec")
    before = _sources(root)
    code, out = _run("apply", root)
    assert code == 3, out
    assert out["status"] == "anchor-missing", out
    assert edit in out["message"], out["message"]
    assert _sources(root) == before


@needs_engine
def test_a_missing_second_file_is_named(tmp_path):
    root = checkout(SHAPES[0].name, tmp_path / "nemo-rl")
    (root / POLICY).unlink()
    before = _sources(root)
    code, out = _run("apply", root)
    assert code == 3, out
    assert POLICY in out["message"]
    assert _sources(root) == before


@needs_engine
def test_without_megatron_setup_nemo_rl_is_not_installed(tmp_path):
    root = checkout(SHAPES[0].name, tmp_path / "nemo-rl")
    (root / SETUP).unlink()
    code, out = _run("verify", root)
    assert out["status"] == "not-installed", out


# ---------------------------------------------------------------- running the patched code

needs_runtime = pytest.mark.skipif(
    importlib.util.find_spec("fp32patch.runtime.nemo_rl") is None,
    reason="fp32patch.runtime.nemo_rl (branch nrt) is not merged yet",
)


def patched_checkouts(shapes, tmp_path_factory) -> dict[str, Path]:
    """Each of ``shapes`` checked out and patched once by the CLI, by shape name."""
    roots = {}
    for shape in shapes:
        root = checkout(shape.name, tmp_path_factory.mktemp(shape.name))
        code, out = _run("apply", root)
        assert code == 0, out
        roots[shape.name] = root
    return roots


@pytest.fixture(scope="module")
def patched_roots(tmp_path_factory) -> dict[str, Path]:
    """Every shape, patched once by the CLI, for the tests that import and run it."""
    if not ENGINE_V2:
        pytest.skip("the spec waits in fp32patch/patches/pending for Engine v2 (several files per spec)")
    return patched_checkouts(SHAPES, tmp_path_factory)


def _module(name: str, **attrs: Any) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(attrs)
    return module


def _install(monkeypatch, modules: dict[str, ModuleType]) -> None:
    for name, module in modules.items():
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent not in sys.modules:
                monkeypatch.setitem(sys.modules, parent, _module(parent))
        monkeypatch.setitem(sys.modules, name, module)


# -- Megatron doubles: get_model builds chunks, runs the pre-wrap hooks, wraps each chunk


class Float16Module(torch.nn.Module):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module


class DistributedDataParallel(Float16Module):
    pass


@dataclass
class ModelProvider:
    """Megatron-Bridge's model provider (a TransformerConfig): the fields NeMo-RL sets here."""

    stages: tuple[bool, ...] = (True,)  # post_process of each virtual-pipeline chunk
    tensor_model_parallel_size: int = 1
    recompute_granularity: str | None = "full"
    bf16: bool = False
    fp16: bool = False
    params_dtype: Any = None
    pipeline_dtype: Any = None
    fp32_residual_connection: bool = False


@dataclass
class GetModel:
    """megatron.bridge's get_model: build, run the pre-wrap hooks, wrap; records each call."""

    calls: list[dict] = field(default_factory=list)

    def __call__(self, provider, ddp_config, *, pre_wrap_hook=(), mixed_precision_wrapper=Float16Module, **kwargs):
        from tests.test_megatron_lm_head_unit import Model

        torch.manual_seed(len(self.calls))
        chunks = [Model(post_process=stage) for stage in provider.stages]
        for hook in pre_wrap_hook:
            chunks = hook(chunks)
        chunks = [mixed_precision_wrapper(c) for c in chunks]
        if kwargs.get("wrap_with_ddp", True):
            chunks = [DistributedDataParallel(c) for c in chunks]
        self.calls.append({"provider": provider, "chunks": chunks, **kwargs})
        return chunks


def megatron_doubles(monkeypatch, provider: ModelProvider) -> GetModel:
    get_model = GetModel()
    bridge = SimpleNamespace(to_megatron_provider=lambda: provider)
    _install(
        monkeypatch,
        {
            "megatron.bridge": _module(
                "megatron.bridge", AutoBridge=SimpleNamespace(from_hf_pretrained=lambda name: bridge)
            ),
            "megatron.bridge.models.model_provider": _module(
                "megatron.bridge.models.model_provider", get_model=get_model
            ),
            "megatron.core.transformer.module": _module(
                "megatron.core.transformer.module", Float16Module=Float16Module
            ),
        },
    )
    return get_model


def policy_cfg(fp32_lm_head: Any = None, env: str | None = None, **megatron: Any) -> dict:
    """NeMo-RL's policy section, as the driver and the Megatron workers receive it."""
    megatron_cfg = {
        "enabled": True,
        "freeze_moe_router": False,
        "pipeline_dtype": "bfloat16",
        "sequence_parallel": False,
        "tensor_model_parallel_size": 1,
        **megatron,
    }
    if fp32_lm_head is not None:
        megatron_cfg["fp32_lm_head"] = fp32_lm_head
    env_vars = {} if env is None else {VAR: env}
    return {
        "model_name": "tiny",
        "precision": "bfloat16",
        "megatron_cfg": megatron_cfg,
        "generation": {"backend": "vllm", "colocated": {"enabled": True}, "vllm_cfg": {"env_vars": env_vars}},
    }


def _heads(chunks) -> list:
    from fp32patch.runtime.megatron_lm_head import _output_layer

    return [layer for layer in (_output_layer(c) for c in chunks) if layer is not None]


@needs_runtime
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("mode", [True, "fp32out", "tf32"])
def test_policy_chunks_get_the_fp32_head_after_every_pre_wrap_hook(monkeypatch, patched_roots, shape, mode):
    from fp32patch.runtime.megatron_lm_head import fp32_lm_head_mode
    from tests.test_megatron_lm_head_unit import Nest

    monkeypatch.delenv(VAR, raising=False)
    # two virtual-pipeline chunks, the head on the last; a hook (PEFT, value head) rewraps each chunk
    provider = ModelProvider(stages=(False, True))
    megatron_doubles(monkeypatch, provider)
    setup = load_module(patched_roots[shape.name] / SETUP)
    cfg = SimpleNamespace(model=provider, ddp=None)
    hook_seen = []

    def adapter_hook(chunks):
        hook_seen.append(len(chunks))
        return [Nest("module", c) for c in chunks]

    state = setup.setup_model_and_optimizer(policy_cfg(mode, env="1"), cfg, additional_pre_wrap_hooks=[adapter_hook])
    assert hook_seen == [2]
    (head,) = _heads(state.chunks)
    assert fp32_lm_head_mode(head) == ("fp32" if mode is True else mode)
    x = torch.randn(2, 8).bfloat16()
    assert head(x)[0].dtype == torch.float32


@needs_runtime
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_without_the_keys_the_stock_path_runs_and_fp32patch_is_not_imported(monkeypatch, patched_roots, shape):
    monkeypatch.delenv(VAR, raising=False)
    provider = ModelProvider()
    megatron_doubles(monkeypatch, provider)
    # an image without fp32patch in the Megatron venv: any import of the runtime would fail
    monkeypatch.setitem(sys.modules, "fp32patch.runtime.nemo_rl", None)
    setup = load_module(patched_roots[shape.name] / SETUP)
    cfg = SimpleNamespace(model=provider, ddp=None)
    state = setup.setup_model_and_optimizer(policy_cfg(), cfg)
    (head,) = _heads(state.chunks)
    assert "_forward_impl" not in head.__dict__
    assert head(torch.randn(2, 8).bfloat16())[0].dtype == torch.bfloat16
    model_cfg, _ = setup.validate_and_set_config(policy_cfg(), 0, "tiny", None, None, None)
    assert model_cfg.fp32_residual_connection is False


@needs_runtime
def test_a_config_that_asks_without_fp32patch_says_to_install_it(monkeypatch, patched_roots):
    monkeypatch.delenv(VAR, raising=False)
    megatron_doubles(monkeypatch, ModelProvider())
    monkeypatch.setitem(sys.modules, "fp32patch.runtime.nemo_rl", None)
    setup = load_module(patched_roots[SHAPES[0].name] / SETUP)
    with pytest.raises(RuntimeError, match=r"megatron worker rank 2: .*install fp32patch into every one"):
        setup.validate_and_set_config(policy_cfg("fp32", env="1"), 2, "tiny", None, None, None)


@needs_runtime
def test_the_inference_model_of_colocated_megatron_generation_is_wired(monkeypatch, patched_roots):
    from fp32patch.runtime.megatron_lm_head import fp32_lm_head_mode

    get_model = megatron_doubles(monkeypatch, ModelProvider())
    setup = load_module(patched_roots[SHAPES[0].name] / SETUP)
    # NeMo-RL hands it the inference config: megatron_cfg merged with mcore_generation_config
    cfg = policy_cfg("fp32out", env="1", tensor_model_parallel_size=2)
    model = setup.build_inference_model(cfg, SimpleNamespace(ddp=None), ModelProvider())
    assert get_model.calls[-1]["wrap_with_ddp"] is False
    (head,) = _heads([model])
    assert fp32_lm_head_mode(head) == "fp32out"


@needs_runtime
def test_reference_logprobs_swap_weights_into_the_wired_model(monkeypatch, patched_roots):
    # NeMo-RL keeps the reference model as a state dict and loads it into the policy model
    # for reference log-probs: the fp32 head must survive the swap and compute with its weights
    provider = ModelProvider()
    megatron_doubles(monkeypatch, provider)
    setup = load_module(patched_roots[SHAPES[0].name] / SETUP)
    stock = setup.setup_model_and_optimizer(policy_cfg(), SimpleNamespace(model=provider, ddp=None))
    wired = setup.setup_model_and_optimizer(policy_cfg("fp32", env="1"), SimpleNamespace(model=provider, ddp=None))
    assert wired.model.state_dict().keys() == stock.model.state_dict().keys()

    reference = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in stock.model.state_dict().items()}
    wired.model.load_state_dict(reference)
    (head,) = _heads([wired.model])
    x = torch.randn(3, 8).bfloat16()
    logits = head(x)[0]
    assert logits.dtype == torch.float32
    expected = x.double() @ head.weight.double().t()
    assert torch.allclose(logits.double(), expected, rtol=1e-6, atol=1e-6)
    (weight,) = [v for k, v in reference.items() if k.endswith("output_layer.weight")]
    assert torch.equal(head.weight, weight)


@needs_runtime
@pytest.mark.parametrize(
    ("cfg", "fragments"),
    [
        (policy_cfg("fp32"), ["megatron worker rank 3", "vllm_cfg.fp32_lm_head is not set"]),
        (policy_cfg(env="1"), ["megatron worker rank 3", "fp32_lm_head"]),
        (policy_cfg(fp32_lm_heads=True, env="1"), ["megatron worker rank 3", "policy.megatron_cfg.fp32_lm_head"]),
        (
            policy_cfg(
                "fp32", env="1", fp32_residual_connection=True, model_overrides={"fp32_residual_connection": False}
            ),
            ["model_overrides", "fp32_residual_connection"],
        ),
        (policy_cfg(fp32_residual_connection="yes"), ["fp32_residual_connection", "true or false"]),
    ],
    ids=["megatron-only", "vllm-only", "near-miss-key", "residual-set-twice", "residual-not-a-bool"],
)
def test_each_megatron_worker_refuses_a_bad_config_before_building(monkeypatch, patched_roots, cfg, fragments):
    from fp32patch.runtime.nemo_rl import Fp32LmHeadConfigError

    monkeypatch.delenv(VAR, raising=False)
    get_model = megatron_doubles(monkeypatch, ModelProvider())
    setup = load_module(patched_roots[SHAPES[-1].name] / SETUP)
    with pytest.raises(Fp32LmHeadConfigError) as info:
        setup.validate_and_set_config(cfg, 3, "tiny", None, None, None)
    for fragment in fragments:
        assert fragment in str(info.value)
    assert get_model.calls == []


@needs_runtime
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("residual", [True, False])
def test_fp32_residual_connection_reaches_the_transformer_config(monkeypatch, patched_roots, shape, residual):
    monkeypatch.delenv(VAR, raising=False)
    megatron_doubles(monkeypatch, ModelProvider(fp32_residual_connection=not residual))
    setup = load_module(patched_roots[shape.name] / SETUP)
    model_cfg, _ = setup.validate_and_set_config(
        policy_cfg("fp32", env="1", fp32_residual_connection=residual), 0, "tiny", None, None, None
    )
    assert model_cfg.fp32_residual_connection is residual
    assert model_cfg.pipeline_dtype == torch.bfloat16  # NeMo-RL's own precision settings stay


# -- the driver's guard


@dataclass
class Cluster:
    """The driver's Ray cluster: records the workers started, builds them with ``build``."""

    build: Any = None
    started: list[str] = field(default_factory=list)

    def start_workers(self, builder: str, config: dict, name_prefix: str = ""):
        self.started.append(builder)
        return self.build(config) if self.build is not None else None


@needs_runtime
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[-1]], ids=[SHAPE_IDS[0], SHAPE_IDS[-1]])
def test_the_driver_refuses_a_one_sided_config_before_any_policy_worker_starts(monkeypatch, patched_roots, shape):
    from fp32patch.runtime.nemo_rl import Fp32LmHeadConfigError

    monkeypatch.delenv(VAR, raising=False)
    lm_policy = load_module(patched_roots[shape.name] / POLICY)
    cluster = Cluster()
    with pytest.raises(Fp32LmHeadConfigError, match=r"fp32patch \(driver\).*vllm_cfg.fp32_lm_head is not set"):
        lm_policy.Policy(cluster, policy_cfg("fp32"), tokenizer=None)
    with pytest.raises(Fp32LmHeadConfigError, match=r"fp32patch \(driver\).*fp32_lm_head"):
        lm_policy.Policy(cluster, policy_cfg(fp32lmhead=True, env="1"), tokenizer=None)
    assert cluster.started == []

    lm_policy.Policy(cluster, policy_cfg("fp32", env="1"), tokenizer=None)
    lm_policy.Policy(cluster, policy_cfg(), tokenizer=None)
    assert len(cluster.started) == 2


# -- vLLM doubles: a generation actor's engine runs NeMo-RL's extension in each worker

# A vLLM model file in the shape the runtime reads: its compute_logits routes through
# fp32patch's runtime where a fp32patch edit put that route, as the vLLM specs do.
_VLLM_MODEL = """
import os

import torch

# the benchmark's vLLM-shaped head and processor (an unquantized head, stock processor)
from bench.lm_head import LmHead, LogitsProcessor


class TinyForCausalLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.norm = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
        self.lm_head = LmHead((torch.randn(16, 8, generator=gen) * 0.1).bfloat16())
        self.logits_processor = LogitsProcessor()

    def compute_logits(self, hidden_states):
ROUTE
        return self.logits_processor(self.lm_head, hidden_states)
"""
_ROUTE = """\
        # fp32patch: test-vllm-model [route]
        if os.environ.get("NRL_VLLM_FP32_LM_HEAD", "") not in ("", "0"):
            from fp32patch.runtime import vllm_lm_head

            return vllm_lm_head.compute_logits(self, hidden_states)
"""


def vllm_model_class(tmp_path: Path, monkeypatch, *, patched: bool) -> type:
    name = f"_tiny_vllm_model_{'patched' if patched else 'stock'}_{abs(hash(tmp_path))}"
    path = tmp_path / f"{name}.py"
    path.write_text(_VLLM_MODEL.replace("ROUTE\n", _ROUTE if patched else ""))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # the probe reads the class's file
    spec.loader.exec_module(module)
    return module.TinyForCausalLM


@dataclass
class Engine:
    """vLLM's LLM (or AsyncLLM): collective_rpc runs a method of NeMo-RL's extension in
    every worker, each with the environment its own process would have."""

    workers: list[Any]
    environments: list[dict[str, str]]

    def _call(self, method: str, args: tuple) -> list:
        results = []
        for worker, environment in zip(self.workers, self.environments, strict=True):
            saved = os.environ.get(VAR)
            os.environ.pop(VAR, None)
            os.environ.update(environment)
            try:
                results.append(getattr(worker, method)(*args))
            finally:
                os.environ.pop(VAR, None)
                if saved is not None:
                    os.environ[VAR] = saved
        return results

    def collective_rpc(self, method: str, args: tuple = ()):
        return self._call(method, args)


class AsyncEngine(Engine):
    async def collective_rpc(self, method: str, args: tuple = ()):
        return self._call(method, args)


@dataclass
class WorkerGroup:
    actors: list[Any]

    def run_all_workers_single_data(self, method: str, run_rank_0_only_axes=None):
        return [getattr(actor, method)() for actor in self.actors]


def ray_double() -> ModuleType:
    def get(futures):
        items = futures if isinstance(futures, list) else [futures]
        done = [asyncio.run(f) if inspect.isawaitable(f) else f for f in items]
        return done if isinstance(futures, list) else done[0]

    return _module("ray", get=get)


def generation_cfg(env: str | None, async_engine: bool) -> dict:
    return {
        "backend": "vllm",
        "vllm_cfg": {"async_engine": async_engine, "env_vars": {} if env is None else {VAR: env}},
    }


def start_generation(monkeypatch, tmp_path, root: Path, *, cfg: dict, engines: list[list[dict]], patched_model=True):
    """NeMo-RL's VllmGeneration on the patched checkout ``root``: one actor per engine, each
    engine with one vLLM worker per environment in ``engines``."""
    monkeypatch.setitem(sys.modules, "ray", ray_double())
    model_class = vllm_model_class(tmp_path, monkeypatch, patched=patched_model)
    backend = load_module(root / BACKEND)
    async_engine = cfg["vllm_cfg"]["async_engine"]
    actor_module = load_module(root / (ASYNC_WORKER if async_engine else WORKER))
    actor_class = next(
        v
        for v in vars(actor_module).values()
        if isinstance(v, type) and hasattr(v, "report_device_id_async" if async_engine else "report_device_id")
    )

    def actor(environments: list[dict]) -> Any:
        workers = []
        for index in range(len(environments)):
            worker = backend.VllmInternalWorkerExtension()
            worker.model_runner = SimpleNamespace(model=model_class())
            worker.device = SimpleNamespace(index=index)
            workers.append(worker)
        engine = (AsyncEngine if async_engine else Engine)(workers, environments)
        return actor_class(engine) if async_engine else actor_class(cfg, engine)

    cluster = Cluster(build=lambda config: WorkerGroup([actor(envs) for envs in engines]))
    generation = load_module(root / GENERATION)
    return generation.VllmGeneration(cluster, cfg)


@needs_runtime
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("async_engine", [False, True], ids=["sync", "async"])
def test_the_probe_passes_when_every_vllm_worker_computes_fp32(
    monkeypatch, tmp_path, patched_roots, shape, async_engine, caplog
):
    monkeypatch.delenv(VAR, raising=False)
    caplog.set_level("INFO", logger="nemo_rl.fp32patch")
    generation = start_generation(
        monkeypatch,
        tmp_path,
        patched_roots[shape.name],
        cfg=generation_cfg("1", async_engine),
        engines=[[{VAR: "1"}, {VAR: "1"}], [{VAR: "1"}, {VAR: "1"}]],  # DP=2 engines of TP=2
    )
    assert generation.device_uuids == [["GPU-0", "GPU-1"], ["GPU-0", "GPU-1"]]
    lines = [r.getMessage() for r in caplog.records if r.name == "nemo_rl.fp32patch"]
    assert len(lines) == 1 and "4 vLLM worker(s) compute float32 logits" in lines[0], lines
    # the driver knows the vLLM switch, not Megatron's mode: the line names what asked
    assert f"as {VAR}='1' in policy.generation.vllm_cfg.env_vars asks" in lines[0], lines
    assert "Megatron fp32_lm_head=" not in lines[0]


@needs_runtime
def test_the_probe_names_the_drivers_environment_when_the_config_has_no_switch(
    monkeypatch, tmp_path, patched_roots, caplog
):
    monkeypatch.setenv(VAR, "fp32out")
    caplog.set_level("INFO", logger="nemo_rl.fp32patch")
    start_generation(
        monkeypatch,
        tmp_path,
        patched_roots[SHAPES[0].name],
        cfg=generation_cfg(None, False),
        engines=[[{VAR: "fp32out"}]],
    )
    lines = [r.getMessage() for r in caplog.records if r.name == "nemo_rl.fp32patch"]
    assert len(lines) == 1 and f"as {VAR}='fp32out' in the driver's environment asks" in lines[0], lines


@needs_runtime
@pytest.mark.parametrize("async_engine", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("cfg_env", "worker_envs", "patched_model", "fragments"),
    [
        # NeMo-RL before it read vllm_cfg.env_vars: the variable never reached one worker
        (
            "1",
            [{VAR: "1"}, {}],
            True,
            ["vLLM worker 1", f"while {VAR}='1' in policy.generation.vllm_cfg.env_vars: ", "unset in that process"],
        ),
        # the vLLM venv was left unpatched: the model's compute_logits is vLLM's own
        ("1", [{VAR: "1"}, {VAR: "1"}], False, ["vLLM worker 0", "vLLM worker 1", "not patched"]),
        # vLLM workers in fp32 while the config (and so Megatron) is off
        (
            "0",
            [{VAR: "1"}, {VAR: "0"}],
            True,
            [
                "vLLM worker 0 ",
                f"while {VAR}='0' in policy.generation.vllm_cfg.env_vars: ",
                "generate from fp32 logits all the same",
            ],
        ),
    ],
    ids=["variable-missing-in-a-worker", "unpatched-vllm", "vllm-fp32-megatron-off"],
)
def test_the_probe_refuses_each_disagreement_naming_the_worker(
    monkeypatch, tmp_path, patched_roots, async_engine, cfg_env, worker_envs, patched_model, fragments
):
    from fp32patch.runtime.nemo_rl import Fp32LmHeadMismatchError

    if cfg_env == "0":
        monkeypatch.setenv(VAR, "1")  # the driver's environment asks; the config's env_vars say 0
    else:
        monkeypatch.delenv(VAR, raising=False)
    with pytest.raises(Fp32LmHeadMismatchError) as info:
        start_generation(
            monkeypatch,
            tmp_path,
            patched_roots[SHAPES[0].name],
            cfg=generation_cfg(cfg_env, async_engine),
            engines=[worker_envs],
            patched_model=patched_model,
        )
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


@needs_runtime
def test_without_the_variable_the_probe_never_runs(monkeypatch, tmp_path, patched_roots):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setitem(sys.modules, "fp32patch.runtime.nemo_rl", None)  # fp32patch absent
    generation = start_generation(
        monkeypatch, tmp_path, patched_roots[SHAPES[0].name], cfg=generation_cfg(None, False), engines=[[{}]]
    )
    assert generation.device_uuids == [["GPU-0"]]


@needs_runtime
def test_the_probe_method_is_the_runtimes_rpc_name(patched_roots):
    from fp32patch.runtime.nemo_rl import PROBE_RPC

    backend = load_module(patched_roots[SHAPES[0].name] / BACKEND)
    assert callable(getattr(backend.VllmInternalWorkerExtension, PROBE_RPC))


# -- the variable reaches vLLM's v1 Ray executor


@pytest.mark.parametrize("shape", [s for s in SHAPES if s.variant == "inference-model"], ids=lambda s: s.date)
def test_the_variable_is_named_for_vllms_ray_workers(monkeypatch, patched_roots, shape):
    monkeypatch.delenv("VLLM_RAY_EXTRA_ENV_VARS_TO_COPY", raising=False)
    patches = load_module(patched_roots[shape.name] / PATCHES)
    patches._patch_vllm_init_workers_ray("/venvs/vllm/bin/python", ["VLLM_QUANT_CFG"])
    names = os.environ["VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"].split(",")
    assert VAR in names and "VLLM_QUANT_CFG" in names


# vLLM's v1 Ray executor line that NeMo-RL rewrote before vLLM 0.25 (vLLM's own text)
_EXECUTOR = 'ADDITIONAL_ENV_VARS = {"HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"}\nself._init_workers_ray(placement_group)\n'


@pytest.mark.parametrize(
    "shape", [s for s in SHAPES if s.variant not in ("inference-model", "env-vars-to-copy")], ids=lambda s: s.name
)
@pytest.mark.parametrize("extra", [[], ["VLLM_QUANT_CFG"]], ids=["no-extra", "extra"])
def test_the_variable_joins_vllms_executor_line(tmp_path, patched_roots, shape, extra):
    executor = tmp_path / "vllm" / "v1" / "executor" / "ray_executor.py"
    executor.parent.mkdir(parents=True)
    executor.write_text(_EXECUTOR)
    root = patched_roots[shape.name]
    if (root / PATCHES).exists():
        patches = load_module(root / PATCHES)
        patches.VLLM_DIR = str(tmp_path / "vllm")
        patches._patch_vllm_init_workers_ray("/venvs/vllm/bin/python", extra)
    else:
        worker = load_module(root / WORKER)
        actor = worker.BaseVllmGenerationWorker({}, None)
        actor._apply_vllm_patches(str(tmp_path / "vllm"), "/venvs/vllm/bin/python", extra)
    line = executor.read_text().splitlines()[0]
    namespace: dict = {}
    exec(line, namespace)  # the rewritten line is still Python, and a set of names
    assert VAR in namespace["ADDITIONAL_ENV_VARS"]
    if shape is not SHAPES[-1]:  # the January line was a literal: no extra names yet
        assert set(extra) <= namespace["ADDITIONAL_ENV_VARS"]


# -- DTensor doubles: transformers' auto classes, NeMo-RL's sharding and Automodel's setup

HIDDEN, VOCAB = 16, 48


class TinyCausalLM(torch.nn.Module):
    """A Hugging Face causal LM as the DTensor workers meet it: a ``config``, ``lm_head`` (an
    ``nn.Linear``) found by ``get_output_embeddings()``, ``tie_weights()``."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.body = torch.nn.Linear(HIDDEN, HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()

    @classmethod
    def from_config(cls, config: SimpleNamespace, **kwargs: Any) -> torch.nn.Module:
        torch.manual_seed(1)  # an empty model's weights: the checkpoint's replace them
        return cls(config)

    @classmethod
    def from_pretrained(cls, name: str, config: SimpleNamespace, **kwargs: Any) -> torch.nn.Module:
        torch.manual_seed(0)  # the checkpoint
        return cls(config)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head

    def tie_weights(self) -> None:
        self.lm_head.weight = self.embed_tokens.weight

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.embed_tokens(ids)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(ids))


class TinyRewardModel(TinyCausalLM):
    """A sequence classifier: a score head, no LM head (``get_output_embeddings()`` is None)."""

    def __init__(self, config: SimpleNamespace) -> None:
        torch.nn.Module.__init__(self)
        self.config = config
        self.embed_tokens = torch.nn.Embedding(VOCAB, HIDDEN)
        self.body = torch.nn.Linear(HIDDEN, HIDDEN)
        self.score = torch.nn.Linear(HIDDEN, config.num_labels, bias=False)

    def get_output_embeddings(self) -> None:
        return None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.score(self.hidden(ids)[:, -1])


def _tiny_config(name: str, **kwargs: Any) -> SimpleNamespace:
    return SimpleNamespace(model_type="tiny", tie_word_embeddings=name.endswith("-tied"), num_labels=2)


def _sharded(model: torch.nn.Module, param_dtype: torch.dtype, **kwargs: Any) -> torch.nn.Module:
    # FSDP2's mixed precision hands the head its weight in param_dtype at compute time
    return model.to(param_dtype)


def _build(config: dict) -> tuple[torch.nn.Module, bool]:
    """What both workers do to build a model: the class, the checkpoint, the sharding, the tie."""
    model_config = _tiny_config(config["model_name"])
    reward = "reward_model_cfg" in config and config["reward_model_cfg"]["enabled"]
    model_class = TinyRewardModel if reward else TinyCausalLM
    if reward:
        model_config.num_labels = 1
    state = model_class.from_pretrained(config["model_name"], config=model_config).state_dict()
    model = _sharded(model_class.from_config(model_config), torch.bfloat16)
    model.load_state_dict(state)
    if model_config.tie_word_embeddings:
        model.tie_weights()
    return model, reward


@dataclass
class Builds:
    """What the doubles were asked to do, in order (a refused config builds nothing)."""

    calls: list[str] = field(default_factory=list)


def dtensor_doubles(monkeypatch) -> Builds:
    builds = Builds()
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda **kwargs: builds.calls.append("init"))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: int(os.environ.get("RANK", "0")))
    runtime_config_type = namedtuple("RuntimeConfig", "model_class dtype cpu_offload is_reward_model")

    def from_pretrained(name: str, **kwargs: Any) -> SimpleNamespace:
        builds.calls.append("config")
        return _tiny_config(name)

    def validate_and_prepare_config(config: dict, processor: Any, rank: int):
        builds.calls.append("validate")
        reward = "reward_model_cfg" in config and config["reward_model_cfg"]["enabled"]
        return runtime_config_type(TinyRewardModel if reward else TinyCausalLM, torch.bfloat16, False, reward)

    def setup_model_and_optimizer(config: dict, runtime_config: Any, **kwargs: Any) -> tuple:
        builds.calls.append("model")
        model, reward = _build(config)
        return model, None, None, reward, type(model), model.config

    def parallelize(model: torch.nn.Module, param_dtype: torch.dtype, **kwargs: Any) -> torch.nn.Module:
        builds.calls.append("model")
        return _sharded(model, param_dtype)

    _install(
        monkeypatch,
        {
            "ray": _module("ray", remote=lambda **kwargs: lambda cls: cls),
            "transformers": _module(
                "transformers",
                AutoConfig=SimpleNamespace(from_pretrained=from_pretrained),
                AutoModelForSequenceClassification=TinyRewardModel,
            ),
            "nemo_rl.models.policy.utils": _module(
                "nemo_rl.models.policy.utils",
                get_runtime_env_for_policy_worker=lambda name: {},
                resolve_model_class=lambda model_type: TinyCausalLM,
            ),
            "nemo_rl.models.dtensor.parallelize": _module(
                "nemo_rl.models.dtensor.parallelize", _parallelize_model=parallelize
            ),
            "nemo_rl.models.automodel.setup": _module(
                "nemo_rl.models.automodel.setup",
                validate_and_prepare_config=validate_and_prepare_config,
                setup_distributed=lambda config, runtime_config: SimpleNamespace(device_mesh=None),
                setup_model_and_optimizer=setup_model_and_optimizer,
                setup_reference_model_state=lambda model: {
                    k: v.detach().clone() for k, v in model.state_dict().items()
                },
            ),
        },
    )
    return builds


# which worker: (its file, its remote class, the name its config check gives)
DTENSOR_WORKERS = {
    "v1": (DTENSOR, "DTensorPolicyWorker", "dtensor worker rank"),
    "v2": (DTENSOR_V2, "DTensorPolicyWorkerV2", "dtensor v2 worker rank"),
}


def dtensor_policy_cfg(
    fp32_lm_head: Any = None, *, model: str = "tiny", reward: bool = False, generation: dict | None = None, **dtensor
) -> dict:
    """NeMo-RL's policy section for a DTensor worker (no generation: SFT, DPO, a reward model)."""
    dtensor_cfg = {
        "enabled": True,
        "cpu_offload": False,
        "tensor_parallel_size": 1,
        "sequence_parallel": False,
        "activation_checkpointing": False,
        **dtensor,
    }
    if fp32_lm_head is not None:
        dtensor_cfg["fp32_lm_head"] = fp32_lm_head
    cfg = {
        "model_name": model,
        "precision": "bfloat16",
        "dtensor_cfg": dtensor_cfg,
        "megatron_cfg": {"enabled": False},
        "generation": generation,
    }
    if reward:
        cfg["reward_model_cfg"] = {"enabled": True, "reward_model_type": "bradley_terry"}
    return cfg


def start_dtensor_worker(root: Path, which: str, cfg: dict) -> Any:
    """The DTensor policy worker ``which`` of the patched checkout ``root``, built from ``cfg``
    (the doubles installed: ``dtensor_doubles``)."""
    path, remote, _ = DTENSOR_WORKERS[which]
    worker_class = getattr(load_module(root / path), remote)
    return worker_class(cfg, tokenizer=None) if which == "v1" else worker_class(cfg)


def _reference_logits(model: TinyCausalLM, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.hidden(ids).double() @ model.lm_head.weight.double().t()


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3))


@needs_runtime
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("which", DTENSOR_WORKERS)
@pytest.mark.parametrize("model", ["tiny", "tiny-tied"])
def test_the_dtensor_policy_gets_the_fp32_head_once_built(monkeypatch, patched_roots, shape, which, model, caplog):
    from fp32patch.runtime.hf_lm_head import fp32_lm_head_mode

    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setenv("RANK", "0")
    caplog.set_level("INFO", logger="nemo_rl.fp32patch")
    builds = dtensor_doubles(monkeypatch)
    worker = start_dtensor_worker(patched_roots[shape.name], which, dtensor_policy_cfg("fp32out", model=model))
    assert "model" in builds.calls
    assert fp32_lm_head_mode(worker.model) == "fp32out"
    head = worker.model.get_output_embeddings()
    assert head.weight.dtype == torch.bfloat16  # the weight stays as the sharding made it
    assert (head.weight is worker.model.embed_tokens.weight) == (model == "tiny-tied")  # still tied
    ids = _ids()
    logits = worker.logits(ids)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits.double(), _reference_logits(worker.model, ids), rtol=1e-5, atol=1e-5)
    lines = [r.getMessage() for r in caplog.records if r.name == "nemo_rl.fp32patch"]
    assert lines == [
        "fp32patch: the DTensor policy's LM head gives fp32 logits (mode 'fp32out'): Linear of TinyCausalLM"
    ]


_VLLM_ON = {"backend": "vllm", "colocated": {"enabled": True}, "vllm_cfg": {"env_vars": {VAR: "1"}}}
_GRPO_VLLM = {"backend": "vllm", "colocated": {"enabled": True}, "vllm_cfg": {"fp32_lm_head": True}}


@needs_runtime
@pytest.mark.parametrize("which", DTENSOR_WORKERS)
@pytest.mark.parametrize(
    "generation",
    [_GRPO_VLLM, _VLLM_ON, {**_GRPO_VLLM, "vllm_cfg": {"fp32_lm_head": True, "env_vars": {VAR: "copy"}}}],
    ids=["vllm-key", "env-var", "both-spellings"],
)
def test_a_grpo_dtensor_policy_with_vllm_on_is_wired_and_its_driver_lets_it_start(
    monkeypatch, patched_roots, which, generation
):
    # GRPO on DTensor: the trainer's switch under dtensor_cfg, vLLM's under generation
    from fp32patch.runtime.hf_lm_head import fp32_lm_head_mode

    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setenv("RANK", "0")
    dtensor_doubles(monkeypatch)
    cfg = dtensor_policy_cfg("fp32out", generation=generation)
    root = patched_roots[SHAPES[0].name]
    cluster = Cluster()
    load_module(root / POLICY).Policy(cluster, cfg, tokenizer=None)
    assert len(cluster.started) == 1
    worker = start_dtensor_worker(root, which, cfg)
    assert fp32_lm_head_mode(worker.model) == "fp32out"
    assert worker.logits(_ids()).dtype == torch.float32


@needs_runtime
def test_a_dtensor_switch_without_vllms_is_refused_by_the_driver(monkeypatch, patched_roots):
    from fp32patch.runtime.nemo_rl import Fp32LmHeadConfigError

    monkeypatch.delenv(VAR, raising=False)
    cluster = Cluster()
    policy = load_module(patched_roots[SHAPES[0].name] / POLICY)
    no_vllm = {**_GRPO_VLLM, "vllm_cfg": {}}
    with pytest.raises(Fp32LmHeadConfigError, match=r"fp32patch \(driver\): policy.dtensor_cfg.fp32_lm_head is"):
        policy.Policy(cluster, dtensor_policy_cfg("fp32out", generation=no_vllm), tokenizer=None)
    cfg = dtensor_policy_cfg("fp32out", generation=no_vllm)
    cfg["allow_one_sided_fp32_lm_head"] = True  # trainer only, asked for
    policy.Policy(cluster, cfg, tokenizer=None)
    assert len(cluster.started) == 1


@needs_runtime
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[-1]], ids=[SHAPE_IDS[0], SHAPE_IDS[-1]])
@pytest.mark.parametrize("which", DTENSOR_WORKERS)
@pytest.mark.parametrize("model", ["tiny", "tiny-tied"])
def test_a_wired_dtensor_policy_trains_at_temperature_0_7_on_a_packed_batch(
    monkeypatch, patched_roots, shape, which, model
):
    # NeMo-RL's DTensor training step: one packed sequence (batch 1), the logits divided by the
    # temperature in place, a log-prob loss, backward; equal, bit for bit, to the same step
    # done out of place, with fp32 logits and the weight gradient in the weight's dtype
    from tests.support.in_place import TEMPERATURE, assert_same_bits

    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setenv("RANK", "0")
    dtensor_doubles(monkeypatch)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))

    def step(in_place: bool) -> tuple:
        worker = start_dtensor_worker(patched_roots[shape.name], which, dtensor_policy_cfg("fp32out", model=model))
        logits = worker.model(ids)
        assert logits.dtype == torch.float32
        logits = logits.div_(TEMPERATURE) if in_place else logits / TEMPERATURE
        logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])
        (-logprobs.mean()).backward()
        head = worker.model.get_output_embeddings()
        assert head.weight.grad is not None and head.weight.grad.dtype == head.weight.dtype
        assert torch.isfinite(head.weight.grad.float()).all()
        return tuple(p.grad for p in worker.model.parameters())

    assert_same_bits(step(in_place=True), step(in_place=False))


@needs_runtime
@pytest.mark.parametrize("which", DTENSOR_WORKERS)
@pytest.mark.parametrize(("value", "mode"), [(True, "fp32"), ("tf32", "tf32"), (False, None)])
def test_the_dtensor_value_is_the_mode(monkeypatch, patched_roots, which, value, mode):
    from fp32patch.runtime.hf_lm_head import fp32_lm_head_mode

    monkeypatch.delenv(VAR, raising=False)
    dtensor_doubles(monkeypatch)
    worker = start_dtensor_worker(patched_roots[SHAPES[0].name], which, dtensor_policy_cfg(value))
    assert fp32_lm_head_mode(worker.model) == mode
    assert worker.logits(_ids()).dtype == (torch.bfloat16 if mode is None else torch.float32)


@needs_runtime
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("which", DTENSOR_WORKERS)
def test_without_the_keys_the_dtensor_workers_run_stock_and_never_import_fp32patch(
    monkeypatch, patched_roots, shape, which
):
    monkeypatch.delenv(VAR, raising=False)
    dtensor_doubles(monkeypatch)
    # an image without fp32patch in the FSDP/Automodel venvs: any import of the runtime would fail
    monkeypatch.setitem(sys.modules, "fp32patch.runtime.nemo_rl", None)
    worker = start_dtensor_worker(patched_roots[shape.name], which, dtensor_policy_cfg(model="tiny-tied"))
    head = worker.model.get_output_embeddings()
    assert "forward" not in head.__dict__
    assert worker.logits(_ids()).dtype == torch.bfloat16


@needs_runtime
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[-1]], ids=[SHAPE_IDS[0], SHAPE_IDS[-1]])
@pytest.mark.parametrize("which", DTENSOR_WORKERS)
def test_a_dtensor_reward_model_keeps_its_score_head(monkeypatch, patched_roots, shape, which, caplog):
    from fp32patch.runtime.hf_lm_head import fp32_lm_head_mode

    monkeypatch.delenv(VAR, raising=False)
    caplog.set_level("INFO", logger="nemo_rl.fp32patch")
    dtensor_doubles(monkeypatch)
    cfg = dtensor_policy_cfg("fp32out", reward=True)
    worker = start_dtensor_worker(patched_roots[shape.name], which, cfg)  # no NoLmHeadError
    assert worker._is_reward_model
    assert isinstance(worker.model, TinyRewardModel) and fp32_lm_head_mode(worker.model) is None
    assert all("forward" not in m.__dict__ for m in worker.model.modules())
    scores = worker.logits(_ids())
    assert scores.shape == (2, 1) and scores.dtype == torch.bfloat16
    (line,) = [r.getMessage() for r in caplog.records if r.name == "nemo_rl.fp32patch"]
    assert "TinyRewardModel is a reward model" in line and "keeps its stock score head" in line


@needs_runtime
@pytest.mark.parametrize("which", DTENSOR_WORKERS)
def test_dtensor_reference_logprobs_swap_weights_into_the_wired_model(monkeypatch, patched_roots, which):
    # the reference policy's weights are copied into the same module and back: the head stays
    # fp32 and computes with whichever weights are in it
    from fp32patch.runtime.hf_lm_head import fp32_lm_head_mode

    monkeypatch.delenv(VAR, raising=False)
    dtensor_doubles(monkeypatch)
    worker = start_dtensor_worker(patched_roots[SHAPES[0].name], which, dtensor_policy_cfg("fp32out"))
    with torch.no_grad():  # a training step moved the policy away from the reference
        for param in worker.model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    ids = _ids()
    trained = _reference_logits(worker.model, ids)
    head = worker.model.lm_head
    with worker.use_reference_model():
        assert torch.equal(head.weight, worker.reference_model_state_dict["lm_head.weight"])
        assert fp32_lm_head_mode(worker.model) == "fp32out"
        logits = worker.logits(ids)
        assert logits.dtype == torch.float32
        assert torch.allclose(logits.double(), _reference_logits(worker.model, ids), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(logits.double(), trained, rtol=1e-3, atol=1e-3)
    logits = worker.logits(ids)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits.double(), trained, rtol=1e-5, atol=1e-5)
    assert worker.model.lm_head is head and fp32_lm_head_mode(worker.model) == "fp32out"


@needs_runtime
@pytest.mark.parametrize("which", DTENSOR_WORKERS)
@pytest.mark.parametrize(
    ("cfg", "fragments"),
    [
        # vLLM in fp32 while the trainer's head stays bf16: refused by every version of the guard
        (dtensor_policy_cfg(generation=_VLLM_ON), [VAR]),
        pytest.param(dtensor_policy_cfg("TF32"), ["TF32", "fp32_lm_head"]),
        pytest.param(dtensor_policy_cfg(fp32LmHead=True), ["fp32LmHead", "dtensor_cfg.fp32_lm_head"]),
    ],
    ids=["vllm-only", "upper-case-mode", "near-miss-key"],
)
def test_each_dtensor_worker_refuses_a_bad_config_before_building(monkeypatch, patched_roots, which, cfg, fragments):
    from fp32patch.runtime.nemo_rl import Fp32LmHeadConfigError

    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setenv("RANK", "3")
    builds = dtensor_doubles(monkeypatch)
    for shape in (SHAPES[0], SHAPES[-1]):
        with pytest.raises(Fp32LmHeadConfigError) as info:
            start_dtensor_worker(patched_roots[shape.name], which, cfg)
        for fragment in [f"{DTENSOR_WORKERS[which][2]} 3", *fragments]:
            assert fragment in str(info.value), str(info.value)
    assert builds.calls == []  # before torch.distributed, the config, the model


@needs_runtime
@pytest.mark.parametrize("which", DTENSOR_WORKERS)
def test_a_dtensor_config_that_asks_without_fp32patch_says_to_install_it(monkeypatch, patched_roots, which):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.setenv("RANK", "2")
    dtensor_doubles(monkeypatch)
    monkeypatch.setitem(sys.modules, "fp32patch.runtime.nemo_rl", None)
    worker = DTENSOR_WORKERS[which][2]
    with pytest.raises(
        RuntimeError, match=rf"{worker} 2: .*dtensor_cfg.fp32_lm_head.*install fp32patch into every one"
    ):
        start_dtensor_worker(patched_roots[SHAPES[0].name], which, dtensor_policy_cfg("fp32out"))


@needs_runtime
@pytest.mark.parametrize(
    ("cfg", "asked"),
    [
        ({"dtensor_cfg": {"enabled": True}}, False),
        ({"dtensor_cfg": {"fp32_lm_head": False}}, True),  # present is asked: the guard reads the value
        ({"dtensor_cfg": {"fp32_lm_head": "fp32out"}}, True),
        ({"dtensor_cfg": {"FP32-LM-Head": True}}, True),  # a near miss: the guard names the right key
        ({"dtensor_cfg": {"fp32_residual_connection": True}}, False),  # Megatron's alone
        ({"megatron_cfg": {"fp32_residual_connection": True}}, True),
        ({"megatron_cfg": {"fp32_lm_head": True}}, True),
        ({"generation": {"vllm_cfg": {"fp32_lm_head": True}}}, True),
        ({"generation": {"vllm_cfg": {"fp32_lm_head": "fp32out"}}}, True),
        ({"generation": {"vllm_cfg": {"fp32_lm_head": False}}}, False),  # upstream's default
        ({"generation": {"vllm_cfg": {"fp32_lm_head": None}}}, False),
        ({"generation": {"vllm_cfg": {"env_vars": {VAR: "1"}}}}, True),
        ({"generation": {"vllm_cfg": {"env_vars": {VAR: "0"}}}}, False),
        ({"generation": None, "dtensor_cfg": None}, False),
    ],
)
def test_what_asks_for_fp32patch_in_the_dtensor_workers(monkeypatch, patched_roots, cfg, asked):
    monkeypatch.delenv(VAR, raising=False)
    dtensor_doubles(monkeypatch)
    for path in (DTENSOR, DTENSOR_V2):
        gate = load_module(patched_roots[SHAPES[0].name] / path)
        assert gate._fp32patch_asked(cfg) is asked, (path, cfg)
        # a pydantic-like config (attributes) is read the same
        as_attributes = SimpleNamespace(
            **{k: SimpleNamespace(**v) if isinstance(v, dict) else v for k, v in cfg.items()}
        )
        if "generation" not in cfg:
            assert gate._fp32patch_asked(as_attributes) is asked, (path, cfg)


# ---------------------------------------------------------------- a real NeMo-RL checkout


@needs_engine
@pytest.mark.skipif(
    not os.environ.get("FP32PATCH_NEMO_RL_CHECKOUT"),
    reason="set FP32PATCH_NEMO_RL_CHECKOUT to a NeMo-RL checkout (nemo_rl/ and pyproject.toml) to try the spec on it",
)
def test_a_real_nemo_rl_checkout(tmp_path):
    """FP32PATCH_NEMO_RL_VARIANT, where set, names the variant the checkout must get."""
    # a copy is patched, never the checkout itself
    real = Path(os.environ["FP32PATCH_NEMO_RL_CHECKOUT"])
    root = tmp_path / "nemo-rl"
    (root / "nemo_rl").mkdir(parents=True)
    (root / "pyproject.toml").write_bytes((real / "pyproject.toml").read_bytes())
    for path in [*FILES, UTILS, "nemo_rl/__init__.py"]:
        if (real / path).is_file():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes((real / path).read_bytes())
    before = _sources(root)

    code, out = _run("apply", root)
    assert (code, out["status"]) == (0, "applied"), out
    assert out["variant"] == os.environ.get("FP32PATCH_NEMO_RL_VARIANT", out["variant"])
    # each DTensor worker the checkout has checks its config and wires its model (v1 is gone
    # after the September 2026 rework)
    for path, edits in (
        (DTENSOR, {"guard-dtensor", "wire-dtensor"}),
        (DTENSOR_V2, {"guard-dtensor-v2", "wire-dtensor-v2"}),
    ):
        if (real / path).is_file():
            assert _markers((root / path).read_text()) >= edits, path
    for path in [*FILES, UTILS]:
        if (root / path).is_file():
            compile((root / path).read_bytes(), path, "exec", dont_inherit=True)
    code, verified = _run("verify", root)
    assert (code, verified["status"]) == (0, out["status"])
    code, _ = _run("revert", root)
    assert code == 0 and _sources(root) == before
    # the patched files, compiled by the Python NeMo-RL runs (where one is given)
    python = os.environ.get("FP32PATCH_NEMO_RL_PYTHON")
    if python:
        _run("apply", root)
        files = [str(root / p) for p in [*FILES, UTILS] if (root / p).is_file()]
        check = subprocess.run([python, "-m", "py_compile", *files], capture_output=True, text=True)
        assert check.returncode == 0, check.stderr
        _run("revert", root)


def test_fixture_shapes_are_what_their_names_say():
    # the derived shapes differ from the newest exactly where their variant says
    newest, oldest = files_at(SHAPES[0].name), files_at(SHAPES[-1].name)
    assert "def build_inference_model" in newest[SETUP] and "def build_inference_model" not in oldest[SETUP]
    assert PATCHES in newest and PATCHES not in oldest
    assert "def load_and_start" in newest[GENERATION] and "def load_and_start" not in oldest[GENERATION]
    assert textwrap.dedent("class VllmAsyncGenerationWorker:") in oldest[ASYNC_WORKER]
    assert (
        "class DTensorPolicyWorkerImpl:" in newest[DTENSOR] and "class DTensorPolicyWorkerImpl" not in oldest[DTENSOR]
    )
    assert "tie_weights()" in newest[DTENSOR] and "tie_weights()" not in oldest[DTENSOR]
    assert "class DTensorPolicyWorkerV2Impl:" in newest[DTENSOR_V2]
    assert "class DTensorPolicyWorkerV2:" in oldest[DTENSOR_V2] and "Impl" not in oldest[DTENSOR_V2]
