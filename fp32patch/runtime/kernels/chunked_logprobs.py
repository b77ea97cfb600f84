"""Per-token log-probabilities, and the entropy where a stack needs it, straight from hidden
states and the LM head's weight, at fp32 grade, without ever holding the [T, V] logits.

``chunked_logprobs(hidden, weight, targets, ...)`` is what every stack's fused log-prob path
calls (NeMo-RL's ``use_fused_linear_logprobs``, verl's fused kernels, TRL's chunked
log-probs). For each tile of ``chunk_rows`` tokens by ``chunk_vocab`` vocabulary entries:

- forward: the tile's logits come from ``lm_head_gemm``'s forward GEMM in ``mode``
  (``fp32out``: ``torch.mm(..., out_dtype=float32)`` on bf16 operands on CUDA, the exact
  upcast on the CPU), are divided by the temperature in fp32, and are folded into per-token
  running statistics in fp32 (an online logsumexp: the maximum, the sum of exponentials, the
  target's logit, and for the entropy the exp-weighted sum of logits). Nothing of the tile is
  kept. On Hopper and newer GPUs the fp32out modes' forward writes no tile at all: one Triton
  kernel computes the GEMM with an fp32 accumulator and folds each block of logits in
  registers (``gemm_lse_triton``; faster than cuBLAS's bf16 GEMM writing bf16 tiles, measured);
  ``chunk_vocab`` then does not apply to the forward;
- backward: the tile's logits are computed again, turned into the fp32 gradient with
  respect to the logits (``grad_logp * (onehot - p) - grad_entropy * p * (log p + H)``,
  divided by the temperature), and handed to ``lm_head_gemm``'s backward GEMMs in ``mode``,
  the same code the unfused head runs: the weight gradient of a vocabulary block accumulates
  in fp32 over the tokens (into Megatron's ``main_grad`` when the weight has one and the
  caller asks for gradient-accumulation fusion) and is delivered once; the input gradient
  accumulates in fp32 over the vocabulary blocks and is delivered once in the input's dtype.

A per-token temperature (a tensor shaped as ``targets``: Prime-RL's per-sample temperatures)
divides each token's logits by its own; a soft-cap (``softcap``: Gemma's
``final_logit_softcapping``) is applied to the fp32 logits before the temperature,
``softcap * tanh(z / softcap)``, as vLLM's logits processor applies it, and its derivative
``1 - tanh**2`` joins the backward in fp32. The Triton kernels take both (the tanh:
``triton_tanh``, within a few units in the last place of float64's), so either one costs about
what one temperature costs.

Short sequences keep the logits (``keep_logits``): where the fp32 logits of a call (4 bytes a
logit of this rank's shard) take at most ``KEEP_LOGITS_BYTES``, the forward computes them in one
fp32-output GEMM, folds them, and saves them for the backward, which reads them (in one
whole-vocabulary tile unless a tile is asked for) instead of computing them again: three GEMMs
in all, as the stock head does, instead of four, for 4 bytes a logit held from the forward to the
head's backward and 4 more for the backward's 16-bit copies (the stock head holds 10). Long
sequences recompute, and never hold the [T, V] logits.

The tiles go vocabulary block by vocabulary block, tokens inside: then only one block's
weight gradient is in flight, and a block whose ``chunk_rows`` covers every token gets its
weight gradient from one GEMM, exactly as the unfused head's backward computes those rows.
The held memory is the tile, its 16-bit copies in the backward, one block's weight gradient
and the fp32 input gradient [T, H].

Vocabulary-parallel tensor parallelism (Megatron's ``ColumnParallelLinear`` head): the weight
is this rank's shard of the vocabulary, ``targets`` are global ids, the target's logit is
taken on the rank that holds it, and the maximum and the sums are all-reduced over
``tp_group`` (two collectives per forward, over [T] vectors) and saved for the backward. The
input gradient is summed over the group in fp32: all-reduced when each rank holds every token,
reduce-scattered back to the rank's tokens under sequence parallelism, where the forward
all-gathers the tokens first (as NeMo-RL's fused path does).

On the CPU, or with ``FP32PATCH_TRITON=0``, the per-tile steps run as torch operations and
the backward hands the fp32 gradient tile to ``lm_head_gemm``'s backward GEMMs. On CUDA they
are Triton kernels with the same formulas, and in the fp32out modes the fp32 gradient tile is
never written: one pass over the logits tile takes the gradient's column maxima, a second
writes the 16-bit copies that fp32out's GEMMs take (the scaled fp16 one and the bf16 one),
and the products are accumulated in fp32 by the GEMM itself or by fp32out's unscale kernel.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fp32patch.runtime.kernels import triton_logits  # noqa: F401  (read by the kernels: triton_logits.logits)
from fp32patch.runtime.kernels.fp32out import env_switch, triton_device
from fp32patch.runtime.kernels.gemm_lse_triton import kernel_temperature
from fp32patch.runtime.kernels.lm_head_gemm import (
    _UPCAST_MODES,
    _backward_gemms,
    _deliver_weight_grad,
    _fwd_mm,
    _precision,
)
from fp32patch.runtime.modes import MEGATRON_MODES

if TYPE_CHECKING:
    import torch

# "0" keeps the forward's tiles where the fused GEMM + logsumexp kernel would run (gemm_lse_triton)
GEMM_LSE_ENV_VAR = "FP32PATCH_GEMM_LSE"
# fp32out's backward tiles through the strip kernel: "1" every one, "0" none (the two passes),
# unset: those it was measured faster on (``strips``)
STRIPS_ENV_VAR = "FP32PATCH_STRIPS"

# Tile sizes measured on an H200 (bench/fused_logprobs.py, bench/RESULTS.md): tokens and
# vocabulary entries per tile.
DEFAULT_CHUNK_ROWS = 8192
DEFAULT_CHUNK_VOCAB = 16384
# the most logits a tile of choose_tiles' holds (4 bytes each, and 4 more for the backward's copies)
TILE_LOGITS = DEFAULT_CHUNK_ROWS * DEFAULT_CHUNK_VOCAB
# A call whose fp32 logits (tokens x this rank's vocabulary x 4 bytes) take at most this many bytes
# keeps them from the forward for the backward (see top); more, and the backward computes its tiles
# again. Overridden by FP32PATCH_KEEP_LOGITS_BYTES (0: never keep), or per call by keep_logits.
KEEP_LOGITS_BYTES = 4 << 30
KEEP_LOGITS_ENV_VAR = "FP32PATCH_KEEP_LOGITS_BYTES"


@dataclass(frozen=True)
class _Plan:
    """What one call computes and how; the autograd Function's non-tensor arguments."""

    mode: str
    temperature: float  # 1.0 when the temperature is per token (the tensor goes beside the plan)
    entropy: bool
    group: Any
    vocab_start: int
    sequence_parallel: bool
    fuse_wgrad: bool
    chunk_rows: int
    chunk_vocab: int
    softcap: float | None = None
    keep: bool = False  # the forward's fp32 logits are saved for the backward
    reduce_input_grad: bool = True  # the input gradient summed over the group here (else by the caller)


def chunked_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    mode: str = "fp32out",
    temperature: float | torch.Tensor = 1.0,
    entropy: bool = False,
    softcap: float | None = None,
    tp_group: Any = None,
    vocab_start: int | None = None,
    sequence_parallel: bool = False,
    fuse_wgrad: bool = False,
    chunk_rows: int | None = None,
    chunk_vocab: int | None = None,
    keep_logits: bool | None = None,
    reduce_input_grad: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """log softmax(hidden @ weight.T / temperature)[target] per token, in fp32, differentiable.

    ``hidden`` [..., H] (any leading shape: [T, H], verl's and TRL's [B, S, H], Megatron's
    [S, B, H]); ``weight`` [V, H], or this rank's [V / tp, H] shard under ``tp_group``;
    ``targets``: global token ids shaped as ``hidden`` without its last dimension (under
    ``sequence_parallel``: the whole gathered sequence's, [S, ...], while ``hidden`` holds this
    rank's [S / tp, ..., H]). A target outside the vocabulary contributes a logit of 0 (its
    log-prob is then meaningless; mask such tokens in the loss, as the stacks do).

    Returns the log-probs shaped as ``targets`` (fp32), and with ``entropy=True`` also the
    entropy of each token's distribution (fp32): ``(log_probs, entropy)``.

    ``mode``: the trainer's fp32 head mode (``modes.MEGATRON_MODES``); it sets the GEMMs of both
    passes as in ``lm_head_gemm``. ``temperature`` divides the fp32 logits: a number, or a
    tensor of per-token temperatures shaped as ``targets`` (each > 0). ``softcap``: cap the fp32
    logits at ``softcap * tanh(z / softcap)`` before the temperature (None: no cap). ``tp_group``: the
    tensor-parallel group whose ranks hold the vocabulary shards (None: the weight is the whole
    vocabulary); ``vocab_start``: the first vocabulary id of this rank's shard (default: rank x
    shard rows, Megatron's even split). ``fuse_wgrad``: add the weight gradient into
    ``weight.main_grad`` (Megatron's gradient-accumulation fusion) when the weight has one.
    ``chunk_rows`` x ``chunk_vocab``: the tile (defaults: ``choose_tiles``' choice for the
    shape). ``keep_logits``: save the forward's fp32 logits for the backward instead of computing
    them again (None: ``keeps_logits``' choice for the shape, never when a tile is given or no
    backward will run; True holds 4 bytes per logit of this rank's shard until the head's
    backward has run, and 4 more in it). A caller replacing a stack's own chunked path passes
    False: that path's peak holds no [T, V] tensor, and a kept one would raise the step's
    (bench/step_counts.py).
    ``reduce_input_grad=False``: under ``tp_group`` without sequence parallelism, the input
    gradient is this rank's vocabulary part only, for a caller whose own autograd region sums it
    over the group (Megatron's ``copy_to_tensor_model_parallel_region`` before the head, as
    SkyRL's fused path hands the hidden states over); summing it here too would count it once per
    rank.

    A ``hidden`` of another dtype than the weight (fp32 hidden states from FSDP2's
    ``output_dtype``) is cast to the weight's dtype inside the graph, as the fp32 head does.
    """
    temps = None
    if _is_tensor(temperature):
        temps = _row_temperatures(temperature, targets)
        temperature = 1.0
    plan = _plan(
        hidden, weight, targets, mode, temperature, entropy, tp_group, vocab_start, sequence_parallel,
        fuse_wgrad, chunk_rows, chunk_vocab, softcap, keep_logits, reduce_input_grad,
    )  # fmt: skip
    if hidden.dtype != weight.dtype:
        hidden = hidden.to(weight.dtype)
    log_probs, ent = _function().apply(hidden, weight, targets, temps, plan)
    return (log_probs, ent) if entropy else log_probs


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _row_temperatures(temperature: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token temperatures, flat and fp32 (no gradient flows to them), after checking them."""
    import torch

    if tuple(temperature.shape) != tuple(targets.shape):
        raise ValueError(
            f"chunked_logprobs: a per-token temperature {tuple(temperature.shape)} must be shaped as the "
            f"targets {tuple(targets.shape)}"
        )
    if not temperature.dtype.is_floating_point:
        raise TypeError(f"chunked_logprobs: per-token temperatures must be floating point, not {temperature.dtype}")
    if temperature.device != targets.device:
        raise ValueError(
            f"chunked_logprobs: per-token temperatures ({temperature.device}) must be on the targets' device "
            f"({targets.device})"
        )
    return temperature.detach().reshape(-1).to(torch.float32).contiguous()


def _plan(
    hidden, weight, targets, mode, temperature, entropy, group, vocab_start, sequence_parallel, fuse_wgrad,
    chunk_rows, chunk_vocab, softcap=None, keep_logits=None, reduce_input_grad=True,
) -> _Plan:  # fmt: skip
    """Check the call's arguments (a clear error naming the argument, before any work)."""
    import torch

    if mode not in MEGATRON_MODES:
        raise ValueError(f"chunked_logprobs: unknown mode {mode!r}; known: {', '.join(MEGATRON_MODES)}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"chunked_logprobs: temperature must be a number, not {type(temperature).__name__}")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"chunked_logprobs: temperature must be finite and > 0, not {temperature!r}")
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not (math.isfinite(softcap) and softcap > 0)
    ):
        raise ValueError(f"chunked_logprobs: softcap must be None or a finite number > 0, not {softcap!r}")
    if weight.dim() != 2:
        raise ValueError(f"chunked_logprobs: weight must be [V, H], got shape {tuple(weight.shape)}")
    if hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"chunked_logprobs: hidden {tuple(hidden.shape)} must end in the weight's hidden size {weight.shape[1]}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"chunked_logprobs: targets must be integer token ids, not {targets.dtype}")
    if hidden.device != weight.device or targets.device != weight.device:
        raise ValueError(
            f"chunked_logprobs: hidden ({hidden.device}), weight ({weight.device}) and targets "
            f"({targets.device}) must be on one device"
        )
    world, rank = _world_and_rank(group)
    if sequence_parallel and group is None:
        raise ValueError("chunked_logprobs: sequence_parallel needs the tp_group whose ranks hold the sequence")
    if not isinstance(reduce_input_grad, bool):
        raise TypeError(f"chunked_logprobs: reduce_input_grad must be True or False, not {reduce_input_grad!r}")
    if sequence_parallel and not reduce_input_grad:
        raise ValueError(
            "chunked_logprobs: reduce_input_grad=False keeps each rank's vocabulary part of the input gradient, "
            "which sequence_parallel's reduce-scatter needs: give one or the other"
        )
    expected = tuple(hidden.shape[:-1])
    if sequence_parallel:
        expected = (hidden.shape[0] * world, *expected[1:]) if expected else expected
    if tuple(targets.shape) != expected:
        where = " (the whole gathered sequence under sequence_parallel)" if sequence_parallel else ""
        raise ValueError(
            f"chunked_logprobs: targets {tuple(targets.shape)} must be shaped {expected}{where}, "
            f"as hidden {tuple(hidden.shape)} without its last dimension"
        )
    if vocab_start is None:
        vocab_start = rank * weight.shape[0]
    elif isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"chunked_logprobs: vocab_start must be an int >= 0, not {vocab_start!r}")
    tiles = []
    chosen = choose_tiles(math.prod(targets.shape), weight.shape[0], weight.shape[1])
    for name, value, default in (("chunk_rows", chunk_rows, chosen[0]), ("chunk_vocab", chunk_vocab, chosen[1])):
        value = default if value is None else value
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"chunked_logprobs: {name} must be an int >= 1, not {value!r}")
        tiles.append(value)
    asked = chunk_rows is not None or chunk_vocab is not None
    if keep_logits is None:
        # kept logits serve a backward: a call without one (old and reference log-probs under
        # no_grad) takes the fused forward, which writes no logits at all
        backward = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        keep = not asked and backward and keeps_logits(math.prod(targets.shape), weight.shape[0])
    elif isinstance(keep_logits, bool):
        keep = keep_logits
    else:
        raise TypeError(f"chunked_logprobs: keep_logits must be None, True or False, not {keep_logits!r}")
    if keep and not asked:
        # kept logits are read in one tile: the H200 head sweep (bench/RESULTS.md, 2026-12-05) found
        # the vocabulary blocks' fixed cost (launches, per-block copies) dominating short calls, and
        # whole-vocabulary tiles the fastest there; the backward's 16-bit copies of that one tile
        # (4 bytes a logit) beside the kept logits (4) stay under the stock head's 10
        tiles = [max(1, math.prod(targets.shape)), max(1, weight.shape[0])]
    return _Plan(
        mode, float(temperature), bool(entropy), group, vocab_start, bool(sequence_parallel), bool(fuse_wgrad), *tiles,
        None if softcap is None else float(softcap), keep, reduce_input_grad,
    )  # fmt: skip


def keeps_logits(tokens: int, vocab: int) -> bool:
    """Whether a call over ``tokens`` rows of a ``vocab``-entry head (this rank's shard) keeps its
    fp32 logits for the backward by default: when they take at most ``KEEP_LOGITS_BYTES``
    (``FP32PATCH_KEEP_LOGITS_BYTES`` where set; 0 never keeps)."""
    raw = os.environ.get(KEEP_LOGITS_ENV_VAR)
    limit = KEEP_LOGITS_BYTES
    if raw is not None and raw.strip():
        try:
            limit = int(raw)
        except ValueError:
            raise ValueError(f"{KEEP_LOGITS_ENV_VAR} must be a whole number of bytes, not {raw!r}") from None
    return 0 < tokens * vocab * 4 <= limit


def choose_tiles(
    tokens: int, vocab: int, hidden: int, rows: int = DEFAULT_CHUNK_ROWS, logits: int = TILE_LOGITS
) -> tuple[int, int]:
    """The tile (tokens, vocabulary entries) a call without ``chunk_rows`` / ``chunk_vocab``
    gets, for ``tokens`` rows of a ``vocab`` x ``hidden`` head (this rank's shard under tensor
    parallelism), when it does not keep its logits; ``rows``: tiles of that many tokens (TRL's
    path: 4096, TRL's own), each as wide as ``logits`` allows (a caller replacing a stack's own
    chunked path whose tiles hold less than ours passes a smaller budget: TRL's, Prime-RL's).

    A tile holds at most ``TILE_LOGITS`` logits (8192 x 16384, the tile measured at 16k and 64k
    tokens of a 7B head: bench/RESULTS.md, "Fused log-prob paths"), and a call takes as few
    vocabulary blocks as that allows, of equal widths: from 8192 tokens up, 16384 entries a block
    (as measured); below, wider blocks, down to one. Why: the H200 head sweep (bench/step.py
    --head, bench/RESULTS.md, "A whole training step") found each vocabulary block a fixed cost
    that dominates short calls (hidden 896, 1,024 tokens: 9.6 ms in 10 blocks, 5.7 in 5, 3.8 in
    one, the stock head 4.0), and the step's peak memory (bench/step_counts.py) holds the tile
    and its 16-bit copies in the backward, 8 bytes a logit: the budget keeps that at or under
    the long-context tile's, under what the stacks' own chunked paths hold at their peaks."""
    base = max(1, logits // rows)  # a full tile's width
    widest = max(base, logits // max(1, min(tokens, rows)))
    if widest >= vocab:
        return rows, max(1, vocab)
    if widest == base:
        return rows, base
    blocks = -(-vocab // widest)
    width = -(-vocab // blocks)
    width = -(-width // 64) * 64  # rows of 16-bit copies 128-byte aligned
    return rows, min(width, widest)


def _world_and_rank(group: Any) -> tuple[int, int]:
    if group is None:
        return 1, 0
    import torch.distributed as dist

    return dist.get_world_size(group), dist.get_rank(group)


def _spans(n: int, step: int) -> list[tuple[int, int]]:
    return [(start, min(start + step, n)) for start in range(0, n, step)]


# ---------------------------------------------------------------- the per-tile steps


class RowStats:
    """Per-token running statistics of the logits seen so far (fp32, [T] each): the maximum
    ``m``, ``s`` = sum exp(z - m), ``zs`` = sum exp(z - m) * z (for the entropy; None when not
    wanted) and the target's logit ``target`` (0 until its tile is seen)."""

    def __init__(self, rows: int, device: torch.device, entropy: bool) -> None:
        import torch

        def vec(value: float) -> torch.Tensor:
            return torch.full((rows,), value, dtype=torch.float32, device=device)

        self.m = vec(-math.inf)
        self.s = vec(0.0)
        self.zs = vec(0.0) if entropy else None
        self.target = vec(0.0)

    def rows(self, r0: int, r1: int) -> RowStats:
        view = RowStats.__new__(RowStats)
        view.m, view.s, view.target = self.m[r0:r1], self.s[r0:r1], self.target[r0:r1]
        view.zs = None if self.zs is None else self.zs[r0:r1]
        return view


def _logits(tile: torch.Tensor, temperature: Any, softcap: float | None) -> tuple[torch.Tensor, Any]:
    """The tile's logits as the distribution sees them, in fp32: capped (``softcap``), then
    divided by the temperature (a number, or [C] per row); and the cap's tanh (None: no cap)."""
    import torch

    z = tile.float()
    capped = None
    if softcap is not None:
        capped = torch.tanh(z / softcap)
        z = capped * softcap
    if _is_tensor(temperature):
        z = z / temperature[:, None]
    elif temperature != 1.0:
        z = z / temperature
    return z, capped


def fold_tile(
    tile: torch.Tensor,
    targets: torch.Tensor,
    col0: int,
    temperature: Any,
    stats: RowStats,
    softcap: float | None = None,
) -> None:
    """Fold the logits ``tile`` [C, N] (any float dtype, read as fp32, capped at ``softcap``
    and divided by ``temperature``, a number or [C] per row, in fp32) into ``stats`` (C rows).
    The tile holds the weight's rows ``col0`` to ``col0 + N``; ``targets`` [C] are ids counted
    from the weight's first row."""
    kernels = _triton(tile)
    if kernels is not None:
        kernels.fold(tile, targets, col0, temperature, stats, softcap)
        return
    import torch

    z, _ = _logits(tile, temperature, softcap)
    m = torch.maximum(stats.m, z.amax(dim=1))
    rescale = torch.exp(stats.m - m)
    e = torch.exp(z - m[:, None])
    stats.s.mul_(rescale).add_(e.sum(dim=1))
    if stats.zs is not None:
        stats.zs.mul_(rescale).add_((e * z).sum(dim=1))
    stats.m.copy_(m)
    local = targets - col0
    inside = (local >= 0) & (local < z.shape[1])
    picked = z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0]
    stats.target.copy_(torch.where(inside, picked, stats.target))


def grad_tile(
    tile: torch.Tensor,
    targets: torch.Tensor,
    col0: int,
    temperature: float,
    log_z: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    softcap: float | None = None,
) -> None:
    """Overwrite the logits ``tile`` [C, N] with the gradient of the loss with respect to them
    (before the cap and the temperature: the result is divided by it and, with ``softcap``,
    multiplied by the cap's derivative), computed in fp32 and stored in the tile's dtype.
    ``col0``, ``targets``, ``temperature`` as for ``fold_tile``; ``log_z``, ``entropy``,
    ``grad_logp``, ``grad_entropy``: [C] fp32; a None gradient contributes nothing."""
    kernels = _triton(tile)
    if kernels is not None:
        kernels.grad(tile, targets, col0, temperature, log_z, entropy, grad_logp, grad_entropy, softcap=softcap)
        return
    import torch

    z, capped = _logits(tile, temperature, softcap)
    log_p = z - log_z[:, None]
    p = torch.exp(log_p)
    grad = torch.zeros_like(z)
    if grad_logp is not None:
        cols = torch.arange(col0, col0 + z.shape[1], device=z.device)
        hit = (cols[None, :] == targets[:, None]).float()
        grad += grad_logp[:, None] * (hit - p)
    if grad_entropy is not None:
        grad -= grad_entropy[:, None] * p * (log_p + entropy[:, None])
    if _is_tensor(temperature):
        grad /= temperature[:, None]
    elif temperature != 1.0:
        grad /= temperature
    if capped is not None:
        grad *= 1.0 - capped * capped
    tile.copy_(grad)


def _triton(t: torch.Tensor) -> Any:
    """The Triton kernels for tiles on ``t``'s device, or None for the torch steps (the CPU;
    ``FP32PATCH_TRITON=0``; no Triton)."""
    if not triton_device(t):
        return None
    return _TritonKernels.get()


class _TritonKernels:
    """The per-tile steps as Triton kernels: one program per token row (fold) and per block of
    rows and columns (grad); the same formulas as the torch steps, fp32 throughout."""

    _instance: _TritonKernels | None = None
    _failed = False
    FOLD_BLOCK, FOLD_WARPS = 2048, 8
    GRAD_BM, GRAD_BN, GRAD_WARPS = 32, 256, 8

    @classmethod
    def get(cls) -> _TritonKernels | None:
        if cls._instance is None and not cls._failed:
            try:
                cls._instance = cls()
            except ImportError:
                cls._failed = True
        return cls._instance

    def __init__(self) -> None:
        import triton
        import triton.language as tl

        # The logits as the distribution sees them (``_logits``; ``triton_logits``): capped,
        # ``cap * tanh(z / cap)`` (CAPPED), then divided by one temperature (SCALED) or by the
        # row's (ROW_TEMPS: ``temps`` holds one per row of the tile); every division rounded as
        # torch's is.
        @triton.jit
        def fold_kernel(
            tile, stride, n_cols, targets, col0, temperature, temps, cap, m_ptr, s_ptr, zs_ptr, tz_ptr,
            SCALED: tl.constexpr, ROW_TEMPS: tl.constexpr, CAPPED: tl.constexpr, ENTROPY: tl.constexpr,
            BLOCK: tl.constexpr,
        ):  # fmt: skip
            row = tl.program_id(0).to(tl.int64)
            base = tile + row * stride
            m = tl.load(m_ptr + row)
            s = tl.load(s_ptr + row)
            zs = 0.0
            if ENTROPY:
                zs = tl.load(zs_ptr + row)
            row_t = 1.0
            if ROW_TEMPS:
                row_t = tl.load(temps + row)
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                ok = cols < n_cols
                z = tl.load(base + cols, mask=ok, other=-float("inf")).to(tl.float32)
                z, _ = triton_logits.logits(z, cap, temperature, row_t, CAPPED, SCALED, ROW_TEMPS)
                if CAPPED:  # the cap made the masked -inf -cap
                    z = tl.where(ok, z, -float("inf"))
                new_m = tl.maximum(m, tl.max(z, axis=0))
                rescale = tl.exp(m - new_m)
                e = tl.exp(z - new_m)
                s = s * rescale + tl.sum(e, axis=0)
                if ENTROPY:
                    zs = zs * rescale + tl.sum(tl.where(ok, e * z, 0.0), axis=0)
                m = new_m
            tl.store(m_ptr + row, m)
            tl.store(s_ptr + row, s)
            if ENTROPY:
                tl.store(zs_ptr + row, zs)
            local = tl.load(targets + row) - col0
            if (local >= 0) & (local < n_cols):
                zt = tl.load(base + local).to(tl.float32)
                zt, _ = triton_logits.logits(zt, cap, temperature, row_t, CAPPED, SCALED, ROW_TEMPS)
                tl.store(tz_ptr + row, zt)

        @triton.jit
        def grad_kernel(
            tile, stride, n_rows, n_cols, targets, col0, temperature, temps, cap, log_z, entropy, grad_logp,
            grad_entropy, amax, scale, out16, plain, out_stride,
            SCALED: tl.constexpr, ROW_TEMPS: tl.constexpr, CAPPED: tl.constexpr, LOGP_GRAD: tl.constexpr,
            ENTROPY_GRAD: tl.constexpr, IN_PLACE: tl.constexpr, AMAX: tl.constexpr, FP16: tl.constexpr,
            PLAIN: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        ):  # fmt: skip
            # g = the gradient of a [BM, BN] block of the tile, in fp32; then any of: g stored in
            # place, max |g| per column into amax, fp16(g * scale[col]) and g in plain's dtype
            rm = tl.program_id(0) * BM + tl.arange(0, BM)
            rn = tl.program_id(1) * BN + tl.arange(0, BN)
            row_ok = rm < n_rows
            col_ok = rn < n_cols
            mask = row_ok[:, None] & col_ok[None, :]
            rm64 = rm.to(tl.int64)
            ptrs = tile + rm64[:, None] * stride + rn[None, :]
            z = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
            row_t = 1.0
            if ROW_TEMPS:
                row_t = tl.load(temps + rm, mask=row_ok, other=1.0)[:, None]
            g = triton_logits.logprob_grad(
                z, rm[:, None], row_ok[:, None], rn[None, :] + col0, targets, log_z, grad_logp, entropy,
                grad_entropy, cap, temperature, row_t, CAPPED, SCALED, ROW_TEMPS, LOGP_GRAD, ENTROPY_GRAD,
            )  # fmt: skip
            g = tl.where(mask, g, 0.0)
            if IN_PLACE:
                tl.store(ptrs, g.to(tile.dtype.element_ty), mask=mask)
            if AMAX:
                tl.atomic_max(amax + rn, tl.max(tl.abs(g), axis=0), mask=col_ok)
            out = rm64[:, None] * out_stride + rn[None, :]
            if FP16:
                c = tl.load(scale + rn, mask=col_ok, other=1.0)
                tl.store(out16 + out, (g * c[None, :]).to(tl.float16), mask=mask)
            if PLAIN:
                tl.store(plain + out, g.to(plain.dtype.element_ty), mask=mask)

        @triton.jit
        def strip_kernel(
            tile, s_v, s_t, n_vocab, n_tokens, targets, col0, temperature, temps, cap, log_z, entropy, grad_logp,
            grad_entropy, scale, out16, plain, o_v, o_t,
            SCALED: tl.constexpr, ROW_TEMPS: tl.constexpr, CAPPED: tl.constexpr, LOGP_GRAD: tl.constexpr,
            ENTROPY_GRAD: tl.constexpr, PLAIN: tl.constexpr, PHASES: tl.constexpr, BV: tl.constexpr,
            BT: tl.constexpr,
        ):  # fmt: skip
            # The tile as [vocabulary entries, tokens] (strides s_v, s_t: a tile computed
            # transposed, or a kept one's transposed view): a program owns BV entries' whole
            # strips. It takes their gradient's largest magnitudes (PHASES 2: one pass over the
            # strips; 1: a tile of at most BT tokens, one block, kept), their scales into scale,
            # then writes fp16(g * scale) into out16 and g in plain's dtype into plain (strides
            # o_v, o_t): no atomics, and a strip's second read is its own, soon after its first.
            rv = tl.program_id(0) * BV + tl.arange(0, BV)
            v_ok = rv < n_vocab
            rv64 = rv.to(tl.int64)
            amax = tl.zeros([BV], dtype=tl.float32)
            for phase in tl.static_range(PHASES):
                for t0 in range(0, n_tokens, BT):
                    rt = t0 + tl.arange(0, BT)
                    t_ok = rt < n_tokens
                    mask = v_ok[:, None] & t_ok[None, :]
                    rt64 = rt.to(tl.int64)
                    z = tl.load(tile + rv64[:, None] * s_v + rt64[None, :] * s_t, mask=mask, other=0.0)
                    z = z.to(tl.float32)
                    row_t = 1.0
                    if ROW_TEMPS:
                        row_t = tl.load(temps + rt, mask=t_ok, other=1.0)[None, :]
                    g = triton_logits.logprob_grad(
                        z, rt[None, :], t_ok[None, :], rv[:, None] + col0, targets, log_z, grad_logp, entropy,
                        grad_entropy, cap, temperature, row_t, CAPPED, SCALED, ROW_TEMPS, LOGP_GRAD, ENTROPY_GRAD,
                    )  # fmt: skip
                    g = tl.where(mask, g, 0.0)
                    if phase == 0:
                        amax = tl.maximum(amax, tl.max(tl.abs(g), axis=1))
                    if phase == PHASES - 1:
                        c = triton_logits.pow2_scale(amax)
                        out = rv64[:, None] * o_v + rt64[None, :] * o_t
                        tl.store(out16 + out, (g * c[:, None]).to(tl.float16), mask=mask)
                        if PLAIN:
                            tl.store(plain + out, g.to(plain.dtype.element_ty), mask=mask)
            tl.store(scale + rv, triton_logits.pow2_scale(amax), mask=v_ok)

        self._fold, self._grad, self._strips, self._cdiv = fold_kernel, grad_kernel, strip_kernel, triton.cdiv

    def fold(self, tile, targets, col0, temperature, stats: RowStats, softcap: float | None = None) -> None:
        rows, n = tile.shape
        if not rows:
            return
        assert tile.stride(1) == 1
        scalar, temps, per_row = kernel_temperature(temperature, stats.m)
        self._fold[(rows,)](
            tile, tile.stride(0), n, targets, col0, scalar, temps, 1.0 if softcap is None else softcap,
            stats.m, stats.s, stats.s if stats.zs is None else stats.zs, stats.target,
            SCALED=scalar != 1.0, ROW_TEMPS=per_row, CAPPED=softcap is not None,
            ENTROPY=stats.zs is not None, BLOCK=self.FOLD_BLOCK, num_warps=self.FOLD_WARPS,
        )  # fmt: skip

    def grad(
        self, tile, targets, col0, temperature, log_z, entropy, grad_logp, grad_entropy,
        in_place=True, amax=None, scale=None, out16=None, plain=None, softcap=None,
    ) -> None:  # fmt: skip
        """The gradient of ``tile``, written as asked: in place, its column maxima (into the
        fp32 ``amax``, which must start at 0), ``fp16(g * scale)`` into ``out16``, ``g`` into
        ``plain``. The same bits in every call: no fused multiply-adds (``amax`` must be the
        maximum of exactly the values that another call then converts)."""
        rows, n = tile.shape
        if not rows or not n:
            return
        assert tile.stride(1) == 1
        out = out16 if out16 is not None else plain if plain is not None else tile
        assert out.stride(1) == 1 and (plain is None or plain.stride() == out.stride())
        dummy = log_z
        scalar, temps, per_row = kernel_temperature(temperature, dummy)
        self._grad[(self._cdiv(rows, self.GRAD_BM), self._cdiv(n, self.GRAD_BN))](
            tile, tile.stride(0), rows, n, targets, col0, scalar, temps, 1.0 if softcap is None else softcap, log_z,
            dummy if entropy is None else entropy,
            dummy if grad_logp is None else grad_logp,
            dummy if grad_entropy is None else grad_entropy,
            dummy if amax is None else amax,
            dummy if scale is None else scale,
            tile if out16 is None else out16,
            tile if plain is None else plain,
            out.stride(0),
            SCALED=scalar != 1.0, ROW_TEMPS=per_row, CAPPED=softcap is not None,
            LOGP_GRAD=grad_logp is not None, ENTROPY_GRAD=grad_entropy is not None, IN_PLACE=in_place,
            AMAX=amax is not None, FP16=out16 is not None, PLAIN=plain is not None,
            BM=self.GRAD_BM, BN=self.GRAD_BN, num_warps=self.GRAD_WARPS, enable_fp_fusion=False,
        )  # fmt: skip

    def grad_strips(
        self, tile_t, targets, col0, temperature, log_z, entropy, grad_logp, grad_entropy, scale, out16,
        plain=None, softcap=None,
    ) -> None:  # fmt: skip
        """For a tile seen as [vocabulary entries, tokens] (``tile_t``: computed transposed, or
        a kept tile's ``.t()``): its gradient's power-of-two scales per entry into ``scale``
        [entries], ``fp16(g * scale)`` into ``out16`` and ``g`` into ``plain`` (None: not
        written), both shaped as ``tile_t`` with one layout; the bits ``grad`` gives for the
        same tile in its two passes."""
        n_vocab, n_tokens = tile_t.shape
        if not n_vocab or not n_tokens:
            scale.fill_(1.0)
            return
        assert out16.shape == tile_t.shape and (plain is None or plain.stride() == out16.stride())
        dummy = log_z
        scalar, temps, per_row = kernel_temperature(temperature, dummy)
        light = self.strip_light(temperature, softcap, grad_logp, grad_entropy)
        bv, bt, warps = self.strip_shape(n_tokens, tokens_contiguous=tile_t.stride(1) == 1, light=light)
        self._strips[(self._cdiv(n_vocab, bv),)](
            tile_t, tile_t.stride(0), tile_t.stride(1), n_vocab, n_tokens, targets, col0, scalar, temps,
            1.0 if softcap is None else softcap, log_z,
            dummy if entropy is None else entropy,
            dummy if grad_logp is None else grad_logp,
            dummy if grad_entropy is None else grad_entropy,
            scale, out16, out16 if plain is None else plain, out16.stride(0), out16.stride(1),
            SCALED=scalar != 1.0, ROW_TEMPS=per_row, CAPPED=softcap is not None,
            LOGP_GRAD=grad_logp is not None, ENTROPY_GRAD=grad_entropy is not None, PLAIN=plain is not None,
            PHASES=1 if n_tokens <= bt else 2, BV=bv, BT=bt, num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip

    # Strips (bench/strips.py; bench/RESULTS.md, 2026-12-05). A tile computed transposed (tokens
    # contiguous) of at most STRIP_ONE_BLOCK tokens is held in one block while it is written:
    # STRIP_HELD values (entries x tokens) a program, or one entry's whole strip where that is
    # more, STRIP_VALUES of them a thread (8 warps at 4,096 values, 32 at 16,384). ptxas keeps
    # 8,192 tokens in registers in every flag combination, 16,384 (STRIP_LIGHT_BLOCK) only in the
    # light ones (one gradient, no cap, one temperature: the others spill hundreds of bytes).
    # Taller tiles: STRIP_BV entries a program in blocks of STRIP_BT tokens, each strip read
    # twice. A kept row-major tile (entries contiguous): STRIP_ROW_BV entries a program (a row's
    # segment of them contiguous) in blocks of STRIP_ROW_BT tokens, each strip read twice.
    STRIP_BV, STRIP_BT, STRIP_WARPS = 4, 1024, 8
    STRIP_ONE_BLOCK, STRIP_LIGHT_BLOCK, STRIP_HELD, STRIP_VALUES = 8192, 16384, 4096, 16
    STRIP_ROW_BV, STRIP_ROW_BT, STRIP_ROW_WARPS = 32, 128, 8

    def strip_shape(self, n_tokens: int, tokens_contiguous: bool = True, light: bool = False) -> tuple[int, int, int]:
        """(entries a program, tokens a block, warps) for a tile of ``n_tokens`` tokens;
        ``light``: one gradient, no cap, one temperature (taller tiles are held)."""
        if not tokens_contiguous:
            return self.STRIP_ROW_BV, self.STRIP_ROW_BT, self.STRIP_ROW_WARPS
        if self.strip_holds(n_tokens, light):
            bt = max(16, 1 << (n_tokens - 1).bit_length())
            bv = max(1, self.STRIP_HELD // bt)
            return bv, bt, max(1, min(32, bv * bt // (32 * self.STRIP_VALUES)))
        return self.STRIP_BV, self.STRIP_BT, self.STRIP_WARPS

    def strip_holds(self, n_tokens: int, light: bool) -> bool:
        """Whether a computed tile's strips of ``n_tokens`` tokens are held in one block."""
        return n_tokens <= (self.STRIP_LIGHT_BLOCK if light else self.STRIP_ONE_BLOCK)

    @staticmethod
    def strip_light(temperature, softcap, grad_logp, grad_entropy) -> bool:
        """Whether a strip launch is light (``strip_shape``): one temperature, no cap, one of
        the two gradients."""
        return isinstance(temperature, (int, float)) and softcap is None and (grad_logp is None or grad_entropy is None)


# ---------------------------------------------------------------- the passes


def _forward(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, plan: _Plan, temps=None):
    """log Z, the target's logit and (or None) the entropy per token of the flat ``x`` [T, H]
    (``temps``: per-token temperatures [T], or None for the plan's), and the fp32 logits [T, V]
    when the plan keeps them (else None)."""
    stats = RowStats(x.shape[0], x.device, plan.entropy)
    local = targets - plan.vocab_start
    if plan.keep:
        with _precision(plan.mode, x.device):
            logits = _fwd_mm(plan.mode, x, weight)
        for r0, r1 in _spans(x.shape[0], plan.chunk_rows):
            temperature = plan.temperature if temps is None else temps[r0:r1]
            fold_tile(logits[r0:r1], local[r0:r1], 0, temperature, stats.rows(r0, r1), plan.softcap)
        return (*_merge_ranks(stats, plan), logits)
    fused = _gemm_lse(plan, x, weight)
    if fused is not None:
        for r0, r1 in _spans(x.shape[0], plan.chunk_rows):
            temperature = plan.temperature if temps is None else temps[r0:r1]
            m, s, zs, tz = fused.block_stats(
                x[r0:r1], weight, local[r0:r1], temperature, plan.entropy, softcap=plan.softcap
            )
            stats.m[r0:r1], stats.s[r0:r1], stats.target[r0:r1] = m, s, tz
            if zs is not None:
                stats.zs[r0:r1] = zs
        return (*_merge_ranks(stats, plan), None)
    with _precision(plan.mode, x.device):
        for v0, v1 in _spans(weight.shape[0], plan.chunk_vocab):
            block = weight[v0:v1]
            for r0, r1 in _spans(x.shape[0], plan.chunk_rows):
                tile = _fwd_mm(plan.mode, x[r0:r1], block)
                temperature = plan.temperature if temps is None else temps[r0:r1]
                fold_tile(tile, local[r0:r1], v0, temperature, stats.rows(r0, r1), plan.softcap)
                del tile
    return (*_merge_ranks(stats, plan), None)


def _gemm_lse(plan: _Plan, x: torch.Tensor, weight: torch.Tensor) -> Any:
    """The fused GEMM + logsumexp kernel module when it computes this forward (the fp32out
    modes, whose forward is the fp32-output GEMM, on a GPU and operands it takes, Triton not
    switched off: ``FP32PATCH_TRITON=0``, or ``FP32PATCH_GEMM_LSE=0`` for this kernel alone), else
    None: then the tiles are written and folded."""
    if plan.mode in _UPCAST_MODES or not triton_device(x) or env_switch(GEMM_LSE_ENV_VAR) is False:
        return None
    from fp32patch.runtime.kernels import gemm_lse_triton

    return gemm_lse_triton if gemm_lse_triton.usable(x, weight) else None


def _merge_ranks(stats: RowStats, plan: _Plan):
    """log Z, the target's logit and the entropy (or None) from this rank's statistics, merged
    over the tensor-parallel group when there is one."""
    import torch

    m = stats.m
    world, _ = _world_and_rank(plan.group)
    if world > 1:
        import torch.distributed as dist

        m = stats.m.clone()
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=plan.group)
        rescale = torch.exp(stats.m - m)
        sums = [stats.s * rescale, stats.target] + ([] if stats.zs is None else [stats.zs * rescale])
        packed = torch.stack(sums)
        dist.all_reduce(packed, group=plan.group)
        stats.s, stats.target = packed[0], packed[1]
        stats.zs = None if stats.zs is None else packed[2]
    log_z = m + torch.log(stats.s)
    ent = None if stats.zs is None else log_z - stats.zs / stats.s
    return log_z, stats.target, ent


def _backward(
    ctx: Any, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad_logp, grad_entropy, logits=None
):
    """The input gradient (fp32, [T, H], this rank's vocabulary part) and the weight gradient;
    ``logits``: the forward's fp32 logits when it kept them (the tiles are read, not recomputed)."""
    import torch

    plan: _Plan = ctx.plan
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    main_grad = ctx.main_grad
    local = targets - plan.vocab_start
    dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_dx else None
    vocab_spans = _spans(weight.shape[0], plan.chunk_vocab)
    dw = None
    # one vocabulary block: its weight gradient is the whole one (no buffer to copy it into, which
    # would hold a second [V, H] beside it)
    whole = need_dw and main_grad is None and len(vocab_spans) == 1
    if need_dw and main_grad is None and not whole:
        dw = torch.empty_like(weight)
    with _precision(plan.mode, x.device):
        row_spans = _spans(x.shape[0], plan.chunk_rows)
        # one tile in a block: its weight gradient comes out of the GEMM in the weight's dtype
        share_dtype = weight.dtype if len(row_spans) == 1 else torch.float32
        # one tile of rows: its fp16 copy for the weight gradient's GEMM is made once and serves
        # every vocabulary block (two launches and a read of x fewer a block, the host time of a
        # short call); with several, each block makes its tile's again (holding all of them would
        # hold a copy of x through the backward)
        x_scaled: dict | None = {} if len(row_spans) == 1 else None
        for v0, v1 in vocab_spans:
            block = weight[v0:v1]
            acc = None if main_grad is None else main_grad[v0:v1]
            for r0, r1 in row_spans:
                rows = slice(r0, r1)
                row_grads = _RowGrads(
                    local[rows], v0, plan.temperature if ctx.temps is None else ctx.temps[rows], ctx.log_z[rows],
                    None if ctx.ent is None else ctx.ent[rows],
                    None if grad_logp is None else grad_logp[rows],
                    None if grad_entropy is None else grad_entropy[rows],
                )  # fmt: skip
                dx_rows = None if dx is None else dx[rows]
                kept = None if logits is None else logits[rows, v0:v1]
                acc = _tile_backward(
                    plan, x[rows], block, row_grads, dx_rows, need_dw, acc, share_dtype, kept, x_scaled
                )
            if whole:
                dw = acc.to(weight.dtype)  # (acc is in the weight's dtype already unless several row tiles)
            elif dw is not None:
                dw[v0:v1].copy_(acc)
            del acc
    return dx, dw


@dataclass(frozen=True)
class _RowGrads:
    """What a tile's gradient needs of its rows (``grad_tile``'s arguments after the tile)."""

    targets: Any
    col0: int
    temperature: Any  # a number, or [C] per row
    log_z: Any
    entropy: Any
    grad_logp: Any
    grad_entropy: Any


# Modes whose backward GEMMs take 16-bit copies of the gradient: on CUDA the Triton kernel
# writes those copies straight from the logits tile (no fp32 gradient tile is written).
_FUSED_MODES = ("fp32out", "fp32out-bf16grad")


def _tile_backward(
    plan: _Plan, xr, block, rows: _RowGrads, dx_rows, want_dw: bool, acc, dw_dtype, kept=None, x_scaled=None
):
    """One tile's share of the gradients, in the plan's mode: its logits computed again and
    turned into the gradient with respect to them, then ``lm_head_gemm``'s backward GEMMs. The
    input gradient is added into the fp32 ``dx_rows`` (None: not wanted). Returns the weight
    gradient (None: not wanted): ``acc`` (fp32) with this tile's share added, or, without an
    ``acc``, this tile's share alone in ``dw_dtype`` (the weight's dtype when it is the
    block's only tile: rounded once, as lm_head_gemm delivers it).

    On CUDA, for the fp32out modes, the fp32 gradient is never stored: one kernel pass takes
    its column maxima (fp32out: the per-column power-of-two scales, ``fp32out._pow2_scale``),
    a second writes the copies the GEMMs take (fp32out: fp16 times the scale for the weight
    gradient, bf16 for the input gradient; fp32out-bf16grad: bf16 for both), as
    ``fp32out.fp16_scaled_grads`` makes them from a stored gradient, and the products are
    accumulated in fp32 in the GEMM (``addmm``) or by fp32out's unscale kernel.

    ``kept``: the tile's logits as the forward kept them (a view of its fp32 logits), read and
    never written (a graph kept for a second backward sees them whole); None: computed here.
    ``x_scaled``: a dict that keeps ``xr``'s scaled fp16 copy for the next call with the same
    ``xr`` (None: made for this call alone)."""
    import torch

    from fp32patch.runtime.kernels import fp32out

    args = (rows.targets, rows.col0, rows.temperature, rows.log_z, rows.entropy, rows.grad_logp, rows.grad_entropy)
    kernels = _triton(block)
    fused = kernels is not None and plan.mode in _FUSED_MODES and block.dtype in (torch.bfloat16, torch.float16)
    scaled = plan.mode == "fp32out" and want_dw
    if fused and scaled and strips(kernels, xr.shape[0], kept is not None, plan, rows):
        return _strip_backward(plan, kernels, xr, block, args, dx_rows, acc, dw_dtype, x_scaled, kept)
    tile = kept if kept is not None else _fwd_mm(plan.mode, xr, block)
    if not fused:
        if kept is not None:  # the torch steps write the gradient over the tile
            tile = tile.clone()
        grad_tile(tile, *args, softcap=plan.softcap)
        if want_dw and acc is None and dw_dtype == torch.float32:
            acc = torch.zeros(block.shape, dtype=torch.float32, device=block.device)
        part, dw = _backward_gemms(
            plan.mode, tile, block, xr if want_dw else None, dx_rows is not None, torch.float32, acc
        )
        if part is not None:
            dx_rows.add_(part)
        return dw
    plain_dtype = block.dtype if dx_rows is not None or not scaled else None
    scale, g16, plain = pass_copies(kernels, tile, args, scaled, plain_dtype, plan.softcap)
    del tile
    if dx_rows is not None:
        _accumulate_product(dx_rows, plain, block)
    if not want_dw:
        return None
    if scaled:
        del plain
        return _scaled_weight_grad(g16.t(), scale, xr, acc, dw_dtype, x_scaled)
    if acc is None:
        return fp32out.mm(plain.t(), xr).to(dw_dtype)
    _accumulate_product(acc, plain.t(), xr)
    return acc


def strips(kernels, n_tokens: int, kept: bool, plan: _Plan, rows: _RowGrads) -> bool:
    """Whether an fp32out backward tile of ``n_tokens`` tokens takes the strip kernel:
    ``FP32PATCH_STRIPS=1`` every one, ``0`` none; by default a tile computed again whose strips
    the kernel holds in one block (bench/strips.py on an H100, 2026-12-05: its copies 0.56-0.73x
    the two passes' time, the tile's whole backward 0.80-0.97x, at 4,096-16,384 tokens; a strip
    read twice, or a kept row-major tile read through its transposed view, was no faster than
    the passes or slower)."""
    forced = env_switch(STRIPS_ENV_VAR)
    if forced is not None:
        return forced
    if kept:
        return False
    light = kernels.strip_light(rows.temperature, plan.softcap, rows.grad_logp, rows.grad_entropy)
    return kernels.strip_holds(n_tokens, light)


def _strip_backward(plan: _Plan, kernels, xr, block, args, dx_rows, acc, dw_dtype, x_scaled, kept=None):
    """``_tile_backward`` in fp32out through the strip kernel, which gives each program whole
    vocabulary entries: their largest gradient, scale and 16-bit copies from one launch, where
    the two passes take three (the maxima, the scales, the copies), and each entry's strip read
    twice by the program that owns it rather than by two passes over the whole tile; the
    passes' bits for the same tile. A recomputed tile is computed transposed ([block, rows],
    ``block @ xr.T``: each entry's strip contiguous; a GEMM with its own fp32 summation order, so
    a few of its copies round the other way from the passes' recompute), its copies laid out so,
    as the weight gradient's GEMM takes its operand (the input gradient's takes a transposed
    view); a kept tile ([rows, block], read not written) is read through its transposed view,
    its copies laid out as it."""
    tile_t = _fwd_mm(plan.mode, block, xr) if kept is None else kept.t()
    scale, g16, plain = strip_copies(kernels, tile_t, args, None if dx_rows is None else block.dtype, plan.softcap)
    del tile_t
    if plain is not None:
        _accumulate_product(dx_rows, plain.t(), block)
        del plain
    return _scaled_weight_grad(g16, scale, xr, acc, dw_dtype, x_scaled)


def pass_copies(kernels, tile, args, scaled: bool, plain_dtype, softcap=None):
    """The 16-bit copies of a [rows, entries] tile's gradient in the two passes: with ``scaled``
    its column maxima (one pass), their scales, then fp16 times the scale; the gradient in
    ``plain_dtype`` (None: not written). Returns (scale, fp16 copy, plain copy), None where not
    made; ``args``: ``_RowGrads``' fields in order."""
    import torch

    from fp32patch.runtime.kernels import fp32out

    scale = g16 = plain = None
    if scaled:
        amax = torch.zeros(tile.shape[1], dtype=torch.float32, device=tile.device)
        kernels.grad(tile, *args, in_place=False, amax=amax, softcap=softcap)
        scale = fp32out.pow2_scales(amax)
        g16 = torch.empty(tile.shape, dtype=torch.float16, device=tile.device)
    if plain_dtype is not None:
        plain = torch.empty(tile.shape, dtype=plain_dtype, device=tile.device)
    kernels.grad(tile, *args, in_place=False, scale=scale, out16=g16, plain=plain, softcap=softcap)
    return scale, g16, plain


def strip_copies(kernels, tile_t, args, plain_dtype, softcap=None):
    """``pass_copies``' scaled copies from the strip kernel, for a tile seen as [entries, rows]
    (``tile_t``: computed so, or a row-major tile's ``.t()``), laid out as ``tile_t`` is
    (contiguous, or the row-major tile's transposed view). Returns (scale, fp16, plain or None)."""
    import torch

    rows_major = tile_t.stride(1) != 1
    shape = tile_t.shape[::-1] if rows_major else tile_t.shape

    def empty(dtype):
        out = torch.empty(shape, dtype=dtype, device=tile_t.device)
        return out.t() if rows_major else out

    scale = torch.empty(tile_t.shape[0], dtype=torch.float32, device=tile_t.device)
    g16 = empty(torch.float16)
    plain = None if plain_dtype is None else empty(plain_dtype)
    kernels.grad_strips(tile_t, *args, scale=scale, out16=g16, plain=plain, softcap=softcap)
    return scale, g16, plain


def _scaled_weight_grad(g16, scale, xr, acc, dw_dtype, x_scaled):
    """A tile's weight gradient from its gradient's scaled fp16 copy ``g16`` [entries, rows]
    (scales [entries]): ``acc`` with it added (fp32), or, without an ``acc``, the share alone in
    ``dw_dtype`` (the unscale pass writes it, in place on the fp32 product when that is fp32:
    nothing to zero, nothing to add). ``xr``'s scaled copy is made once a call (``x_scaled``)."""
    import torch

    from fp32patch.runtime.kernels import fp32out

    out_dtype = torch.float32 if acc is not None else dw_dtype
    x16 = None if x_scaled is None else x_scaled.get("x")
    if x16 is None:
        x16, _ = fp32out._fp16_by_column(xr)
        if x_scaled is not None:
            x_scaled["x"] = x16
    return fp32out._scaled_product((g16, scale.view(-1, 1)), xr, out_dtype, acc, b_scaled=x16)


# (device type, dtype name) -> whether torch.addmm(..., out_dtype=float32) runs there
_ADDMM_SUPPORT: dict[tuple[str, str], bool] = {}


def _accumulate_product(acc, a, b) -> None:
    """``acc += a @ b`` for 16-bit ``a``, ``b`` and an fp32 ``acc``: in the GEMM's epilogue
    where torch has ``addmm(out_dtype=float32)`` (CUDA), else as fp32out's product added."""
    import torch

    from fp32patch.runtime.kernels import fp32out

    key = (acc.device.type, str(a.dtype))
    if key not in _ADDMM_SUPPORT:
        ok = False
        if not (acc.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            one = torch.ones(1, 1, dtype=a.dtype, device=a.device)
            out = torch.zeros(1, 1, dtype=torch.float32, device=a.device)
            try:
                ok = torch.addmm(out, one, one, out_dtype=torch.float32, out=out).item() == 1.0
            except (TypeError, NotImplementedError, RuntimeError):
                ok = False
        _ADDMM_SUPPORT[key] = ok
    if _ADDMM_SUPPORT[key]:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(fp32out.mm(a, b))


def _function() -> type:
    global _FUNCTION
    if _FUNCTION is None:
        _FUNCTION = _make_function()
    return _FUNCTION


_FUNCTION: type | None = None


def _make_function() -> type:
    import torch

    class ChunkedLogProbs(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temps, plan: _Plan):
            if plan.fuse_wgrad and hasattr(weight, "__fsdp_param__"):
                raise NotImplementedError(
                    "chunked_logprobs: Megatron-FSDP weights (__fsdp_param__) are not supported; "
                    "use Megatron's DDP or turn gradient_accumulation_fusion off"
                )
            ctx.set_materialize_grads(False)
            full = _gather_tokens(hidden, plan) if plan.sequence_parallel else hidden
            x = full.reshape(-1, full.shape[-1])
            flat_targets = targets.reshape(-1).long()
            log_z, target_logit, ent, logits = _forward(x, weight, flat_targets, plan, temps)
            # fresh tensors, no views made in here: a caller may scale them in place
            log_probs = target_logit.view(targets.shape) - log_z.view(targets.shape)
            ctx.plan = plan
            ctx.temps = temps
            ctx.log_z = log_z
            ctx.ent = ent
            ctx.main_grad = weight.main_grad if plan.fuse_wgrad and hasattr(weight, "main_grad") else None
            ctx.hidden_shape = hidden.shape
            # the kept logits are saved as the inputs are: autograd frees them once this backward has run
            ctx.save_for_backward(hidden, weight, flat_targets, logits)
            return log_probs, None if ent is None else ent.view(targets.shape).clone()

        @staticmethod
        def backward(ctx: Any, grad_logp: torch.Tensor | None, grad_entropy: torch.Tensor | None):
            hidden, weight, targets, logits = ctx.saved_tensors
            plan: _Plan = ctx.plan
            if grad_logp is None and grad_entropy is None:
                return None, None, None, None, None
            full = _gather_tokens(hidden, plan) if plan.sequence_parallel else hidden
            x = full.reshape(-1, full.shape[-1])
            grad_logp = None if grad_logp is None else grad_logp.reshape(-1).float().contiguous()
            grad_entropy = None if grad_entropy is None else grad_entropy.reshape(-1).float().contiguous()
            dx, dw = _backward(ctx, x, weight, targets, grad_logp, grad_entropy, logits)
            if dx is not None:
                dx = _sum_input_grad(dx, plan).to(hidden.dtype).view(ctx.hidden_shape)
            if ctx.needs_input_grad[1]:
                dw = _deliver_weight_grad(weight, ctx.main_grad, ctx.main_grad if ctx.main_grad is not None else dw)
            return dx, dw, None, None, None

    return ChunkedLogProbs


# ---------------------------------------------------------------- tensor-parallel edges


def _gather_tokens(hidden: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """Sequence parallelism: every rank's tokens (dim 0), in rank order."""
    import torch
    import torch.distributed as dist

    world, _ = _world_and_rank(plan.group)
    if world == 1:
        return hidden
    parts = [torch.empty_like(hidden) for _ in range(world)]
    dist.all_gather(parts, hidden.contiguous(), group=plan.group)
    return torch.cat(parts, dim=0)


def _sum_input_grad(dx: torch.Tensor, plan: _Plan) -> torch.Tensor:
    """This rank's vocabulary part of the input gradient summed over the group, in fp32; under
    sequence parallelism only this rank's tokens are kept (a reduce-scatter)."""
    import torch.distributed as dist

    world, rank = _world_and_rank(plan.group)
    if world == 1 or not plan.reduce_input_grad:
        return dx
    if plan.sequence_parallel and dist.get_backend(plan.group) != "gloo":
        out = dx.new_empty((dx.shape[0] // world, *dx.shape[1:]))
        dist.reduce_scatter_tensor(out, dx, group=plan.group)
        return out
    # gloo has no reduce-scatter: all-reduce, then keep this rank's tokens
    dist.all_reduce(dx, group=plan.group)
    if plan.sequence_parallel:
        share = dx.shape[0] // world
        return dx[rank * share : (rank + 1) * share]
    return dx
