"""The logits as the distribution sees them, and the way back, for the Triton kernels.

Every log-prob kernel (``chunked_logprobs``' fold and gradient kernels, ``gemm_lse_triton``'s
fused GEMM + logsumexp) turns raw fp32 logits ``z`` into the logits the softmax takes: capped,
``cap * tanh(z / cap)`` (Gemma's ``final_logit_softcapping``), then divided by one temperature
or by the row's (Prime-RL's per-sample temperatures), each division rounded as torch's is
(``div_rn``). ``logits`` is that transform, written once; ``logits_grad`` carries a gradient
with respect to the transformed logits back to the raw ones (the divisions again, then the
cap's derivative ``1 - tanh**2``), so that the forward's and the backward's arithmetic cannot
drift apart. The flags are the kernels' constexprs, so a kernel without a cap or a temperature
compiles neither.

A kernel calls them as ``triton_logits.logits(...)`` with this module imported at its module's
top: Triton's interpreter (the CPU tests) runs a kernel's source in its module's globals, so a
helper is reached through a global, as ``triton_tanh.tanh`` is. Imports Triton only when a
helper is first asked for.
"""

from __future__ import annotations

from typing import Any

from fp32patch.runtime.kernels import triton_tanh  # noqa: F401  (read by the helpers: triton_tanh.tanh)

_HELPERS: dict[str, Any] = {}
tl: Any = None  # triton.language, once made (the interpreter looks for it in the module's globals)


def _make() -> dict[str, Any]:
    global tl
    if _HELPERS:
        return _HELPERS
    import triton
    import triton.language as tl  # noqa: F811

    @triton.jit
    def logits(z, cap, temperature, row_t, CAPPED: tl.constexpr, SCALED: tl.constexpr, ROW_TEMPS: tl.constexpr):
        # (the transformed logits, tanh(z / cap) for logits_grad: z itself when not CAPPED);
        # row_t broadcasts against z (a row's number, or [rows, 1])
        t = z
        if CAPPED:
            t = triton_tanh.tanh(tl.div_rn(z, tl.zeros_like(z) + cap))
            z = t * cap
        if SCALED:
            z = tl.div_rn(z, tl.zeros_like(z) + temperature)
        if ROW_TEMPS:
            z = tl.div_rn(z, tl.zeros_like(z) + row_t)
        return z, t

    @triton.jit
    def logits_grad(g, t, temperature, row_t, CAPPED: tl.constexpr, SCALED: tl.constexpr, ROW_TEMPS: tl.constexpr):
        # d/dz of the loss from g = its gradient with respect to logits(z); t as logits returned it
        if SCALED:
            g = tl.div_rn(g, tl.zeros_like(g) + temperature)
        if ROW_TEMPS:
            g = tl.div_rn(g, tl.zeros_like(g) + row_t)
        if CAPPED:
            g = g * (1.0 - t * t)
        return g

    _HELPERS.update(logits=logits, logits_grad=logits_grad)
    return _HELPERS


def __getattr__(name: str) -> Any:
    if name in ("logits", "logits_grad"):
        return _make()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
