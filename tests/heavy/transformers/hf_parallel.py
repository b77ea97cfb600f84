"""The FSDP2 and tensor-parallel runs of the transformers suite, on two gloo ranks (CPU).

Each run is one training step of a tiny real model, parallelized as NeMo-RL parallelizes its
DTensor policies, with the logits divided by the temperature in place as its workers do:

- FSDP2: ``fully_shard`` on every decoder layer and on the root (``reshard_after_forward=False``),
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32, output_dtype=float32)``,
  fp32 master weights, the forward under bf16 autocast; each rank its own token ids.
- FSDP2 as verl shards a model (``HEAD_UNIT_RUNS``): the head a unit of its own, resharded after
  its forward, the logits divided in place through ``squeeze(0)``.
- Tensor parallel: ``parallelize_module`` with NeMo-RL's plan for ``lm_head`` (and, for
  sequence parallelism, ``model.norm``), the same token ids on both ranks. Only the head (and
  the norm) is parallelized, so everything before it is the one-process computation and the
  comparison looks at the head.

What each rank saw and ended with is saved; the tests compute the one-process results in the
main process and compare.
"""

from __future__ import annotations

import os

import torch
from hf_harness import MODES, tiny, token_ids, watch

from fp32patch.runtime.hf_lm_head import apply_fp32_lm_head
from tests.support.in_place import TEMPERATURE

# (family, mode) of each FSDP2 run; None is the stock head
FSDP_RUNS = [("qwen2", mode) for mode in (None, *MODES)] + [
    ("llama", None),
    ("llama", "fp32out"),
    ("gemma2", "fp32out"),
]
# (plan, mode) of each tensor-parallel run, on Qwen2 except the tied plan (Llama)
TP_RUNS = [("colwise", mode) for mode in (None, *MODES)] + [
    (plan, mode) for plan in ("sequence_parallel", "replicated_output", "tied_shard1") for mode in (None, "fp32out")
]


# FSDP2 as verl's apply_fsdp2 shards a model: the untied head a unit of its own, every unit
# resharded after its forward, no output cast; the logits divided in place through a view
# (verl's logits.squeeze(0).div_). The head's backward then needs FSDP2's unshard hook, which
# runs only if the logits are no autograd view.
HEAD_UNIT_RUNS = [("qwen2", mode) for mode in (None, "fp32", "fp32out")]


def fsdp_ids(rank: int):
    return token_ids(batch=1, seed=10 + rank)  # a packed micro-batch each


def fsdp_run(family: str, mode: str | None, rank: int, world: int, head_unit: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = tiny(family, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    output = {} if head_unit else {"output_dtype": torch.float32}
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, **output)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    if head_unit:
        fully_shard(model.lm_head, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    else:
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    apply_fp32_lm_head(model, mode)
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head.weight is embedding.weight
    seen = watch(head)
    embedding_grads: list[torch.Tensor] = []

    def keep_embedding_grad(module, args, out) -> None:
        out.register_hook(embedding_grads.append)

    embedding.register_forward_hook(keep_embedding_grad)
    ids = fsdp_ids(rank)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids).logits
    if head_unit:
        logits.squeeze(0).div_(TEMPERATURE)
    else:
        logits = logits.div_(TEMPERATURE)
    grad = torch.randn(logits.shape, generator=torch.Generator().manual_seed(20 + rank))
    logits.backward(grad)
    return {
        "ids": ids,
        "tied": tied,
        "logits": logits.detach(),
        "x": seen.x[0],
        "weight": seen.weight[0],
        "out": seen.out[0],
        "grad": seen.grad[0],
        "embedding_grad": embedding_grads[0].detach(),
        # what the embedding's backward needs besides (Gemma2 scales inside its embedding)
        "embedding_scale": getattr(embedding, "embed_scale", torch.tensor(1.0)).to(torch.bfloat16),
        "padding_idx": -1 if embedding.padding_idx is None else embedding.padding_idx,
        "weight_at_rest": (type(head.weight).__name__, head.weight.dtype),
        "dw_shard": head.weight.grad.to_local().clone(),
    }


def tp_model(plan: str, mode: str | None, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = tiny("llama" if plan == "tied_shard1" else "qwen2")
    head = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    styles = {"lm_head": head}
    if plan == "sequence_parallel":
        # the last decoder layer hands over its sequence shard, as in a sequence-parallel model
        styles = {
            f"model.layers.{len(model.model.layers) - 1}": PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1)
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        }
    elif plan == "replicated_output":
        styles = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    elif plan == "tied_shard1":
        # the embedding column-parallel (its weight Shard(1)); the head re-tied to it afterwards
        styles["model.embed_tokens"] = ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    parallelize_module(model, mesh, styles)
    if plan == "tied_shard1":
        model.lm_head.weight = model.model.embed_tokens.weight
    return apply_fp32_lm_head(model, mode)


def tp_run(plan: str, mode: str | None, rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    model = tp_model(plan, mode, world)
    ids = token_ids(batch=1, seed=30)
    logits = model(ids).logits
    kind = (type(logits).__name__, logits.dtype, tuple(str(p) for p in getattr(logits, "placements", ())))
    try:
        logits, in_place = logits.div_(TEMPERATURE), "ok"
    except RuntimeError as error:  # torch's to_local() (use_local_output=True) gives a view
        logits, in_place = logits / TEMPERATURE, str(error).split(" is ")[0]
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    grad = torch.randn(full.shape, generator=torch.Generator().manual_seed(31))
    if isinstance(logits, DTensor):
        grad = DTensor.from_local(grad, logits.device_mesh, [_replicate()]).redistribute(
            logits.device_mesh, logits.placements
        )
    logits.backward(grad)
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach()
        for name, p in model.named_parameters()
    }
    return {"kind": kind, "in_place": in_place, "logits": full.detach(), "grads": grads}


def _replicate():
    from torch.distributed.tensor import Replicate

    return Replicate()


def worker(rank: int, world: int, out_dir: str) -> None:
    results = {("fsdp", family, mode): fsdp_run(family, mode, rank, world) for family, mode in FSDP_RUNS}
    results.update(
        {("fsdp-head-unit", family, mode): fsdp_run(family, mode, rank, world, True) for family, mode in HEAD_UNIT_RUNS}
    )
    results.update({("tp", plan, mode): tp_run(plan, mode, rank, world) for plan, mode in TP_RUNS})
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
