"""verl's fused log-prob paths at fp32 grade under ``actor_rollout_ref.model.fp32_lm_head``.

With ``actor_rollout_ref.model.use_fused_kernels`` verl replaces the model's forward: after the
decoder it computes each token's log-prob and entropy from the hidden states and
``lm_head.weight`` and never calls the head, through ``fused_kernel_options.impl_backend``:

- ``torch`` (``FusedLinearForPPO``): bf16 logits divided by the temperature in bf16, then fp32;
  bf16 dlogits; the input and weight gradients accumulated in bf16 (512-token chunks);
- ``liger`` (0.9): Liger's fused linear cross-entropy (bf16 tiles);
- ``triton`` (``linear_cross_entropy``, verl's kernel): fp32 logits, never rounded; its backward
  rounds dlogits to bf16, returns the weight gradient of a bf16 GEMM in bf16 and sums the input
  gradient in bf16 over vocabulary splits of 9504 entries.

Where the weight is that of a head fp32patch wired (the FSDP engine's and the legacy FSDP
workers' actor and ref: ``kit.fused`` finds the head from the weight), the patched
``FusedLinearForPPO.forward`` (torch and liger) and ``linear_cross_entropy`` (triton) hand the call
here: ``kernels.chunked_logprobs`` in the head's mode, the entropy with it, the temperature
applied to the fp32 logits; both come back in fp32, shaped as verl's own. Any other weight gets
None, and verl's kernel runs, bit for bit.

verl's Megatron engine keeps verl's triton kernel (its caller gathers the sequence-parallel
hidden states and reduces their gradient itself, a contract the piece's vocabulary-parallel
backward does not follow); the guard states what that kernel computes.
"""

from __future__ import annotations

from typing import Any

from fp32patch.runtime.kit.fused import wired_mode
from fp32patch.runtime.verl.config import KEY, STACK


def fused_logprobs(
    hidden: Any,
    weight: Any,
    targets: Any,
    temperature: Any,
    *,
    backend: str,
    reduction: str = "none",
    group: Any = None,
) -> tuple[Any, Any] | None:
    """(log-probs, entropy) of verl's fused path ``backend`` ("torch", "liger", "triton") from
    ``hidden`` [..., H], ``weight`` [V, H] and ``targets`` shaped as ``hidden`` without its last
    dimension, in fp32 and that shape; None where ``weight`` is no wired head's (verl's kernel
    runs). ``reduction`` and ``group``: the triton kernel's arguments, which fp32patch's path takes
    as the FSDP engine passes them ("none", no process group)."""
    mode = wired_mode(weight, trainer="hf")
    if mode is None:
        return None
    if reduction != "none" or group is not None:
        raise NotImplementedError(
            f"fp32patch: verl's fused {backend} kernel was called with reduction={reduction!r} and a process "
            f"group ({group!r}) on the LM head {KEY} wired; fp32patch computes the per-token log-probs of the "
            "FSDP engine's fused path. Set actor_rollout_ref.model.use_fused_kernels to false"
        )
    if type(weight).__name__ == "DTensor":
        raise NotImplementedError(
            f"fp32patch: verl's fused {backend} path read the LM head's weight as a DTensor "
            f"({getattr(weight, 'placements', '?')}): the head is sharded where the fused forward reads it "
            "(FSDP2 wraps an untied lm_head on its own, or tensor parallelism): verl's own fused kernels fail "
            "there too (mixed torch.Tensor and DTensor). Set actor_rollout_ref.model.use_fused_kernels to false "
            "(the fp32 head then computes the logits), or use FSDP1 (strategy fsdp) or a tied head"
        )
    from fp32patch.runtime.kernels.chunked_logprobs import chunked_logprobs

    # keep_logits=False: verl's own fused path holds no [T, V] tensor at its peak, nor does this
    log_probs, entropy = chunked_logprobs(
        hidden, weight, targets.long(), mode=mode, temperature=float(temperature), entropy=True, keep_logits=False
    )
    STACK.tell_once(
        ("fused", backend, mode),
        "fp32patch: verl's fused kernels (%s backend) compute the log-probs and the entropy through "
        "fp32patch's chunked fp32 log-probs in mode %r (%s), the temperature applied to the fp32 logits",
        backend,
        mode,
        KEY,
    )
    return log_probs, entropy
