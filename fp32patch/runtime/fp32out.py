"""bf16 x bf16 -> fp32 GEMMs without an fp32 copy of either operand.

CUDA torch has ``torch.mm(a, b, out_dtype=torch.float32)`` for bf16/fp16 operands: the
tensor cores accumulate in fp32 anyway, so keeping the accumulator costs a few percent
over the bf16 GEMM and needs no fp32 weight. Where that kernel does not exist (the CPU,
older torch) the fallback upcasts both operands: bf16 and fp16 values are exact in fp32,
so the result is the same exact-input, fp32-accumulated product, only slower.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    # an fp16 tensor and the power-of-two scale it was multiplied by
    Scaled = tuple[torch.Tensor, torch.Tensor]

_LOW_PRECISION = ("bfloat16", "float16")
# (device type, dtype name) -> whether torch.mm(..., out_dtype=float32) works there.
_SUPPORT: dict[tuple[str, str], bool] = {}


def out_dtype_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.mm(a, b, out_dtype=torch.float32)`` runs for ``dtype`` on ``device``.

    Probed once per (device type, dtype) on 1x1 tensors. The probe is never run while a
    CUDA graph is being captured (it would add work to the graph); during capture an
    unprobed device counts as unsupported.
    """
    import torch

    key = (device.type, str(dtype).removeprefix("torch."))
    if key in _SUPPORT:
        return _SUPPORT[key]
    if key[1] not in _LOW_PRECISION:
        return False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return False
    try:
        one = torch.ones(1, 1, dtype=dtype, device=device)
        ok = torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, NotImplementedError, RuntimeError):
        ok = False
    _SUPPORT[key] = ok
    return ok


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for 2-D low-precision ``a`` and ``b``, accumulated and returned in fp32."""
    import torch

    if a.dtype == b.dtype and out_dtype_supported(a.device, a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in fp32 for ``x[..., H]`` and ``weight[V, H]``; no weight copy on CUDA."""
    flat = x.reshape(-1, x.shape[-1])
    out = mm(flat, weight.t())
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], out.shape[-1])


def split(a: torch.Tensor, dtype: torch.dtype, terms: int = 2) -> list[torch.Tensor]:
    """fp32 ``a`` as ``terms`` tensors of ``dtype`` whose sum approximates it: the first is
    ``a`` rounded, each next one the rounding error left so far, rounded.

    With bf16, two terms carry ~16 significant bits of ``a``, more than the 11 that TF32
    keeps; one term is a plain bf16 rounding. fp16 pieces lose what lies below fp16's
    range; use bf16.
    """
    if terms < 1:
        raise ValueError(f"terms must be at least 1, not {terms}")
    pieces = [a.to(dtype)]
    rest = a
    for _ in range(terms - 1):
        rest = rest - pieces[-1].float()
        pieces.append(rest.to(dtype))
    return pieces


def sum_mm(pieces: list[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """``sum(piece @ b)`` in fp32 for low-precision pieces (see ``split``)."""
    out = mm(pieces[0], b)
    for piece in pieces[1:]:
        out = out + mm(piece, b)
    return out


# fp16's largest power of two below its maximum (65504) is 2**15; slices are scaled so
# their largest magnitude lands in [2**13, 2**14), away from overflow, while values down
# to ~2**-27 of it stay normal fp16 numbers (11 significant bits, like TF32).
_FP16_TOP_EXPONENT = 14
_MAX_SHIFT = 100  # keeps the power-of-two scale itself a finite, normal fp32 number
# Set to 0 to keep the eager path on CUDA too (the Triton kernels give the same bits).
TRITON_ENV_VAR = "FP32PATCH_TRITON"


def _triton_kernels(a: torch.Tensor) -> Any:
    """The Triton kernels for ``a``, or None for the eager path: the one place that chooses.

    Only CUDA tensors use them; Triton is imported on the first such call, and a missing
    Triton, or ``FP32PATCH_TRITON=0``, keeps the eager path. Both give the same bits.
    """
    if a.device.type != "cuda" or os.environ.get(TRITON_ENV_VAR, "1") == "0":
        return None
    from fp32patch.runtime import fp16_scale_triton

    return fp16_scale_triton if fp16_scale_triton.load() else None


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power of two that brings ``amax`` into [2**13, 2**14); 1 where ``amax`` is 0,
    inf or NaN (the values pass through unscaled and overflow as they would anyway).
    (``fp16_scale_triton`` computes the same from the bits of ``amax``.)"""
    import torch

    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, 0.5 <= m < 1
    shift = (_FP16_TOP_EXPONENT - exponent).clamp(-_MAX_SHIFT, _MAX_SHIFT)
    shift = torch.where(torch.isfinite(amax) & (amax > 0), shift, torch.zeros_like(shift))
    return torch.exp2(shift.float())


def _fp16_scaled(a: torch.Tensor, rows: bool, cols: bool) -> tuple[Scaled | None, Scaled | None]:
    """``a`` in fp16 multiplied by a power of two per row and/or per column: for each asked
    for, (a16, scale) with ``a ~= a16 / scale`` (scale [M, 1] for rows, [1, N] for columns).
    Exact for bf16 input in range; fp32 input is rounded to nearest at 11 significant bits,
    as TF32 rounds it. On CUDA both come from one read of ``a`` for the maxima and one pass
    that writes both (``fp16_scale_triton``)."""
    import torch

    kernels = _triton_kernels(a) if a.numel() else None
    if kernels is not None:
        row_scale, col_scale = kernels.row_col_scales(a, rows, cols)
        by_row, by_col = kernels.scale_to_fp16(a, row_scale, col_scale)
        return (
            None if by_row is None else (by_row, row_scale),
            None if by_col is None else (by_col, col_scale),
        )
    out: list[Scaled | None] = []
    for wanted, dim in ((rows, 1), (cols, 0)):
        if not wanted:
            out.append(None)
            continue
        scale = _pow2_scale(torch.linalg.vector_norm(a, float("inf"), dim=dim, keepdim=True).float())
        a16 = torch.empty_like(a, dtype=torch.float16)
        torch.mul(a, scale, out=a16)  # one pass: read a, write fp16, no fp32 temporary
        out.append((a16, scale))
    return out[0], out[1]


def _scaled_product(
    a: Scaled,
    b: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    accumulate_into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b`` for a row-scaled fp16 ``a`` (see ``_fp16_scaled``) and a 16-bit ``b``: one
    fp16 GEMM with fp32 output, scales undone, then cast to ``out_dtype`` (default fp32) or
    added into the fp32 ``accumulate_into``, which is then returned."""
    import torch

    a16, row_scale = a
    _, (b16, col_scale) = _fp16_scaled(b, rows=False, cols=True)
    out = mm(a16, b16)
    out_dtype = out_dtype or torch.float32
    kernels = _triton_kernels(out)
    if kernels is not None:
        return kernels.unscale(out, row_scale, col_scale, out_dtype, accumulate_into)
    out = out.div_(row_scale).div_(col_scale)
    if accumulate_into is not None:
        return accumulate_into.add_(out)
    return out.to(out_dtype)


def fp16_scaled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32 through one fp16 GEMM: ``a`` scaled per row, ``b`` per column.

    Power-of-two scales are exact and undone on the fp32 result. A bf16 operand is exact
    in fp16 after scaling; an fp32 operand (a gradient) is rounded to 11 significant bits,
    to nearest: the rounding a TF32 tensor core applies, at the cost of a 16-bit GEMM.
    """
    by_row, _ = _fp16_scaled(a, rows=True, cols=False)
    return _scaled_product(by_row, b)


def fp16_scaled_grads(
    grad: torch.Tensor,
    weight: torch.Tensor | None,
    x: torch.Tensor | None,
    dx_dtype: torch.dtype,
    dw_dtype: torch.dtype,
    dw_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A linear layer's backward for the fp32 ``grad`` [T, V]: ``grad @ weight`` in
    ``dx_dtype`` (if ``weight`` is given) and ``grad.T @ x`` (if ``x`` is given) in
    ``dw_dtype``, or added into the fp32 ``dw_into`` (then returned), each as
    ``fp16_scaled_mm`` computes it."""
    # With the Triton kernels both scalings come from one read of grad; eagerly, one at a
    # time, so that only one fp16 copy of grad is alive at once.
    together = _triton_kernels(grad) is not None
    by_row, by_col = _fp16_scaled(grad, rows=weight is not None, cols=x is not None and together)
    dx = None if by_row is None or weight is None else _scaled_product(by_row, weight, dx_dtype)
    del by_row  # the row-scaled copy is not needed for the weight gradient
    if x is None:
        return dx, None
    if by_col is None:
        _, by_col = _fp16_scaled(grad, rows=False, cols=True)
    col16, col_scale = by_col
    del by_col
    dw = _scaled_product((col16.t(), col_scale.t()), x, dw_dtype, dw_into)
    return dx, dw
