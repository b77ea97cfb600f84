"""bf16 x bf16 -> fp32 GEMMs without an fp32 copy of either operand.

CUDA torch has ``torch.mm(a, b, out_dtype=torch.float32)`` for bf16/fp16 operands: the
tensor cores accumulate in fp32 anyway, so keeping the accumulator costs a few percent
over the bf16 GEMM and needs no fp32 weight. Where that kernel does not exist (the CPU,
older torch) the fallback upcasts both operands: bf16 and fp16 values are exact in fp32,
so the result is the same exact-input, fp32-accumulated product, only slower.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

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


def _fp16_scaled(a: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` in fp16, each slice along ``dim`` multiplied by a power of two: (a16, scale)
    with ``a ~= a16 / scale``. Exact for bf16 input in range; fp32 input is rounded to
    nearest at 11 significant bits, as TF32 rounds it."""
    import torch

    amax = torch.linalg.vector_norm(a, float("inf"), dim=dim, keepdim=True).float()
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, 0.5 <= m < 1
    shift = (_FP16_TOP_EXPONENT - exponent).clamp(-_MAX_SHIFT, _MAX_SHIFT)
    shift = torch.where(torch.isfinite(amax) & (amax > 0), shift, torch.zeros_like(shift))
    scale = torch.exp2(shift.float())
    a16 = torch.empty_like(a, dtype=torch.float16)
    torch.mul(a, scale, out=a16)  # one pass: read a, write fp16, no fp32 temporary
    return a16, scale


def fp16_scaled_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in fp32 through one fp16 GEMM: ``a`` scaled per row, ``b`` per column.

    Power-of-two scales are exact and undone on the fp32 result. A bf16 operand is exact
    in fp16 after scaling; an fp32 operand (a gradient) is rounded to 11 significant bits,
    to nearest: the rounding a TF32 tensor core applies, at the cost of a 16-bit GEMM.
    """
    a16, row_scale = _fp16_scaled(a, dim=1)
    b16, col_scale = _fp16_scaled(b, dim=0)
    out = mm(a16, b16)
    return out.div_(row_scale).div_(col_scale)
