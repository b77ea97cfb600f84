"""Shared pieces of the megatron-core tests: process groups on CPU + gloo, a real
ColumnParallelLinear output layer with known weights, Megatron's DDP main_grad handling,
the float64 reference and the error bounds the results must meet.

Two things Megatron cannot do on a CPU-only torch, and what stands in for them:

- its tensor-parallel collectives allocate their outputs on ``torch.cuda.current_device()``,
  which raises without CUDA; ``use_cpu_for_cuda_buffers`` points that call at the CPU.
- ``gradient_accumulation_fusion=True`` in the config makes ColumnParallelLinear refuse to
  build without APEX's fused CUDA kernel; the tests build the layer without it and then
  turn the layer's own flag on (``layer.gradient_accumulation_fusion``, which is what its
  forward reads), and ``emulate_ddp`` gives the weight the ``main_grad`` buffer and the
  backward hook that Megatron's DistributedDataParallel would (its constructor needs CUDA).
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

S, B, H, V = 8, 2, 64, 128  # sequence, micro-batch, hidden, vocabulary (divisible by TP=2)
MODES = ("fp32", "tf32", "fp32out", "fp32out-hilo", "fp32out-bf16grad")
U_BF16 = 2.0**-8  # bf16 rounding: at most half an ulp, 2**-8 relative
U_FP32 = 2.0**-24

# Extra error of each mode's backward over fp32 accumulation, relative to sum |a*b|: how
# much of the fp32 grad_output each one keeps. tf32 is exact here because TF32 does not
# exist on the CPU (on a GPU it would be 2**-11); fp32out carries grad_output in scaled
# fp16 for the weight gradient (11 bits, TF32's rounding); the hi/lo split keeps ~16 bits.
GRAD_SLACK = {"fp32": 0.0, "tf32": 0.0, "fp32out": 2.0**-11, "fp32out-hilo": 2.0**-16, "fp32out-bf16grad": U_BF16}
# The same for the input gradient: fp32out computes it as the stock head does, from
# grad_output rounded to bf16.
DX_SLACK = {**GRAD_SLACK, "fp32out": U_BF16}


def use_cpu_for_cuda_buffers() -> None:
    torch.cuda.current_device = lambda: "cpu"  # see the module docstring


def init_parallel(rank: int, world: int, init_method: str) -> None:
    """gloo process group of ``world`` ranks met at ``init_method`` (tests/support/rendezvous.py: no
    port to race for), all of them one tensor-parallel group."""
    from megatron.core import parallel_state

    from tests.support.rendezvous import init_gloo

    warnings.filterwarnings("ignore")
    use_cpu_for_cuda_buffers()
    init_gloo(rank, world, init_method)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)


def recorded(run: Callable[..., dict], *args: object) -> dict:
    """``run(*args)``'s record with ``ok``, or what it raised (the error and the traceback's end,
    for the test to show): a spawned rank saves every run's outcome and goes on to the next."""
    try:
        return {"ok": True, **run(*args)}
    except Exception as exc:
        return {
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}"[:3000],
            "traceback": traceback.format_exc()[-4000:],
        }


@contextlib.contextmanager
def no_rng_fork():
    """Megatron's RNG tracker forks CUDA's generator around dropout; there is none here."""
    from megatron.core.tensor_parallel import random as megatron_random

    tracker = megatron_random.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    try:
        yield
    finally:
        del tracker.fork


def run_phases(phases: list[list[dict]], run: Callable[[dict], dict]) -> dict:
    """A spawned rank's runs: ``run(spec)``'s record (``recorded``) for each spec of each phase, by
    the spec's name, with Megatron's RNG tracker forking nothing; after each phase, which
    fp32patch modules the process has imported (``modules``, one sorted list a phase)."""
    results: dict = {"runs": {}, "modules": []}
    with no_rng_fork():
        for phase in phases:
            for spec in phase:
                results["runs"][spec["name"]] = recorded(run, spec)
            results["modules"].append(sorted(m for m in sys.modules if m.startswith("fp32patch")))
    return results


def close_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def config(**overrides: object):
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=1,
        hidden_size=H,
        num_attention_heads=4,
        use_cpu_initialization=True,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=dist.get_world_size(),
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


@dataclass
class Problem:
    """A head's input, its full weight and dLoss/dlogits, all deterministic."""

    x: torch.Tensor  # [S, B, H] bf16
    weight: torch.Tensor  # [V, H] bf16
    grad: torch.Tensor  # [S, B, V] fp32

    def logits64(self) -> torch.Tensor:
        return self.x.double() @ self.weight.double().t()

    def dx64(self) -> torch.Tensor:
        return self.grad.double() @ self.weight.double()

    def dw64(self) -> torch.Tensor:
        return self.grad.double().reshape(-1, V).t() @ self.x.double().reshape(-1, H)


def problem(seed: int = 0) -> Problem:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=gen).bfloat16()
    weight = (torch.randn(V, H, generator=gen) * 0.1).bfloat16()
    grad = torch.randn(S, B, V, generator=gen)
    return Problem(x, weight, grad)


def vocab_shard(rank: int, world: int) -> slice:
    part = V // world
    return slice(rank * part, (rank + 1) * part)


def seq_shard(rank: int, world: int) -> slice:
    part = S // world
    return slice(rank * part, (rank + 1) * part)


def output_layer(cfg, weight: torch.Tensor | None, gather_output: bool, rank: int, world: int):
    """A real ColumnParallelLinear LM head holding this rank's rows of ``weight``.

    ``weight=None`` builds it as GPTModel does for tied embeddings: no weight of its own.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    layer = ColumnParallelLinear(
        H,
        V,
        config=cfg,
        init_method=torch.nn.init.zeros_,
        bias=False,
        gather_output=gather_output,
        skip_weight_param_allocation=weight is None,
    )
    if weight is not None:
        with torch.no_grad():
            layer.weight.copy_(weight[vocab_shard(rank, world)])
    return layer


def emulate_ddp(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Give ``param`` what Megatron's DDP gives each trainable parameter: an fp32
    ``main_grad``, the ``grad_added_to_main_grad`` flag and a hook that, once the gradient
    is accumulated, adds ``.grad`` into ``main_grad`` unless the layer already did, then
    drops ``.grad``."""
    param.main_grad = torch.zeros(param.shape, dtype=torch.float32)
    param.grad_added_to_main_grad = False

    def hook(p: torch.Tensor) -> None:
        if p.grad is not None and not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad.data)
        p.grad = None

    param.register_post_accumulate_grad_hook(hook)
    return param


def assert_within(
    got: torch.Tensor,
    ref: torch.Tensor,
    abs_products: torch.Tensor,
    terms: int,
    slack: float = 0.0,
    rounded_to_bf16: bool = False,
    extra: torch.Tensor | float = 0.0,
) -> None:
    """``got`` equals the float64 ``ref`` to rounding: fp32 accumulation of ``terms``
    products (sum of their magnitudes ``abs_products``), the mode's ``slack``, a final
    bf16 rounding if ``rounded_to_bf16``, and any ``extra`` the caller can account for."""
    tol = (terms * U_FP32 + slack) * abs_products + extra
    if rounded_to_bf16:
        tol = tol + U_BF16 * ref.abs()
    err = (got.double() - ref).abs()
    worst = (err - tol).max().item()
    assert worst <= 0, f"error exceeds the rounding bound by {worst:.3g} (max error {err.max():.3g})"


class Chunk(torch.nn.Module):
    """The smallest last-stage model chunk: an output layer and ``post_process``."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.post_process = True
        self.output_layer = layer


# How each TP scenario builds and calls the head.
VARIANTS = (
    "gather_output",  # full logits gathered; input gradient all-reduced
    "parallel_output",  # each rank keeps its vocabulary shard
    "runtime_gather_output",  # built parallel, gathered at call time (MTP, inference)
    "sequence_parallel",  # input split along the sequence: all-gather / reduce-scatter
    "ddp_fused",  # gradient-accumulation fusion into DDP's main_grad
    "tied",  # no weight of its own: the embedding's shard is passed in at call time
)


def run_scenario(
    variant: str,
    mode: str,
    rank: int,
    world: int,
    batch: int = B,
    change: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """One forward and backward of a converted real output layer on this rank, on the
    first ``batch`` sequences of the problem.

    Returns the logits as the layer returned them, this rank's input gradient and its
    weight gradient (``main_grad`` under fusion). With ``change``, the logits are first
    turned to [b, s, v] as GPTModel hands them over (``transpose(0, 1).contiguous()``) and
    passed through ``change`` (a trainer's temperature scaling); the result is returned.
    """
    from fp32patch.runtime.megatron_lm_head import apply_fp32_lm_head

    p = problem()
    p = Problem(p.x[:, :batch], p.weight, p.grad[:, :batch])
    split_sequence = variant == "sequence_parallel" and world > 1
    # Megatron refuses sequence parallelism without tensor parallelism: TP=1 runs plain.
    cfg = config(sequence_parallel=split_sequence)
    gather = variant not in ("parallel_output", "runtime_gather_output")
    tied = variant == "tied"
    layer = output_layer(cfg, None if tied else p.weight, gather, rank, world)
    if tied:
        weight = torch.nn.Parameter(p.weight[vocab_shard(rank, world)].clone())
    else:
        weight = layer.weight
    if variant == "ddp_fused":
        layer.gradient_accumulation_fusion = True
        emulate_ddp(weight)
    assert apply_fp32_lm_head(Chunk(layer), mode) == [layer]

    x = (p.x[seq_shard(rank, world)] if split_sequence else p.x).clone().requires_grad_()
    logits, _ = layer(
        x,
        weight=weight if tied else None,
        runtime_gather_output=True if variant == "runtime_gather_output" else None,
    )
    full = logits.shape[-1] == V
    grad = p.grad if full else p.grad[..., vocab_shard(rank, world)].contiguous()
    if change is not None:
        logits, grad = change(logits.transpose(0, 1).contiguous()), grad.transpose(0, 1)
    logits.backward(grad)
    weight_grad = weight.main_grad if variant == "ddp_fused" else weight.grad
    return {"logits": logits.detach(), "dx": x.grad, "dw": weight_grad}


# The scenarios whose logits are also changed in place at TP=2, in and out of place: each
# key ("in-place", variant, mode, batch, in_place) of tp_worker's results.
IN_PLACE_VARIANTS = ("parallel_output", "sequence_parallel", "ddp_fused", "tied")


def in_place_scenarios(rank: int, world: int) -> dict[tuple, dict[str, torch.Tensor]]:
    """``run_scenario`` with the logits divided by the temperature, in place and out of place."""
    from functools import partial

    from tests.support.in_place import change

    return {
        ("in-place", variant, mode, batch, in_place): run_scenario(
            variant, mode, rank, world, batch, partial(change, "div_", in_place=in_place)
        )
        for variant in IN_PLACE_VARIANTS
        for mode in MODES
        for batch in (1, B)
        for in_place in (True, False)
    }


def tp_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    """Entry point of each spawned rank: every scenario, results saved per rank."""
    init_parallel(rank, world, init_method)
    try:
        results = {(variant, mode): run_scenario(variant, mode, rank, world) for variant in VARIANTS for mode in MODES}
        results.update(in_place_scenarios(rank, world))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        close_parallel()


def hybrid_model(cfg, tied: bool = False, seed: int = 0):
    """A real MambaModel (HybridModel: the NemotronH class) that runs end to end on the CPU.

    Its one layer is an MLP layer built from Megatron's own tensor-parallel linears; the
    Mamba, attention and final-norm layers of the stock spec need Transformer Engine.
    """
    from functools import partial

    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.mamba.mamba_model import MambaModel
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

    mlp = partial(
        MLP.as_mlp_submodule,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    stack = ModuleSpec(
        module=HybridStack,
        params={"post_layer_norm": False},
        submodules=HybridStackSubmodules(
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(mlp=mlp, mlp_bda=get_bias_dropout_add),
            )
        ),
    )
    torch.manual_seed(seed)
    return MambaModel(
        config=cfg,
        mamba_stack_spec=stack,
        vocab_size=V,
        max_sequence_length=S,
        hybrid_layer_pattern="-",
        share_embeddings_and_output_weights=tied,
    )


def gpt_model(
    cfg, pre_process: bool = True, post_process: bool = True, tied: bool = False, core_attention=None, **kwargs
):
    """A real GPTModel (local layer spec; ``core_attention``: another attention module in it,
    ``kwargs``: more of GPTModel's arguments). Its attention needs CUDA's RNG tracker (``no_rng_fork``
    forks nothing in its place)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec()
    if core_attention is not None:
        spec.submodules.self_attention.submodules.core_attention = core_attention
    torch.manual_seed(0)
    return GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=V,
        max_sequence_length=kwargs.pop("max_sequence_length", S),
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tied,
        **kwargs,
    )


class Nest(torch.nn.Module):
    """A wrapper holding the next model under ``attr``: stands in for Megatron's DDP
    (``.module``; its constructor needs CUDA), LLaVAModel (``.language_model``), Nemotron
    VL (``.llava_model``) and Qwen-Omni-style models (``.thinker``)."""

    def __init__(self, attr: str, inner: torch.nn.Module | None, **attrs: object) -> None:
        super().__init__()
        setattr(self, attr, inner)
        for name, value in attrs.items():
            setattr(self, name, value)
