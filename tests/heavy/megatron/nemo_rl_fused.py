"""NeMo-RL's fused log-prob path on a real megatron-core GPTModel (CPU, gloo): what each rank runs.

A job names a NeMo-RL tree (the stand-in checkout, patched by ``fp32patch apply`` or not; or a
real checkout, whose files are imported as they are), a tensor-parallel size and runs. Each run
builds the policy through the tree's own ``setup.py``: ``validate_and_set_config`` (the guard of
each Megatron worker), then ``setup_model_and_optimizer`` (which patches ``GPTModel.forward`` with
the tree's fused forward and, patched, wires the output layer), with Megatron Bridge's two entry
points standing in to build a real GPTModel in Float16Module. Then one training step through the
tree's ``train.py`` (``forward_with_post_processing_fn``, as Megatron's schedule calls it): a
packed batch-1 micro-batch (three sequences in one row, attention block-diagonal, positions
restarting), the training temperature, a policy-gradient loss over the tokens that have a
successor in their own sequence, backward.

Recorded per run: the log-probs, the decoder's output (the fused path's input) and the output
weight with its gradient (each gathered over the tensor-parallel ranks), every parameter's
gradient, the guard's verdict; per phase, which fp32patch modules the process has imported.

CPU stand-ins: Megatron's RNG tracker (CUDA's) forks nothing here (no dropout); the causal mask
is passed (Megatron builds its default on CUDA); under tensor parallelism sequence parallelism is
turned on after the model is built (the local spec's torch LayerNorm refuses it at build time),
in the config and in every layer that stored it.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType, SimpleNamespace

import torch
import torch.distributed as dist
from megatron_harness import (
    S,
    V,
    close_parallel,
    config,
    emulate_ddp,
    gpt_model,
    init_parallel,
    run_phases,
)

TEMPERATURE = 0.7
PACKED_LENGTHS = (3, 2, 3)  # three sequences in one row of S tokens
CHUNK = 4  # fused_linear_logprobs_chunk_size: the stock path's chunks of positions


def run(name: str, key=None, tied: bool = False, fused_key: str = "use_fused_linear_logprobs") -> dict:
    """One run. ``key``: policy.megatron_cfg.fp32_lm_head (None: not set, the stock policy)."""
    return {"name": name, "key": key, "tied": tied, "fused_key": fused_key}


def worker(rank: int, world: int, init_method: str, job: dict) -> None:
    init_parallel(rank, world, init_method)
    sys.path.insert(0, job["root"])
    try:
        results = run_phases(job["phases"], lambda spec: one_run(rank, world, spec))
        torch.save(results, os.path.join(job["out"], f"rank{rank}.pt"))
    finally:
        close_parallel()


def policy_cfg(spec: dict, world: int) -> dict:
    """NeMo-RL's policy section with the fused path on (and both engines' switches where asked)."""
    megatron = {
        "enabled": True,
        "freeze_moe_router": False,
        "pipeline_dtype": "bfloat16",
        "sequence_parallel": world > 1,
        "tensor_model_parallel_size": world,
        spec["fused_key"]: True,
        (
            "fused_linear_logprobs_chunk_size"
            if spec["fused_key"] == "use_fused_linear_logprobs"
            else "linear_ce_fusion_chunk_size"
        ): CHUNK,
    }
    vllm_cfg: dict = {}
    if spec["key"] is not None:
        megatron["fp32_lm_head"] = spec["key"]
        vllm_cfg["fp32_lm_head"] = True
    return {
        "model_name": "tiny",
        "precision": "bfloat16",
        "megatron_cfg": megatron,
        "generation": {"backend": "vllm", "colocated": {"enabled": True}, "vllm_cfg": vllm_cfg},
    }


# what the Megatron Bridge stand-in builds next: setup.py binds get_model once, at its import
_BUILD: dict = {}


def megatron_bridge() -> None:
    """Megatron Bridge's entry points setup.py imports: ``get_model`` builds a real GPTModel, runs
    the pre-wrap hooks and wraps it in Float16Module; the provider is a namespace setup.py fills."""
    from megatron.core.transformer.module import Float16Module

    def get_model(provider, ddp_config, *, pre_wrap_hook=(), mixed_precision_wrapper=Float16Module, **_):
        cfg = _BUILD["config"]
        chunks = [tensor_parallel_gpt(cfg, _BUILD["tied"])]
        for hook in pre_wrap_hook:
            chunks = hook(chunks)
        return [mixed_precision_wrapper(cfg, chunk) for chunk in chunks]

    bridge = ModuleType("megatron.bridge")
    bridge.AutoBridge = SimpleNamespace(
        from_hf_pretrained=lambda name: SimpleNamespace(to_megatron_provider=lambda: SimpleNamespace())
    )
    provider = ModuleType("megatron.bridge.models.model_provider")
    provider.get_model = get_model
    sys.modules["megatron.bridge"] = bridge
    sys.modules["megatron.bridge.models"] = ModuleType("megatron.bridge.models")
    sys.modules["megatron.bridge.models.model_provider"] = provider


def tensor_parallel_gpt(cfg, tied: bool):
    """The GPTModel, with sequence parallelism on where the group has two ranks (module
    docstring); its output weight (the shared embedding's, when tied) gets Megatron DDP's
    main_grad, which the head fills through gradient-accumulation fusion."""
    model = gpt_model(cfg, tied=tied)
    if dist.get_world_size() > 1:
        cfg.sequence_parallel = True
        for module in model.modules():
            if hasattr(module, "sequence_parallel"):
                module.sequence_parallel = True
            if hasattr(module, "allreduce_dgrad"):
                module.allreduce_dgrad = False
    model.output_layer.gradient_accumulation_fusion = True
    emulate_ddp(output_weight(model))
    return model


def output_weight(model):
    """The weight the head reads: its own, or the shared embedding's when tied (GPTModel's
    ``shared_embedding_or_output_weight`` gives the embedding's on a first stage either way)."""
    return (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else model.output_layer.weight
    )


def packed_microbatch() -> dict:
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(7))
    positions = torch.cat([torch.arange(n) for n in PACKED_LENGTHS]).unsqueeze(0)
    blocks = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool) for n in PACKED_LENGTHS])
    mask = ~(blocks & torch.ones(S, S, dtype=torch.bool).tril())  # True: not attended
    has_next = torch.cat([torch.arange(n) < n - 1 for n in PACKED_LENGTHS]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": positions, "attention_mask": mask[None, None], "has_next": has_next}


def advantages() -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, S - 1).unsqueeze(0)


def one_run(rank: int, world: int, spec: dict) -> dict:
    import importlib

    _BUILD.update(config=config(hidden_dropout=0.0, attention_dropout=0.0), tied=spec["tied"])
    if "megatron.bridge" not in sys.modules:
        megatron_bridge()
    setup = importlib.import_module("nemo_rl.models.megatron.setup")
    train = importlib.import_module("nemo_rl.models.megatron.train")
    policy = policy_cfg(spec, world)
    setup.validate_and_set_config(policy, rank, "tiny", None, None, None)  # each Megatron worker's guard
    torch.manual_seed(0)
    state = setup.setup_model_and_optimizer(policy, SimpleNamespace(model=None, ddp=None))
    model = state.model.module  # the GPTModel inside Float16Module
    seen: dict = {}
    model.decoder.register_forward_hook(lambda module, args, out: seen.__setitem__("hidden", out.detach()))

    microbatch = packed_microbatch()
    sampling = SimpleNamespace(temperature=TEMPERATURE)
    log_probs, _ = train.forward_with_post_processing_fn(
        iter([microbatch]), state.model, lambda mb: None, sampling_params=sampling, **{spec["fused_key"]: True}
    )
    mask = microbatch["has_next"][:, :-1]
    loss = -(log_probs * advantages() * mask).sum() / mask.sum()
    loss.backward()

    weight = output_weight(model)
    verdict = sys.modules.get("fp32patch.runtime.nemo_rl")
    settings = verdict.config.checked_settings(f"megatron worker rank {rank}") if verdict else None
    return {
        "log_probs": log_probs.detach().clone(),
        "dtype": log_probs.dtype,
        "marked": getattr(log_probs, "_fp32patch_temperature", None),
        "hidden": _gather(seen["hidden"], dim=0),  # [s, 1, h]
        "weight": _gather(weight.detach().float(), dim=0),  # [v, h]
        "weight_grad": _gather(weight.main_grad, dim=0),  # fp32: DDP's buffer
        "grads": {n: _grad(p) for n, p in model.named_parameters() if _grad(p) is not None},
        "ids": microbatch["input_ids"],
        "has_next": microbatch["has_next"],
        "megatron_mode": None if settings is None else settings.megatron,
    }


def _grad(param: torch.Tensor) -> torch.Tensor | None:
    grad = getattr(param, "main_grad", None)
    grad = param.grad if grad is None else grad
    return None if grad is None else grad.detach().float().clone()


def _gather(t: torch.Tensor, dim: int) -> torch.Tensor:
    world = dist.get_world_size()
    if world == 1:
        return t.clone()
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def reference(record: dict, temperature: float = TEMPERATURE) -> dict[str, torch.Tensor]:
    """The float64 log-probs at ``temperature`` of the hidden states and weight the run used, and
    the weight gradient of the run's loss through them."""
    hidden = record["hidden"][:, 0].double().requires_grad_()  # [s, h]
    weight = record["weight"].double().requires_grad_()  # [v, h]
    ids = record["ids"][0]
    logp = torch.log_softmax(hidden @ weight.t() / temperature, dim=-1)[:-1].gather(-1, ids[1:, None])[:, 0]
    mask = record["has_next"][0, :-1].double()
    loss = -(logp * advantages()[0].double() * mask).sum() / mask.sum()
    (weight_grad,) = torch.autograd.grad(loss, weight)
    return {"log_probs": logp.detach()[None], "weight_grad": weight_grad}
