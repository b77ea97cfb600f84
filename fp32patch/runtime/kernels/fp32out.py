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
# The device types whose tensors the Triton kernels take: CUDA's. Tests add "cpu" while Triton
# runs interpreted (TRITON_INTERPRET=1), so that the CUDA paths' logic runs on this machine.
TRITON_DEVICE_TYPES = {"cuda"}


def env_switch(name: str) -> bool | None:
    """The kernels' switch ``name`` in the environment: True for "1", False for "0", None when
    unset or empty (the measured default). Anything else is refused, naming the variable: a
    "true" or "off" must not quietly mean the default."""
    value = os.environ.get(name, "").strip()
    if value in ("", "0", "1"):
        return None if not value else value == "1"
    from fp32patch.runtime.errors import Fp32LmHeadConfigError

    raise Fp32LmHeadConfigError(f"{name}={value!r}: expected 0 or 1, or unset for the default (docs/runtime.md)")


def triton_device(t: torch.Tensor) -> bool:
    """Whether the Triton kernels may take ``t``: a device they run on, Triton not switched off
    (``FP32PATCH_TRITON=0``). Every choice between a Triton path and the eager one asks this."""
    return t.device.type in TRITON_DEVICE_TYPES and env_switch(TRITON_ENV_VAR) is not False


def _triton_kernels(a: torch.Tensor) -> Any:
    """The Triton kernels for ``a``, or None for the eager path: the one place that chooses.

    Only CUDA tensors use them; Triton is imported on the first such call, and a missing
    Triton, or ``FP32PATCH_TRITON=0``, keeps the eager path. Both give the same bits.
    """
    if not triton_device(a):
        return None
    from fp32patch.runtime.kernels import fp16_scale_triton

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


def pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """``_pow2_scale(amax)`` for an fp32 ``amax`` [N]: one Triton launch where the Triton
    kernels run, the torch formula elsewhere; the same bits."""
    kernels = _triton_kernels(amax) if amax.numel() else None
    if kernels is not None:
        return kernels.scales(amax.contiguous())
    return _pow2_scale(amax)


def _fp16_by_column(a: torch.Tensor, plain_dtype: torch.dtype | None = None) -> tuple[Scaled, torch.Tensor | None]:
    """``a`` in fp16 multiplied by a power of two per column: (a16, scale) with ``a ~= a16 /
    scale``, scale [1, N]; and, if ``plain_dtype`` is given, ``a.to(plain_dtype)``.

    Exact for bf16 input in range; fp32 input is rounded to nearest at 11 significant bits,
    as TF32 rounds it. On CUDA the maxima take one read of ``a`` and one more pass writes
    both copies (``fp16_scale_triton``)."""
    import torch

    kernels = _triton_kernels(a) if a.numel() else None
    if kernels is not None:
        scale = kernels.column_scales(a)
        a16, plain = kernels.convert(a, scale, plain_dtype)
        return (a16, scale), plain
    scale = _pow2_scale(torch.linalg.vector_norm(a, float("inf"), dim=0, keepdim=True).float())
    a16 = torch.empty_like(a, dtype=torch.float16)
    torch.mul(a, scale, out=a16)  # one pass: read a, write fp16, no fp32 temporary
    return (a16, scale), None if plain_dtype is None else a.to(plain_dtype)


def _scaled_product(
    a: Scaled,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    accumulate_into: torch.Tensor | None = None,
    b_scaled: Scaled | None = None,
) -> torch.Tensor:
    """``a @ b`` for a row-scaled fp16 ``a`` = (a16, scale [M, 1]) and a 16-bit ``b``: ``b``
    in fp16 scaled per column, one fp16 GEMM with fp32 output, scales undone, then cast to
    ``out_dtype`` or added into the fp32 ``accumulate_into``, which is then returned.
    ``b_scaled``: ``b``'s scaled copy as ``_fp16_by_column(b)`` gave it, for a caller that
    multiplies one ``b`` by several ``a`` (the chunked head's vocabulary blocks)."""
    a16, row_scale = a
    (b16, col_scale) = b_scaled if b_scaled is not None else _fp16_by_column(b)[0]
    out = mm(a16, b16)
    kernels = _triton_kernels(out)
    if kernels is not None:
        return kernels.unscale(out, row_scale, col_scale, out_dtype, accumulate_into)
    out = out.div_(row_scale).div_(col_scale)
    if accumulate_into is not None:
        return accumulate_into.add_(out)
    return out.to(out_dtype)


def fp16_scaled_grads(
    grad: torch.Tensor,
    weight: torch.Tensor | None,
    x: torch.Tensor | None,
    dx_dtype: torch.dtype,
    dw_dtype: torch.dtype,
    dw_into: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A linear layer's backward for the fp32 ``grad`` [T, V]: the input gradient ``grad @
    weight`` in ``dx_dtype`` (if ``weight`` is given) and the weight gradient ``grad.T @ x``
    (if ``x`` is given) in ``dw_dtype``, or added into the fp32 ``dw_into`` (then returned).

    The weight gradient goes through one fp16 GEMM: ``grad`` scaled by a power of two per
    column (per vocabulary entry, so that rare tokens keep their 11 bits), ``x`` per column,
    the scales undone on the fp32 product. That is TF32's rounding of ``grad`` at the cost
    of a 16-bit GEMM. The input gradient is the stock head's: ``grad`` rounded once to the
    weight's dtype, one GEMM. It comes back in a 16-bit dtype anyway: carrying ``grad``
    into it at TF32 precision as well cost ~4% of a forward + backward on an H200 (H=4096,
    V=32768) and lowered a bf16 ``dx``'s error by 4% on the benchmark's gradients, by up to
    1.6x on flatter ones (bench/RESULTS.md).
    """
    want_dx, want_dw = weight is not None, x is not None
    scaled = plain = None
    if want_dx and want_dw and _triton_kernels(grad) is not None:
        # one read of grad for the maxima, one pass that writes both copies
        scaled, plain = _fp16_by_column(grad, weight.dtype)
    dx = None
    if want_dx:
        if plain is None:
            plain = grad.to(weight.dtype)
        dx = _plain_product(plain, weight, dx_dtype)
        del plain  # eagerly, one 16-bit copy of grad is alive at a time
    if not want_dw:
        return dx, None
    if scaled is None:
        scaled, _ = _fp16_by_column(grad)
    g16, col_scale = scaled
    del scaled
    return dx, _scaled_product((g16.t(), col_scale.t()), x, dw_dtype, dw_into)


def _plain_product(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` for two operands of the same 16-bit dtype, in ``out_dtype``: one GEMM
    straight into that dtype when it is theirs, as the stock layer runs it."""
    import torch

    if out_dtype == a.dtype:
        return torch.mm(a, b)
    return mm(a, b).to(out_dtype)
