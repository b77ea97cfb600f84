"""SkyRL's fused Megatron LM-head path (``trainer.fused_lm_head_logprob``) at fp32 grade.

Stock SkyRL's fused path never calls the output layer: Megatron's ``output_processor`` hands the
decoder's hidden states and the head's weight to SkyRL's log-prob code, which divides the bf16
weight by the temperature (rounding ``W / T`` to bf16 again) and computes each chunk's logits in
bf16 (then ``.float()``), for the token log-probs (``_fused_lm_head_logprob_apply``, with a
backward) and for the entropy metric (``_fused_vocab_parallel_entropy_from_hidden``). No
[B, T, V / tp] logits are held: the path exists for long context.

Where the weight is an output layer fp32patch wired (``kit.fused.wired_head``: the policy's or the
reference's, as ``wiring.wire_megatron`` wired it), the patched ``model_utils.py`` calls here
instead, and the same chunked shape is computed by ``kernels.chunked_logprobs`` in the head's mode:
fp32 logits per tile from the bf16 operands vLLM gets, the temperature dividing the fp32 logits,
the vocabulary shards' statistics all-reduced over the tensor-parallel group, the weight gradient
added into Megatron's ``main_grad`` where the output layer fuses gradient accumulation. Still no
[B, T, V / tp] logits. Where the weight is no wired head's, SkyRL's own code runs untouched.

The temperature: ``scaled_weight`` takes the place of SkyRL's ``lm_head_weight / temperature``
and gives back a view of the weight that carries the temperature (``TEMPERATURE``) and the weight
itself (``BASE``), so that the log-prob call below divides the fp32 logits instead.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fp32patch.runtime.skyrl.config import KEY, STACK

TEMPERATURE = "_fp32patch_temperature"
BASE = "_fp32patch_base"


def fused_mode(weight: Any) -> str | None:
    """The mode of the wired Megatron head whose weight ``weight`` is (or a view ``scaled_weight``
    made of it), or None: SkyRL's own fused kernel runs."""
    found = _head(weight)
    return None if found is None else found[1]


def scaled_weight(weight: Any, temperature: float) -> Any:
    """What SkyRL's ``lm_head_weight / temperature`` becomes for a wired head: the weight itself
    (a view of it), marked with the temperature the fp32 logits are to be divided by."""
    view = weight.view_as(weight)
    setattr(view, BASE, getattr(weight, BASE, weight))
    setattr(view, TEMPERATURE, float(temperature) * float(getattr(weight, TEMPERATURE, 1.0)))
    return view


def fused_logprobs(
    hidden: Any,
    weight: Any,
    target: Any,
    vocab_start: int,
    tp_group: Any,
    inference_only: bool,
    chunk_size: int | None = None,
) -> Any | None:
    """SkyRL's ``_fused_lm_head_logprob_apply`` for a wired head: the token log-probs [B, S] (fp32,
    combined over the tensor-parallel ranks) of ``target`` (global ids, [B, S]) from ``hidden``
    [B, S, H] and this rank's weight shard [V / tp, H] starting at ``vocab_start``. None where the
    weight is no wired head's. ``chunk_size``: SkyRL's ``trainer.logprobs_chunk_size``, whose
    chunks bound its own path's memory (``keep_logits``)."""
    found = _head(weight)
    if found is None:
        return None
    import torch

    from fp32patch.runtime.kernels.chunked_logprobs import chunked_logprobs

    owner, mode = found
    group, world = _group(tp_group)
    temperature = getattr(weight, TEMPERATURE, 1.0)
    with torch.no_grad() if inference_only else contextlib.nullcontext():
        log_probs = chunked_logprobs(
            hidden,
            getattr(weight, BASE, weight),
            target,
            mode=mode,
            temperature=temperature,
            tp_group=group if world > 1 else None,
            vocab_start=vocab_start if world > 1 else None,
            fuse_wgrad=bool(getattr(owner.output_layer, "gradient_accumulation_fusion", False)),
            # Megatron's output_processor handed the hidden states through a tensor-parallel region
            # (copy_to_..., or gather_from_sequence_parallel_region) whose backward sums their
            # gradient over the group: each rank gives its vocabulary part
            reduce_input_grad=False,
            keep_logits=keep_logits(hidden.shape[:-1].numel(), chunk_size),
        )
    STACK.tell_once(
        ("fused", mode, world),
        "fp32patch: SkyRL's fused LM-head log-probs (trainer.fused_lm_head_logprob, %s) compute fp32 logits per "
        "tile in mode %r (tensor parallel size %d), the temperature applied to them in fp32; "
        "trainer.logprobs_chunk_size and fused_lm_head_logprob_backend do not apply (the tile is "
        "chunked_logprobs' measured default)",
        KEY,
        mode,
        world,
    )
    return log_probs


def keep_logits(tokens: int, chunk_size: int | None) -> bool | None:
    """Whether the chunked piece keeps its fp32 logits from the forward for the backward: never
    where SkyRL's own path would hold fewer logits than this call has (``tokens`` over its chunk:
    its peak bounds ours), else as the piece chooses (``chunked_logprobs``: kept up to
    ``KEEP_LOGITS_BYTES``). SkyRL's chunk holds the chunk's bf16 logits, their fp32 copy and its
    backward's fp32 gradient: a call of at most a chunk's tokens keeping its fp32 logits stays
    under that (a whole step at 0.5B/1,024 tokens on an H100: 4.5 GiB kept, 4.0 recomputed,
    SkyRL's own 5.4), and saves the backward's GEMM and launches where a short step is set by
    the host (bench/RESULTS.md, 2026-12-05). ``chunk_size`` None: SkyRL holds every token's
    logits itself."""
    if chunk_size is not None and tokens > chunk_size:
        return False
    return None


def fused_entropy(hidden: Any, weight: Any, tp_group: Any, temperature: float) -> Any | None:
    """SkyRL's ``_fused_vocab_parallel_entropy_from_hidden`` for a wired head: the entropy [B, S]
    (fp32) of each position's distribution at ``temperature``, a metric (no gradient), from
    ``hidden`` [B, S, H] and this rank's weight shard. None where the weight is no wired head's."""
    found = _head(weight)
    if found is None:
        return None
    import torch

    from fp32patch.runtime.kernels.chunked_logprobs import chunked_logprobs

    _, mode = found
    group, world = _group(tp_group)
    base = getattr(weight, BASE, weight)
    with torch.no_grad():
        targets = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
        _, entropy = chunked_logprobs(
            hidden,
            base,
            targets,
            mode=mode,
            temperature=float(temperature) * float(getattr(weight, TEMPERATURE, 1.0)),
            entropy=True,
            tp_group=group if world > 1 else None,
        )
    return entropy


def _head(weight: Any) -> tuple[Any, str] | None:
    from fp32patch.runtime.kit.fused import wired_head

    return wired_head(getattr(weight, BASE, weight), trainer="megatron")


def _group(tp_group: Any) -> tuple[Any, int]:
    import torch.distributed as dist

    if tp_group is None or not (dist.is_available() and dist.is_initialized()):
        return None, 1
    return tp_group, dist.get_world_size(tp_group)
