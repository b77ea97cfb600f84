"""The logits as the distribution sees them, and the way back, for the Triton kernels.

Every log-prob kernel (``chunked_logprobs``' fold and gradient kernels, ``gemm_lse_triton``'s
fused GEMM + logsumexp) turns raw fp32 logits ``z`` into the logits the softmax takes: capped,
``cap * tanh(z / cap)`` (Gemma's ``final_logit_softcapping``), then divided by one temperature
or by the row's (Prime-RL's per-sample temperatures), each division rounded as torch's is
(``div_rn``). ``logits`` is that transform, written once; ``logits_grad`` carries a gradient
with respect to the transformed logits back to the raw ones (the divisions again, then the
cap's derivative ``1 - tanh**2``), so that the forward's and the backward's arithmetic cannot
drift apart. The flags are the kernels' constexprs, so a kernel without a cap or a temperature
compiles neither. ``logprob_grad`` is the gradient of a block of raw logits from the log-probs'
and the entropy's gradients, the one formula of the backward's kernels (rows of tokens or
strips of vocabulary entries: its per-token operands come broadcast as the caller lays them
out); ``pow2_scale`` the power of two that fp32out's fp16 copy of a column is scaled by, from
that column's largest magnitude (``fp32out._pow2_scale``'s formula on the bits).

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

    @triton.jit
    def logprob_grad(
        z, tok, tok_ok, entry, targets, log_z, grad_logp, entropy, grad_entropy, cap, temperature, row_t,
        CAPPED: tl.constexpr, SCALED: tl.constexpr, ROW_TEMPS: tl.constexpr, LOGP_GRAD: tl.constexpr,
        ENTROPY_GRAD: tl.constexpr,
    ):  # fmt: skip
        # the gradient with respect to the raw fp32 logits z of grad_logp . log p[target] +
        # grad_entropy . H. tok: each entry's token (an index into the per-token vectors
        # targets, log_z, grad_logp, entropy, grad_entropy; tok_ok: which are real), entry: its
        # vocabulary id, both broadcasting against z; row_t as logits takes it. Each vector is
        # loaded where it is first used (the registers a block's live values take).
        z, capped = logits(z, cap, temperature, row_t, CAPPED, SCALED, ROW_TEMPS)
        log_p = z - tl.load(log_z + tok, mask=tok_ok, other=0.0)
        p = tl.exp(log_p)
        g = tl.zeros_like(z)
        if LOGP_GRAD:
            hit = (entry == tl.load(targets + tok, mask=tok_ok, other=-1)).to(tl.float32)
            g += tl.load(grad_logp + tok, mask=tok_ok, other=0.0) * (hit - p)
        if ENTROPY_GRAD:
            ge = tl.load(grad_entropy + tok, mask=tok_ok, other=0.0)
            g -= ge * p * (log_p + tl.load(entropy + tok, mask=tok_ok, other=0.0))
        return logits_grad(g, capped, temperature, row_t, CAPPED, SCALED, ROW_TEMPS)

    @triton.jit
    def pow2_scale(amax):
        # the power of two that brings amax (>= 0, fp32) into [2**13, 2**14), from its bits:
        # fp32out._pow2_scale's formula (frexp exponent e = biased exponent - 126, shift =
        # clamp(14 - e, -100, 100); subnormal maxima clamp to 100 as well; 0, inf and NaN,
        # whose bits may carry a sign, get 1)
        bits = amax.to(tl.int32, bitcast=True)
        shift = tl.minimum(tl.maximum(140 - (bits >> 23), -100), 100)
        shift = tl.where((bits > 0) & (bits < 0x7F800000), shift, 0)
        return ((shift + 127) << 23).to(tl.float32, bitcast=True)

    _HELPERS.update(logits=logits, logits_grad=logits_grad, logprob_grad=logprob_grad, pow2_scale=pow2_scale)
    # module globals from here on: logprob_grad reaches logits and logits_grad by name, as the
    # compiler and the interpreter look names up (in the function's globals)
    globals().update(_HELPERS)
    return _HELPERS


def __getattr__(name: str) -> Any:
    if name in ("logits", "logits_grad", "logprob_grad", "pow2_scale"):
        return _make()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
