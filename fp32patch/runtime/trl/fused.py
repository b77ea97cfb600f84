"""TRL 1.15+'s chunked log-probs at fp32 grade, for the models the switch marks.

TRL's ``add_fused_lm_head`` replaces a model's ``forward`` so that ``model(..., labels=...,
fused_lm_head=True)`` returns per-token log-probs computed by ``ChunkedLogProbFunction`` from the
backbone's hidden states and ``get_output_embeddings().weight``, never through the head module.
That kernel computes each tile ``hidden @ weight.T`` in the autocast dtype, so its logits are
rounded to bf16 before its fp32 logsumexp. The patched ``_fused_forward`` calls
``fused_kernel(model).apply(...)`` instead, with the same arguments, for a model that
``mark`` marked: ``ChunkedLogProbs`` computes through ``kernels.chunked_logprobs``, from the
operands TRL's kernel computes with (under TRL's bf16 autocast the autocast copy of the fp32
master weights: the values vLLM receives), with fp32 products, the temperature divided on the
fp32 logits, and ``lm_head_gemm``'s backward in the trainer's mode.

What TRL gathered stays TRL's: FSDP2's ``full_tensor()`` and DeepSpeed ZeRO-3's gather around
the call. Under ZeRO-3 a bf16 weight is copied for the backward: the backward must not read a
partitioned (emptied) parameter. With DeepSpeed 0.19.8 it never meets one (ZeRO-3's discovery of
external parameters gathers the head when TRL's forward reads it, and gathers it again before the
backward; tests/heavy/trl/test_zero3_fused.py), so the copy is a guard for other releases that
costs one bf16 head from the forward to the backward. A final logit soft-cap (Gemma's) and a
logit scale are applied as TRL's kernel applies them, on the fp32 logits: the scale, then the
cap, then the temperature. Refused, at ``mark`` or at the call: a head with a bias (fp32patch's
chunked piece adds none), a logit scale or a cap <= 0, outputs other than the log-probs and the
entropy, and operands in fp32 (a trainer in fp32 throughout).

Nothing here imports torch at import time.
"""

from __future__ import annotations

from typing import Any

from fp32patch.runtime.heads.hf import UnsupportedLmHeadError

# The attribute the switch sets on the policy's and the reference model's instance (the model
# TRL's fused forward is bound to, and the one VLLMGeneration holds): the trainer's mode. The
# patched files read it by this name (trl_gate.py) without importing fp32patch.
MARK = "_fp32patch_lm_head"
# TRL's per-token outputs fp32patch's chunked piece computes
OUTPUTS = ("log_probs", "entropy")
_LOW_PRECISION = ("bfloat16", "float16")


def marked_mode(model: Any) -> str | None:
    """The mode ``mark`` gave ``model`` (through PEFT's wrappers, which forward attributes), or None."""
    return getattr(model, MARK, None)


def mark(model: Any, mode: str, *, role: str) -> Any:
    """Route ``model``'s chunked log-probs through ``ChunkedLogProbs(mode)`` (and tell the rollout
    the switch is on); refuses a head the chunked piece cannot compute. Returns ``model``."""
    from fp32patch.runtime.heads.hf import _check_convertible, _find_head, chunkable_head

    _check_convertible(*_find_head(model))  # first: an adapter on the head is the refusal users meet
    chunkable_head(model, role=role, turn_off="turn fp32_lm_head off")
    setattr(model, MARK, mode)
    return model


# The tile for TRL (tokens x vocabulary entries): TRL's own (4096 tokens, 32768 entries), widened
# below 4096 tokens by choose_tiles within the same logits. 8192 x 32768, measured on an H200
# against TRL 1.16's own bf16 tiles (bench/RESULTS.md, 2026-12-03 16:40 UTC: 1.024x / 1.037x of
# its forward + backward at 16k / 64k tokens, head alone), held a whole step 0.51 GiB over TRL's
# at 16k tokens of a 0.5B model (bench/step_counts.py, 2026-12-05): twice TRL's tile of logits,
# 8 bytes each in the backward. TRL's tile holds it at TRL's peak; its time is the GPU's to say.
TILE = (4096, 32768)
# The logits one of our tiles may hold: TRL's tile cost its step 0.76 GiB at the backward's peak
# (about 6 bytes a logit), ours cost 8 bytes a logit (an H100 step of a 0.5B model at 4,096
# tokens, 2026-12-05, bench/RESULTS.md: TRL's own tile held the step 0.24 GiB under ours of the
# same shape). 4096 x 22528 logits: 0.69 GiB, under TRL's with a margin for what was not measured.
TILE_LOGITS = TILE[0] * 22528
# The rows a tile may take, within TILE_LOGITS: above 4,096 tokens a tile takes up to this many
# (narrower), so that a vocabulary block has fewer row tiles whose fp32 weight-gradient products
# are each added into the block's accumulator (fp32out's scaled product: a [block, H] fp32 pass
# per tile), for more input-gradient products ([T, H], narrower). 16,384 x 5632 against 4096 x
# 22528 at 16,384 tokens of a 0.5B model (an H100, 2026-12-05, bench/RESULTS.md): 330.6 against
# 333.2 ms of device time a step in fp32out, 323.0 against 323.9 in fp32out-bf16grad, the same
# peak. Below 4,096 tokens the tile is what it was; at 4,096 it is one row tile of seven equal
# blocks (21,760 entries), where 4,096-row tiles took six of 22,528 and one of 16,768.
ROWS = 16384


def tile(tokens: int, vocab: int, hidden: int) -> tuple[int, int]:
    """The tile a call of ``tokens`` rows over a ``vocab``-entry head takes."""
    from fp32patch.runtime.kernels.chunked_logprobs import choose_tiles

    return choose_tiles(tokens, vocab, hidden, rows=ROWS, logits=TILE_LOGITS)


class ChunkedLogProbs:
    """``apply`` takes TRL's ``ChunkedLogProbFunction.apply`` arguments (1.15, 1.16) and returns
    what it returns, ``(log_probs, entropy, None, None, None)``, computed at fp32 grade."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __repr__(self) -> str:
        return f"ChunkedLogProbs(mode={self.mode!r})"

    def apply(
        self,
        hidden: Any,
        weight: Any,
        bias: Any,
        targets: Any,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = OUTPUTS,
    ) -> tuple[Any, Any, None, None, None]:
        from fp32patch.runtime.kernels.chunked_logprobs import chunked_logprobs

        unsupported = [name for name in outputs if name not in OUTPUTS]
        cap = final_logit_softcapping
        if unsupported or bias is not None or not logit_scale > 0 or (cap is not None and not cap > 0):
            raise UnsupportedLmHeadError(
                f"fp32 LM head: TRL asks the chunked log-probs for {_asked(unsupported, bias, final_logit_softcapping, logit_scale)}, "
                f"which fp32patch's chunked piece does not compute (it gives {', '.join(OUTPUTS)} of an unbiased "
                "head, a positive scale and cap); turn fp32_lm_head off for this trainer"
            )
        dtype = _compute_dtype(hidden)
        operand = weight.to(dtype)
        if operand is weight and hasattr(weight, "ds_id"):
            # a ZeRO-3 parameter may be partitioned (emptied) again before the backward reads it
            operand = weight.clone()
        rows, width = tile(targets.numel(), operand.shape[0], operand.shape[1])
        # the scale multiplies the logits before the cap and the temperature: cap(s z) / T is
        # cap'(z) / (T / s) with the cap c / s (c tanh(s z / c) = s (c / s) tanh(z / (c / s))),
        # which the chunked piece computes on the fp32 logits
        scale = float(logit_scale)
        result = chunked_logprobs(
            hidden.to(dtype),
            operand,
            targets,
            mode=self.mode,
            temperature=float(temperature) / scale,
            softcap=None if cap is None else float(cap) / scale,
            entropy="entropy" in outputs,
            chunk_rows=rows,
            chunk_vocab=width,
        )
        log_probs, entropy = result if "entropy" in outputs else (result, None)
        return log_probs, entropy, None, None, None


def fused_kernel(model: Any) -> ChunkedLogProbs:
    """What the patched ``_fused_forward`` calls in place of TRL's kernel for a marked model."""
    return ChunkedLogProbs(getattr(model, MARK))


def _compute_dtype(hidden: Any) -> Any:
    """The dtype TRL's own kernel computes the tiles in: the autocast dtype under autocast, else
    the hidden states'; fp32 is refused (a trainer in fp32 throughout)."""
    import torch

    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    if str(dtype).removeprefix("torch.") not in _LOW_PRECISION:
        raise UnsupportedLmHeadError(
            f"fp32 LM head: the chunked log-probs compute in {str(dtype).removeprefix('torch.')} here (no bf16/fp16 "
            "autocast, fp32 hidden states): the logits are fp32 already, from other values than vLLM's bf16 ones; "
            "turn bf16 on, or fp32_lm_head off"
        )
    return dtype


def _asked(unsupported: list[str], bias: Any, softcap: Any, scale: float) -> str:
    parts = [f"outputs {', '.join(unsupported)}"] if unsupported else []
    parts += ["a bias"] if bias is not None else []
    parts += [f"a soft-cap of {softcap}"] if softcap is not None and not softcap > 0 else []
    parts += [f"a logit scale of {scale}"] if not scale > 0 else []
    return ", ".join(parts)
