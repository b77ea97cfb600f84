"""The LM head's local GEMM with fp32 logits, forward and backward, in each mode.

``lm_head_linear(x, weight, bias, mode, fuse_wgrad)`` is ``x @ weight.T (+ bias)`` for a
low-precision ``x[..., H]`` and ``weight[V, H]``, returned in fp32. It does no
communication: the caller (``megatron_lm_head``) keeps Megatron's own tensor-parallel
collectives around it. The modes are described in ``modes.py``.

Gradients: the input gradient comes back in the input's dtype. The weight gradient is
computed in fp32 and then delivered the way Megatron-Core's
``LinearWithGradAccumulationAndAsyncCommunication`` delivers it, so its DDP and
optimizer see no difference:

- with ``fuse_wgrad`` (Megatron's ``gradient_accumulation_fusion``) and a ``main_grad``
  on the weight, it is added into ``main_grad`` (fp32, no bf16 rounding on the way) and
  autograd gets ``None``, or, where DDP has marked the weight with
  ``grad_added_to_main_grad``, a placeholder tensor plus that flag set to True (DDP's
  hook then skips adding ``.grad`` a second time);
- otherwise it is rounded to the weight's dtype and lands in ``weight.grad`` as usual.

Megatron-FSDP weights (``__fsdp_param__``), whose main grad follows another protocol,
are refused rather than guessed at.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fp32patch.runtime.kernels import fp32out
from fp32patch.runtime.kernels.matmul_precision import cuda_tf32
from fp32patch.runtime.modes import TRAINER_MODES

if TYPE_CHECKING:
    import torch

_UPCAST_MODES = ("fp32", "tf32")
# fp32out variants that carry the fp32 grad_output as bf16 terms: how many (hi, lo).
_GRAD_TERMS = {"fp32out-hilo": 2, "fp32out-bf16grad": 1}


@contextmanager
def _precision(mode: str, device: torch.device) -> Iterator[None]:
    """The GEMM settings a mode needs, whatever the trainer has set around it."""
    import torch

    # Under a trainer's autocast an fp32 GEMM would quietly run in bf16 again.
    with torch.autocast(device_type=device.type, enabled=False):
        if mode in _UPCAST_MODES:
            with cuda_tf32(mode == "tf32"):
                yield
        else:
            yield


def _fwd_mm(mode: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in fp32 for 2-D ``x`` and ``weight``."""
    import torch

    if mode in _UPCAST_MODES:
        return torch.mm(x.float(), weight.float().t())
    return fp32out.mm(x, weight.t())


def _backward_gemms(
    mode: str,
    grad: torch.Tensor,
    weight: torch.Tensor,
    x: torch.Tensor | None,
    need_dx: bool,
    dx_dtype: torch.dtype,
    main_grad: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """For the fp32 grad_output ``grad``: ``grad @ weight`` in ``dx_dtype`` (the input
    gradient, if ``need_dx``) and ``grad.T @ x`` (the weight gradient, if ``x`` is given),
    computed in fp32 and then added into ``main_grad`` (which is returned) or, without one,
    rounded to the weight's dtype."""
    import torch

    if mode in _UPCAST_MODES or weight.dtype == torch.float32:
        # IEEE or TF32 fp32 GEMMs; an fp32 model has nothing to split against either.
        pieces, times = [grad], _upcast_mm
    elif mode == "fp32out":
        # the weight gradient from grad_output in fp16 with power-of-two scales: TF32's
        # rounding of it, at the speed of a 16-bit GEMM; the input gradient as the stock
        # head computes it (see fp32out.fp16_scaled_grads). On CUDA the conversions, the
        # rescaling and the accumulation run as fused Triton kernels
        return fp32out.fp16_scaled_grads(grad, weight if need_dx else None, x, dx_dtype, weight.dtype, main_grad)
    else:
        # split once, use the pieces for both products.
        pieces, times = fp32out.split(grad, weight.dtype, _GRAD_TERMS[mode]), fp32out.sum_mm
    dx = times(pieces, weight).to(dx_dtype) if need_dx else None
    if x is None:
        return dx, None
    dw = times([piece.t() for piece in pieces], x)
    return dx, (dw.to(weight.dtype) if main_grad is None else main_grad.add_(dw))


def _upcast_mm(pieces: list[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    import torch

    (a,) = pieces
    return torch.mm(a, b.float())


def _deliver_weight_grad(
    weight: torch.Tensor, main_grad: torch.Tensor | None, grad: torch.Tensor
) -> torch.Tensor | None:
    """Hand the weight gradient over as Megatron's own linear layer would (see top): ``grad``
    is in the weight's dtype, or is ``main_grad`` itself, already accumulated."""
    import torch

    if main_grad is None:
        return grad
    # The same weight can serve several heads (MTP); point it back at the buffer seen in
    # the forward (the one just accumulated into), as Megatron does.
    weight.main_grad = main_grad
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # Returning a tensor keeps DDP's backward hooks on the main backward thread (Megatron
    # does the same); its values are never read unless the trainer asks for zeros.
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    placeholder = make(main_grad.shape, dtype=weight.dtype, device=weight.device)
    weight.grad_added_to_main_grad = True
    return placeholder


def _make_function() -> type:
    import torch

    class LmHeadLinear(torch.autograd.Function):
        @staticmethod
        def forward(
            ctx: Any,
            x: torch.Tensor,
            weight: torch.Tensor,
            bias: torch.Tensor | None,
            mode: str,
            fuse_wgrad: bool,
        ) -> torch.Tensor:
            if fuse_wgrad and hasattr(weight, "__fsdp_param__"):
                raise NotImplementedError(
                    "fp32 LM head: Megatron-FSDP weights (__fsdp_param__) are not supported; "
                    "use Megatron's DDP or turn gradient_accumulation_fusion off"
                )
            # The input is only needed for the weight gradient; a frozen weight keeps none.
            ctx.save_for_backward(x if weight.requires_grad else None, weight)
            ctx.mode = mode
            ctx.x_dtype = x.dtype
            ctx.main_grad = weight.main_grad if fuse_wgrad and hasattr(weight, "main_grad") else None
            ctx.bias_dtype = None if bias is None else bias.dtype
            with _precision(mode, x.device):
                out = _fwd_mm(mode, x, weight)
            if bias is not None:
                out = out + bias.float()
            return out

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            x, weight = ctx.saved_tensors
            grad = grad_out.float()
            grad_b = None
            need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            with _precision(ctx.mode, grad.device):
                grad_x, grad_w = _backward_gemms(
                    ctx.mode, grad, weight, x if need_dw else None, need_dx, ctx.x_dtype, ctx.main_grad
                )
            if grad_w is not None:
                grad_w = _deliver_weight_grad(weight, ctx.main_grad, grad_w)
            if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
                grad_b = grad.sum(dim=0).to(ctx.bias_dtype)
            return grad_x, grad_w, grad_b, None, None

    return LmHeadLinear


_FUNCTION: type | None = None


def lm_head_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    mode: str,
    fuse_wgrad: bool = False,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` in fp32, differentiable, in ``mode`` (see ``modes.py``)."""
    import torch

    global _FUNCTION
    if mode not in TRAINER_MODES:
        raise ValueError(f"unknown fp32 LM-head mode {mode!r}; known: {', '.join(TRAINER_MODES)}")
    if _FUNCTION is None:
        # Built on first use: this module must import without torch.
        _FUNCTION = _make_function()
    # The Function sees 2-D tensors only and returns the product it allocated: a view made
    # inside a custom Function (a reshape back to [..., V] there) may not be modified in
    # place, and trainers scale logits in place (``logits.div_(temperature)``). Nor may the
    # logits be an autograd view made out here: an in-place op on a view (or on a view of
    # it, ``logits.squeeze(0).div_``) moves the graph onto its base, and the hooks a wrapper
    # put on the returned tensor's grad_fn (FSDP2's unshard before the head's backward, when
    # the head is a unit of its own) would never run. So the [..., V] shape comes from
    # _unsafe_view, as torch's own linear gives it: no view to autograd, one tensor, and the
    # Function saves no output that an in-place op could change under it.
    flat = x.reshape(-1, x.shape[-1])
    out = _FUNCTION.apply(flat, weight, bias, mode, fuse_wgrad)
    if x.dim() == 2:
        return out
    return torch.ops.aten._unsafe_view(out, [*x.shape[:-1], out.shape[-1]])
