"""Shared pieces of the transformers suite: tiny real models built from configs (no hub
downloads), what their LM head saw in a forward and backward, float64 references, and the
gloo process groups of the FSDP2 and tensor-parallel runs.

Three families, one property each that matters for the head: Qwen2 (untied), Llama (tied to
the embeddings: one weight, two uses), Gemma2 (a final soft-cap applied to the logits after
the head).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

V, H, T = 256, 64, 12  # vocabulary (divisible by TP=2), hidden, tokens per sequence
MODES = ("fp32", "tf32", "fp32out", "fp32out-hilo", "fp32out-bf16grad")
FAMILIES = ("qwen2", "llama", "gemma2")
# every tiny model's sizes: two decoder layers, four heads over two key-value heads
SIZES = dict(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=2 * H,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
U_BF16 = 2.0**-8  # bf16 rounding: at most half an ulp, 2**-8 relative
U_FP32 = 2.0**-24
# Extra error of each mode's weight gradient over fp32 accumulation, relative to sum |a*b|
# (tf32 is exact on the CPU; see tests/heavy/megatron/megatron_harness.py)
GRAD_SLACK = {"fp32": 0.0, "tf32": 0.0, "fp32out": 2.0**-11, "fp32out-hilo": 2.0**-16, "fp32out-bf16grad": U_BF16}


def config(family: str):
    """A tiny config of ``family``: two decoder layers, eager attention (Gemma2's soft-capped
    attention wants it), no dropout."""
    import transformers

    if family == "qwen2":
        cfg = transformers.Qwen2Config(**SIZES, tie_word_embeddings=False)
    elif family == "llama":
        cfg = transformers.LlamaConfig(**SIZES, tie_word_embeddings=True)
    elif family == "gemma2":
        cfg = transformers.Gemma2Config(**SIZES, head_dim=16, final_logit_softcapping=30.0, tie_word_embeddings=True)
    else:
        raise ValueError(family)
    cfg._attn_implementation = "eager"
    return cfg


def tiny(family: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """A real ``<Family>ForCausalLM`` with deterministic weights, scaled so that the logits
    reach the size real models give (|z| up to ~25), where bf16 rounding shows."""
    import transformers

    cls = {
        "qwen2": transformers.Qwen2ForCausalLM,
        "llama": transformers.LlamaForCausalLM,
        "gemma2": transformers.Gemma2ForCausalLM,
    }[family]
    torch.manual_seed(seed)
    model = cls(config(family))
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.normal_(0.0, 1.0)
    return model.to(dtype).eval()


def token_ids(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(seed))


@dataclass
class Seen:
    """What the head saw in one forward and backward: its input and weight as the forward got
    them, its output, and the gradient that came back into it."""

    x: list[torch.Tensor] = field(default_factory=list)
    weight: list[torch.Tensor] = field(default_factory=list)
    out: list[torch.Tensor] = field(default_factory=list)
    grad: list[torch.Tensor] = field(default_factory=list)


def watch(head: torch.nn.Module) -> Seen:
    """Record, through hooks (the module is left as it is), what ``head`` sees."""
    seen = Seen()

    def pre_hook(module, args):
        # before the forward: a head that is an FSDP2 unit of its own is resharded after it
        seen.weight.append(_local(module.weight).detach().clone())

    def forward_hook(module, args, out):
        x = args[0]
        seen.x.append(_local(x).detach().clone())
        seen.out.append(_local(out).detach().clone())
        if out.requires_grad:
            # the logits are no autograd view (neither the stock head's nor the fp32 head's), so a
            # hook on them runs after the trainer changes them in place, as FSDP2's does
            assert not out._is_view()
            out.register_hook(lambda g: seen.grad.append(_local(g).detach().clone()))

    head.register_forward_pre_hook(pre_hook)
    head.register_forward_hook(forward_hook)
    return seen


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A policy-gradient-shaped loss: next-token log-probabilities times fixed advantages."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logp = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    advantages = torch.linspace(-1.0, 1.0, logp.numel()).reshape(logp.shape)
    return -(logp * advantages).sum()


def head_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 logits of the head over its own bf16 inputs, and their magnitude bound."""
    x64, w64 = x.double().reshape(-1, x.shape[-1]), w.double()
    return x64 @ w64.t(), x64.abs() @ w64.abs().t()


def rel_to_max(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def rel_norm(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------- process groups


def init_gloo(rank: int, world: int, init_method: str) -> None:
    """The gloo group, met at ``init_method`` (tests/support/rendezvous.py: no port to race for)."""
    from tests.support.rendezvous import init_gloo as meet

    warnings.filterwarnings("ignore")
    meet(rank, world, init_method)


def spawn(worker: Callable, world: int, out_dir: str) -> None:
    """Run ``worker(rank, world, out_dir)`` on ``world`` gloo ranks, each in its own process."""
    import torch.multiprocessing as mp

    from tests.support.rendezvous import file_store

    with file_store() as init_method:
        mp.spawn(_entry, args=(worker, world, init_method, out_dir), nprocs=world, join=True)


def _entry(rank: int, worker: Callable, world: int, init_method: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two ranks on a two-core machine
    init_gloo(rank, world, init_method)
    try:
        worker(rank, world, out_dir)
    finally:
        dist.destroy_process_group()
