"""fp32 logits from a PyTorch / Hugging Face model's LM head: ``apply_fp32_lm_head(model, mode)``.

For trainers that run Hugging Face ``transformers`` models under FSDP2 and tensor parallelism
(NeMo-RL's DTensor workers, NeMo Automodel). The head is the ``nn.Linear`` that
``model.get_output_embeddings()`` returns (inside a VL wrapper: its ``language_model``'s).
Its ``forward`` is replaced *on the instance* by one that computes ``lm_head_gemm``'s fp32-
output GEMM: the module's class, its names, ``state_dict``, ``named_parameters`` and the hooks
that FSDP2 and tensor-parallel plans put on it stay as they are. The weight is read at every
call, never cached, so refits, optimizer steps and reference-weight swaps are followed; a
head tied to the embeddings keeps sharing its weight, whose gradient carries both uses.

What the override does at each call, from the tensors it is handed:

- the input is cast to the weight's dtype inside the autograd graph (FSDP2's
  ``MixedPrecisionPolicy(output_dtype=float32)`` hands the head an fp32 input; without the
  cast ``torch.mm(..., out_dtype=)`` would become an fp32 x fp32 GEMM);
- the GEMM is ``lm_head_gemm.lm_head_linear`` in ``mode``, with autocast off inside it (under
  a trainer's ``torch.autocast`` the head still gives fp32 logits); the kernel is chosen per
  call from the live tensors' device and dtype (``fp32out.mm``), so CPU offload is followed;
- the weight gradient comes back in the weight's dtype, as the stock head gives it (under
  FSDP2: bf16, then FSDP2's reduce-scatter in its ``reduce_dtype``);
- the logits it returns are no view made inside an ``autograd.Function``: a trainer may scale
  them in place (``logits.div_(temperature)``).

Tensor parallelism: ``torch.mm(out_dtype=)`` has no DTensor rule, so DTensor operands are
computed on their local shards and wrapped back with the stock head's placement, on the
weight's (1-D, tp) mesh; the plan's own output hook then does what it does for the stock head
(``output_layouts``, ``use_local_output``):

- weight ``Shard(0)`` (``ColwiseParallel``, NeMo-RL's plans, with or without sequence
  parallelism: the plan's input hook hands a ``Replicate`` input): logits ``Shard(-1)``;
- weight ``Shard(1)`` (a head tied to an embedding sharded on its hidden dimension): the input
  is sliced to the hidden shard and the logits returned as ``Partial`` sums, which the output
  hook reduces in fp32 (no bias);
- anything else (a 2-D mesh, a ``Replicate`` weight, a sharded input the plan did not
  replicate) is refused at the call rather than guessed at.

Errors (the NeMo-RL wiring relies on these types):

- ``ValueError``: ``mode`` is not a valid value (``modes.trainer_mode``), or the head already
  gives fp32 logits in another mode. Nothing is changed.
- ``UnsupportedLmHeadError`` (a ``TypeError``): the head cannot get the fp32 override; the
  message names what was found: a LoRA-wrapped head (peft's ``lora.Linear``, an Automodel-style
  LoRA linear, any head with adapter attributes or submodules), a Transformer Engine or other
  custom linear, a ``forward`` already replaced by someone else, or an fp32 weight at compute
  time outside a bf16/fp16 autocast (raised by the forward that sees it: under FSDP2, or
  FSDP1's wrapper, with ``param_dtype=bfloat16`` the fp32 master weight is bf16 in the
  forward, the normal case; under a trainer's ``torch.autocast(dtype=bfloat16)`` an fp32
  weight is computed from its bf16 copy, as the stock head under that autocast computes, with
  fp32 output). The DTensor layouts above that are not supported raise it too, at the call.
- ``NoLmHeadError`` (an ``UnsupportedLmHeadError``): the model has no LM head
  (``get_output_embeddings()`` is None: reward and value models).

Nothing here imports torch at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from types import MethodType
from typing import TYPE_CHECKING, Any

from fp32patch.runtime.kernels.lm_head_gemm import lm_head_linear
from fp32patch.runtime.modes import trainer_mode

if TYPE_CHECKING:
    import torch

# Attribute names that betray an adapter on a linear layer (peft: lora_A, lora_B,
# base_layer, active_adapter; Automodel: lora_A, lora_B, lora_dropout; others: adapter_*).
_ADAPTER_MARKS = ("lora", "adapter", "base_layer")
_LOW_PRECISION = ("bfloat16", "float16")


class UnsupportedLmHeadError(TypeError):
    """The model's LM head cannot give fp32 logits through this override (see the module doc)."""


class NoLmHeadError(UnsupportedLmHeadError):
    """The model has no LM head: ``get_output_embeddings()`` is None (reward, value models)."""


class Fp32HeadForward:
    """Stands in for ``nn.Linear.forward`` on one LM head, bound to it as a method.

    Its presence in the head's ``__dict__`` is the marker that the head was converted, and
    ``mode`` says how. It holds nothing else: the weight is the head's, read at each call.
    """

    __name__ = "forward"

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.__qualname__ = repr(self)  # what the bound method's repr shows

    def __repr__(self) -> str:
        return f"Fp32HeadForward(mode={self.mode!r})"

    def __call__(self, head: Any, input: torch.Tensor) -> torch.Tensor:
        instead = _INSTEAD_OF_LOGITS.get()
        if instead is not None and instead[0] is head:
            return instead[1](input, head.weight)
        return fp32_linear(input, head.weight, head.bias, self.mode)


# (head, compute) while ``instead_of_logits`` holds: that head's next calls return compute's result
_INSTEAD_OF_LOGITS: contextvars.ContextVar[tuple[Any, Callable[..., Any]] | None] = contextvars.ContextVar(
    "fp32patch_instead_of_logits", default=None
)


@contextlib.contextmanager
def instead_of_logits(head: Any, compute: Callable[[Any, Any], Any]) -> Iterator[None]:
    """Within the block, a call of ``head`` (a head ``apply_fp32_lm_head`` converted) returns
    ``compute(hidden, weight)`` instead of its logits: a stack that needs per-token log-probs, not
    the [..., V] logits, computes them from the head's input and its weight *inside* the head's
    call, where the trainer's hooks have gathered the weight (DeepSpeed ZeRO-3) and, as for the
    stock head, gather it again before the backward of the tensor ``compute`` returns."""
    if _mode_of(head) is None:
        raise UnsupportedLmHeadError(
            f"fp32 LM head: {type(head).__name__} was not converted by apply_fp32_lm_head; nothing would call compute"
        )
    token = _INSTEAD_OF_LOGITS.set((head, compute))
    try:
        yield
    finally:
        _INSTEAD_OF_LOGITS.reset(token)


def call_computing_log_probs(
    model: Any,
    head: Any,
    compute: Callable[[Any, Any], Any],
    args: tuple,
    kwargs: dict,
    *,
    softcap: float | None,
    turn_off: str,
) -> tuple[Any, Any]:
    """``model(*args, **kwargs)`` with ``head``'s call returning ``compute(hidden, weight)``
    (``instead_of_logits``). Returns the model's output and the head's output as the model got
    it: ``compute``'s tensor, or the one the trainer's hooks on the head made of it (DeepSpeed
    ZeRO-3 wraps it in a new tensor over the same storage, whose backward gathers the weight
    again: the caller must hold that one). The model must hand it back as its logits, as it is
    or, for a model that soft-caps its final logits (``softcap``: ``final_softcap`` of the HF
    model, which ``model``, a trainer's engine, may wrap), capped as transformers' capping models
    cap them, ``x / cap``, ``tanh``, ``* cap``: replayed here and compared bit for
    bit (``compute`` took the cap into its log-probs, on the fp32 logits, as vLLM's logits
    processor applies it). Anything else (a scale, another cap, a config's cap the model does not
    apply, a head never called) is refused, naming the model and ``turn_off``."""
    import torch

    computed: list[Any] = []
    seen: list[Any] = []

    def recording(hidden: Any, weight: Any) -> Any:
        computed.append(compute(hidden, weight))
        return computed[-1]

    hook = head.register_forward_hook(lambda module, inputs, out: seen.append(out))  # after the trainer's
    try:
        with instead_of_logits(head, recording):
            output = model(*args, **kwargs)
    finally:
        hook.remove()
    name = type(model).__name__
    if not computed:
        raise UnsupportedLmHeadError(
            f"fp32 LM head: {name} computed its logits without calling its LM head (a fused loss kernel, Liger?), "
            f"so fp32patch could not compute the log-probs; {turn_off}"
        )
    result, returned = computed[-1], output["logits"]
    if _same_storage(returned, result):
        if softcap is None:
            return output, returned
        # compute capped what the model hands back uncapped: its config's cap is not the model's
        raise UnsupportedLmHeadError(
            f"fp32 LM head: {name}'s config names final_logit_softcapping={softcap}, but the model hands back its "
            f"head's logits uncapped, so fp32patch cannot tell which logits it computes; {turn_off} for this model"
        )
    headed = seen[-1] if seen and _same_storage(seen[-1], result) else result
    if softcap is not None and isinstance(returned, torch.Tensor) and returned.shape == result.shape:
        with torch.no_grad():
            if torch.equal(returned, torch.tanh(headed / softcap) * softcap):
                return output, headed
    capped = f"a soft-cap other than its final_logit_softcapping={softcap}" if softcap is not None else "a soft-cap"
    raise UnsupportedLmHeadError(
        f"fp32 LM head: {name} changes its logits after the head (a scale, {capped}), which fp32patch's chunked "
        f"log-probs do not do; {turn_off} for this model"
    )


def _same_storage(returned: Any, computed: Any) -> bool:
    """Whether ``returned`` is ``computed`` or a new tensor over the same storage (DeepSpeed's
    hooks wrap a module's output so); a scale or a soft-cap makes a new one."""
    try:
        return returned.shape == computed.shape and returned.data_ptr() == computed.data_ptr()
    except AttributeError:
        return False


def final_softcap(model: Any) -> float | None:
    """The soft-cap ``model`` applies to its final logits (its text config's
    ``final_logit_softcapping``: Gemma 2's 30.0), or None."""
    cap = _config_softcap(model)
    return None if cap is None else float(cap)


def apply_fp32_lm_head(model: Any, mode: Any) -> Any:
    """Make the LM head of ``model`` give fp32 logits in ``mode``; returns ``model``.

    ``mode`` is ``True``/``"fp32"``, ``"tf32"``, ``"fp32out"``, ``"fp32out-hilo"`` or
    ``"fp32out-bf16grad"`` (``modes.py``); ``False``/``None`` does nothing (it does not undo
    an earlier call), so a trainer can pass its config value straight through. Applying the
    same mode again is a no-op; another mode raises ``ValueError``. Call it after the model is
    parallelized (FSDP2, TP), loaded and re-tied. Refusals raise ``UnsupportedLmHeadError``
    (``NoLmHeadError`` for a model without a head) and leave the model as it was.
    """
    resolved = trainer_mode(mode)
    if resolved is None:
        return model
    head, where = _find_head(model)
    current = _mode_of(head)
    if current is not None:
        if current != resolved:
            raise ValueError(
                f"fp32 LM head: {where} already gives fp32 logits in mode {current!r}; refusing to "
                f"switch it to {resolved!r} (two callers disagree on the mode)"
            )
        return model
    _check_convertible(head, where)
    head.forward = MethodType(Fp32HeadForward(resolved), head)
    return model


def fp32_lm_head_mode(module: Any) -> str | None:
    """The mode in which the LM head of ``module`` (a model, or the head itself) gives fp32
    logits, or None if it was not converted (or there is no head)."""
    mode = _mode_of(module)
    if mode is not None:
        return mode
    try:
        head, _ = _find_head(module)
    except NoLmHeadError:
        return None
    return _mode_of(head)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mode: str) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with fp32 output, for plain tensors and DTensors, as the head
    computes it (see the module doc)."""
    if str(weight.dtype).removeprefix("torch.") not in _LOW_PRECISION:
        # an fp32 weight under a bf16/fp16 autocast (a trainer's fp32 master weights without
        # FSDP's param_dtype): the stock head computes from the autocast-rounded weight, and so
        # does this one, inside the autograd graph (the gradient reaches the fp32 weight)
        dtype = _autocast_dtype(weight.device.type)
        if dtype is None:
            raise UnsupportedLmHeadError(_fp32_weight(weight.dtype, "the forward"))
        weight = weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    if _is_dtensor(weight):
        return _dtensor_linear(x, weight, bias, mode)
    if _is_dtensor(x):
        raise UnsupportedLmHeadError(
            f"fp32 LM head: the input is a DTensor {tuple(x.placements)} but the weight is a plain "
            "tensor; parallelize the head with the rest of the model or not at all"
        )
    return lm_head_linear(x.to(weight.dtype), weight, bias, mode)


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The low-precision dtype an enabled autocast on ``device_type`` computes linears in, or None."""
    import torch

    try:
        enabled, dtype = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    except TypeError:  # torch < 2.4: no per-device queries
        if device_type == "cpu":
            enabled, dtype = torch.is_autocast_cpu_enabled(), torch.get_autocast_cpu_dtype()
        elif device_type == "cuda":
            enabled, dtype = torch.is_autocast_enabled(), torch.get_autocast_gpu_dtype()
        else:
            return None
    if not enabled or str(dtype).removeprefix("torch.") not in _LOW_PRECISION:
        return None
    return dtype


def _dtensor_linear(x: Any, weight: Any, bias: Any, mode: str) -> Any:
    """The DTensor edge: local shards in, the stock head's placement out (module doc)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise UnsupportedLmHeadError(
            f"fp32 LM head: the weight lives on a {mesh.ndim}-D device mesh {mesh.mesh_dim_names}; "
            "only a 1-D tensor-parallel mesh is supported"
        )
    if not isinstance(x, DTensor) or x.device_mesh != mesh or tuple(x.placements) != (Replicate(),):
        found = f"a DTensor {tuple(x.placements)}" if isinstance(x, DTensor) else "a plain tensor"
        raise UnsupportedLmHeadError(
            f"fp32 LM head: the input is {found}; a tensor-parallel head needs it replicated on the "
            "weight's mesh (as ColwiseParallel's input hook hands it over)"
        )
    (placement,) = weight.placements
    x = x.to(weight.dtype)
    last = x.ndim - 1
    if placement == Shard(0):
        # vocabulary-parallel: each rank's logits are its vocabulary columns, its input
        # gradient a partial sum over them (the plan's input hook reduces it)
        x_local = x.to_local(grad_placements=(Partial(),))
        out_placement = Shard(last)
    elif placement == Shard(1) and bias is None:
        # hidden-parallel: each rank's product over its hidden slice is a partial sum of the
        # logits; the slice's gradient is gathered back by the redistribute
        x_local = x.redistribute(mesh, (Shard(last),)).to_local()
        out_placement = Partial()
    else:
        detail = " with a bias" if placement == Shard(1) else ""
        raise UnsupportedLmHeadError(
            f"fp32 LM head: a tensor-parallel weight placed {placement!r}{detail} is not supported; "
            "Shard(0) (ColwiseParallel) and Shard(1) without bias (tied to a column-sharded embedding) are"
        )
    out = lm_head_linear(x_local, weight.to_local(), None if bias is None else bias.to_local(), mode)
    shape = (*x.shape[:-1], weight.shape[0])
    stride = tuple(_contiguous_strides(shape))
    return DTensor.from_local(out, mesh, (out_placement,), run_check=False, shape=shape, stride=stride)


def _is_dtensor(t: Any) -> bool:
    # a torch built without distributed support has no DTensors to meet
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


# ---------------------------------------------------------------- finding and checking the head


def _mode_of(module: Any) -> str | None:
    forward = getattr(module, "__dict__", {}).get("forward")
    if isinstance(forward, MethodType) and isinstance(forward.__func__, Fp32HeadForward):
        return forward.__func__.mode
    return None


def _find_head(model: Any) -> tuple[Any, str]:
    """The LM head of ``model`` and how it was reached."""
    node, where, path = model, type(model).__name__, [model]
    while True:
        get = getattr(node, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if head is not None:
            name = next((n for n, child in _children(node) if child is head), "get_output_embeddings()")
            return head, f"{where}.{name}"
        inner = getattr(node, "language_model", None)
        if inner is None or any(inner is seen for seen in path):
            break
        node, where = inner, f"{where}.language_model"
        path.append(node)
    how = "has no get_output_embeddings()" if not callable(get) else "get_output_embeddings() is None"
    raise NoLmHeadError(
        f"fp32 LM head: {where} has no LM head ({how}, searched through .language_model); "
        "apply it to a causal LM (reward and value models have no LM head to convert)"
    )


def chunkable_head(model: Any, *, role: str, turn_off: str) -> tuple[Any, str]:
    """``model``'s LM head and how it was reached, for a stack that computes the head's log-probs
    with ``kernels.chunked_logprobs`` (from hidden states and the weight alone): a head with a
    bias, or a final soft-cap that is not a positive number, is refused
    (``UnsupportedLmHeadError``, naming ``role`` and saying to ``turn_off`` the switch). A model
    that soft-caps its final logits is taken: the stack hands the cap (``final_softcap``) to the
    chunked piece, which caps the fp32 logits."""
    import math

    head, where = _find_head(model)
    if getattr(head, "bias", None) is not None:
        raise UnsupportedLmHeadError(
            f"fp32 LM head: the {role}'s {where} has a bias, which fp32patch's chunked log-probs do not add; "
            f"{turn_off} for this model"
        )
    try:
        softcap = final_softcap(model)
    except (TypeError, ValueError):
        softcap = math.nan
    if softcap is not None and not (math.isfinite(softcap) and softcap > 0):
        raise UnsupportedLmHeadError(
            f"fp32 LM head: the {role}'s model caps its logits at final_logit_softcapping="
            f"{_config_softcap(model)!r}, which is not a positive number fp32patch's chunked log-probs can cap at; "
            f"{turn_off} for this model"
        )
    return head, where


def _config_softcap(model: Any) -> Any:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "final_logit_softcapping", None)


def _children(module: Any) -> list[tuple[str, Any]]:
    named = getattr(module, "named_children", None)
    return list(named()) if callable(named) else []


def _check_convertible(head: Any, where: str) -> None:
    import torch

    adapters = _adapter_names(head)
    kind = _plain_class(type(head))
    if kind is not torch.nn.Linear or adapters:
        found = f"{type(head).__module__}.{type(head).__qualname__}"
        if adapters:
            found += f" with adapter attributes {adapters}"
            why = "a LoRA or other adapter on the head adds a term the override would drop"
        else:
            why = "Transformer Engine and other custom linears compute their own GEMM"
        raise UnsupportedLmHeadError(
            f"fp32 LM head: {where} is a {found}; only a plain torch.nn.Linear is supported ({why}). "
            "Keep the head out of the adapter's target modules, or turn fp32_lm_head off"
        )
    if "forward" in head.__dict__:
        raise UnsupportedLmHeadError(
            f"fp32 LM head: {where}.forward was already replaced by {head.__dict__['forward']!r}; "
            "refusing to stack on it"
        )
    # an fp32 weight is checked by the forward, which sees the dtype it is handed and the
    # autocast around it: under FSDP the weight at rest may be an fp32 master or a flat shard
    # that is bf16 in the forward, and a trainer's bf16 autocast computes from a bf16 copy


def _adapter_names(head: Any) -> list[str]:
    """Names on the head that are not a plain linear's: adapter attributes and submodules."""
    names = set(getattr(head, "_modules", {}))
    names |= {n for n in vars(head) if any(mark in n.lower() for mark in _ADAPTER_MARKS)}
    names |= {n for n in getattr(head, "_parameters", {}) if n not in ("weight", "bias")}
    return sorted(names)


def _plain_class(cls: type) -> type:
    """``cls`` without FSDP2's class swap (``fully_shard`` makes ``FSDP<cls>`` on the module)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return cls
    if issubclass(cls, FSDPModule):
        (base,) = [b for b in cls.__bases__ if b is not FSDPModule]
        return base
    return cls


def _fp32_weight(dtype: Any, where: str) -> str:
    return (
        f"fp32 LM head: {where} sees a {str(dtype).removeprefix('torch.')} head weight outside a bf16/fp16 "
        "autocast; the fp32-output head is for bf16/fp16 weights (an fp32 head, e.g. lm_head_precision: "
        "float32 or precision: float32, computes fp32 logits already, from values vLLM's bf16 head does "
        "not have); turn fp32_lm_head off, or run the head in bf16 (FSDP2's "
        "MixedPrecisionPolicy(param_dtype=bfloat16), or the forward under torch.autocast(dtype=torch.bfloat16))"
    )
