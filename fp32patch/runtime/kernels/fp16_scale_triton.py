"""Triton kernels for fp32out's backward: the fp32 gradient into 16-bit operands at memory speed.

Why they exist: fp32out's backward (``fp32out.fp16_scaled_grads``) needs two 16-bit copies of
the fp32 grad_output [T, V]: rounded to the weight's dtype for the input gradient, and in
fp16 with a power-of-two scale per column for the weight gradient. In eager PyTorch that is
a cast, a column reduction and a scale-and-convert pass (the convert runs at ~1.6 TB/s, a
third of the H200's copy rate), plus two rescaling passes over the weight-gradient product.
Here it takes one read of the gradient for the column maxima, one pass that writes both
copies, and one pass that undoes the scales on the product while casting it to its dtype or
adding it into ``main_grad``.

The results are bit for bit those of the eager path: the column maxima are the same torch
reduction (``torch.linalg.vector_norm(a, inf)``), the scales follow ``fp32out._pow2_scale``'s
formula on the maxima's bits (one kernel instead of a handful of small launches), the 16-bit
conversions round to nearest even like ``Tensor.to`` and ``torch.mul(..., out=fp16)``, and
multiplying by the exact inverse power of two equals dividing by it. No atomics, so runs
repeat exactly. Everything is allocated with torch on the current stream, so a CUDA graph
can capture it (after a warm-up call has compiled the kernels, as for any Triton code).

Triton is imported when ``load()`` is first called, which ``fp32out`` does only for CUDA
tensors; without Triton the eager path runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fp32patch.runtime.kernels import triton_logits  # noqa: F401  (read by the kernels: triton_logits.pow2_scale)

if TYPE_CHECKING:
    import torch

# Tiles: [rows, columns] per program (chosen on an H200: bench/fp32out_parts.py --tiles).
_CONVERT_BM, _CONVERT_BN, _CONVERT_WARPS = 16, 512, 8
_SCALES_BL, _SCALES_WARPS = 1024, 4
_UNSCALE_BM, _UNSCALE_BN, _UNSCALE_WARPS = 32, 256, 8

_KERNELS: dict[str, Any] = {}


def load() -> bool:
    """Import Triton and define the kernels once; False when Triton is not importable."""
    if _KERNELS:
        return True
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return False

    @triton.jit
    def scales_kernel(amax, scale, L, BL: tl.constexpr):
        # scale[l] = the power of two that brings amax[l] into [2**13, 2**14) (triton_logits)
        rl = tl.program_id(0) * BL + tl.arange(0, BL)
        ok = rl < L
        tl.store(scale + rl, triton_logits.pow2_scale(tl.load(amax + rl, mask=ok, other=0.0)), mask=ok)

    @triton.jit
    def convert_kernel(
        src,
        col_scale,
        out_scaled,
        out_plain,
        M,
        N,
        s_m,
        s_n,
        o_m,
        o_n,
        BM: tl.constexpr,
        BN: tl.constexpr,
        PLAIN: tl.constexpr,
    ):
        # out_scaled = fp16(src * col_scale[None, :]); out_plain = src in out_plain's dtype
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        col_ok = rn < N
        mask = (rm < M)[:, None] & col_ok[None, :]
        rm64 = rm.to(tl.int64)
        rn64 = rn.to(tl.int64)
        a = tl.load(src + rm64[:, None] * s_m + rn64[None, :] * s_n, mask=mask, other=0.0)
        out = rm64[:, None] * o_m + rn64[None, :] * o_n
        if PLAIN:
            tl.store(out_plain + out, a.to(out_plain.dtype.element_ty), mask=mask)
        c = tl.load(col_scale + rn, mask=col_ok, other=1.0)
        tl.store(out_scaled + out, (a.to(tl.float32) * c[None, :]).to(tl.float16), mask=mask)

    @triton.jit
    def unscale_kernel(
        src,
        row_scale,
        col_scale,
        dst,
        M,
        N,
        s_m,
        s_n,
        d_m,
        d_n,
        BM: tl.constexpr,
        BN: tl.constexpr,
        ACCUMULATE: tl.constexpr,
    ):
        # dst (+)= src / row_scale[:, None] / col_scale[None, :], in dst's dtype, as a product
        # with the exact inverses: for a power of two 2**k (|k| <= 100) the inverse's bits
        # are (254 << 23) minus its own
        rm = tl.program_id(0) * BM + tl.arange(0, BM)
        rn = tl.program_id(1) * BN + tl.arange(0, BN)
        row_ok = rm < M
        col_ok = rn < N
        mask = row_ok[:, None] & col_ok[None, :]
        rm64 = rm.to(tl.int64)
        rn64 = rn.to(tl.int64)
        a = tl.load(src + rm64[:, None] * s_m + rn64[None, :] * s_n, mask=mask, other=0.0)
        r = tl.load(row_scale + rm, mask=row_ok, other=1.0).to(tl.int32, bitcast=True)
        c = tl.load(col_scale + rn, mask=col_ok, other=1.0).to(tl.int32, bitcast=True)
        r_inv = ((254 << 23) - r).to(tl.float32, bitcast=True)
        c_inv = ((254 << 23) - c).to(tl.float32, bitcast=True)
        v = a * r_inv[:, None] * c_inv[None, :]
        d = dst + rm64[:, None] * d_m + rn64[None, :] * d_n
        if ACCUMULATE:
            v = tl.load(d, mask=mask, other=0.0) + v
        tl.store(d, v.to(dst.dtype.element_ty), mask=mask)

    _KERNELS.update(scales=scales_kernel, convert=convert_kernel, unscale=unscale_kernel, cdiv=triton.cdiv)
    return True


def column_scales(a: torch.Tensor) -> torch.Tensor:
    """The power-of-two scales of ``fp32out._pow2_scale`` for max |a| per column of a 2-D
    tensor, [1, N], from one read of ``a``.

    The maxima are torch's own reduction, which reads at the H200's copy rate (a Triton
    one reached ~85% of it); one kernel turns them into scales."""
    import torch

    n = a.shape[1]
    return scales(torch.linalg.vector_norm(a, float("inf"), dim=0).float()).view(1, n)


def scales(amax: torch.Tensor) -> torch.Tensor:
    """``fp32out._pow2_scale(amax)`` for a contiguous fp32 ``amax`` [N], in one launch (the
    torch formula is a dozen small operations: host time a short call notices)."""
    import torch

    n = amax.numel()
    scale = torch.empty(n, dtype=torch.float32, device=amax.device)
    if n:
        _KERNELS["scales"][(_KERNELS["cdiv"](n, _SCALES_BL),)](amax, scale, n, BL=_SCALES_BL, num_warps=_SCALES_WARPS)
    return scale


def convert(
    a: torch.Tensor, col_scale: torch.Tensor, plain_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp16(a * col_scale) and, if ``plain_dtype`` is given, ``a.to(plain_dtype)``, both from
    one read of ``a`` and laid out as ``a`` is."""
    import torch

    m, n = a.shape
    scaled = torch.empty_like(a, dtype=torch.float16)
    plain = None if plain_dtype is None else torch.empty_like(a, dtype=plain_dtype)
    if plain is not None:
        assert plain.stride() == scaled.stride()
    if not a.numel():
        return scaled, plain
    cdiv = _KERNELS["cdiv"]
    _KERNELS["convert"][(cdiv(m, _CONVERT_BM), cdiv(n, _CONVERT_BN))](
        a,
        _flat(col_scale),
        scaled,
        scaled if plain is None else plain,
        m,
        n,
        a.stride(0),
        a.stride(1),
        scaled.stride(0),
        scaled.stride(1),
        BM=_CONVERT_BM,
        BN=_CONVERT_BN,
        PLAIN=plain is not None,
        num_warps=_CONVERT_WARPS,
    )
    return scaled, plain


def unscale(
    product: torch.Tensor,
    row_scale: torch.Tensor,
    col_scale: torch.Tensor,
    out_dtype: torch.dtype,
    accumulate_into: torch.Tensor | None,
) -> torch.Tensor:
    """``product / row_scale / col_scale`` for power-of-two scales in [2**-100, 2**100]:
    written in place when fp32, cast to ``out_dtype`` otherwise, or added into
    ``accumulate_into`` (which is returned)."""
    import torch

    if accumulate_into is not None:
        dst = accumulate_into
    elif out_dtype == product.dtype:
        dst = product
    else:
        dst = torch.empty_like(product, dtype=out_dtype)
    m, n = product.shape
    cdiv = _KERNELS["cdiv"]
    _KERNELS["unscale"][(cdiv(m, _UNSCALE_BM), cdiv(n, _UNSCALE_BN))](
        product,
        _flat(row_scale),
        _flat(col_scale),
        dst,
        m,
        n,
        product.stride(0),
        product.stride(1),
        dst.stride(0),
        dst.stride(1),
        BM=_UNSCALE_BM,
        BN=_UNSCALE_BN,
        ACCUMULATE=accumulate_into is not None,
        num_warps=_UNSCALE_WARPS,
        # a fused multiply-add would round the accumulation differently from add_()
        enable_fp_fusion=False,
    )
    return dst


def _flat(scale: torch.Tensor) -> torch.Tensor:
    """A scale vector as the kernels read it: contiguous fp32."""
    return scale.reshape(-1).contiguous()
