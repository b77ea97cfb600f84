"""SGLang's own fp32 LM head (``enable_fp32_lm_head``) at fp32out cost, for SGLang 0.5.3-0.5.17.

Those releases compute the flag's head as ``torch.matmul(hidden.to(float32),
weight.to(float32).T)``: an fp32 copy of the whole head weight on every call (V x H x 4 bytes:
2.5 GB for V=151936, H=4096) and an IEEE fp32 GEMM. The patched ``LogitsProcessor`` (spec
``sglang-fp32-lm-head``) calls ``fp32_logits`` there instead, only where SGLang already took the
flag's branch, so a quantized or LoRA-wrapped head, SGLang's gather, scale and soft-cap stay
SGLang's. From 0.5.18 SGLang computes the same product itself (the patch is ``obsolete``).

``fp32_logits`` is ``kernels.fp32out.mm``: on CUDA with bf16 or fp16 operands of one dtype,
``torch.mm(hidden, weight.T, out_dtype=torch.float32)`` (the tensor cores' fp32 accumulator kept;
no copy of either operand); elsewhere (the CPU, mixed dtypes, an fp32 model) the exact upcast
SGLang does, so the logits are the same exact-input, fp32-accumulated product. Nothing is cached:
a weight refit is seen on the next call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["fp32_logits", "way"]


def fp32_logits(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden_states @ weight.T`` in fp32: ``hidden_states`` (..., H), ``weight`` the head's (V, H)
    shard; returns float32 logits (..., V) (``kernels.fp32out.linear``)."""
    from fp32patch.runtime.kernels import fp32out

    return fp32out.linear(hidden_states, weight)


def way(hidden_states: torch.Tensor, weight: torch.Tensor) -> str:
    """Which product ``fp32_logits`` computes for these operands: ``"fp32out"`` (``torch.mm`` with
    ``out_dtype``) or ``"upcast"`` (both operands cast to fp32)."""
    from fp32patch.runtime.kernels import fp32out

    same = hidden_states.dtype == weight.dtype
    return "fp32out" if same and fp32out.out_dtype_supported(hidden_states.device, hidden_states.dtype) else "upcast"
