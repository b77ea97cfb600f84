"""fp32 LM-head logits inside vLLM, correct across every weight refit.

The patched ``NemotronHForCausalLM.compute_logits`` calls :func:`compute_logits` when
``NRL_VLLM_FP32_LM_HEAD`` is set, and ``load_weights`` calls :func:`mark_dirty`. The
logits still go through the model's own ``LogitsProcessor`` (tensor-parallel gather,
vocab-padding trim, soft-cap, scale, and on old vLLM the sampling-metadata pruning): we
hand it a stand-in for the head whose GEMM returns fp32. Two ways to that GEMM:

``fp32out``
    bf16 x bf16 with an fp32 result (``torch.mm(..., out_dtype=torch.float32)`` on CUDA;
    an exact upcast where torch has no such kernel). Nothing is cached, so nothing can
    go stale, whatever path a refit takes.
``copy``
    An fp32 copy of the head's weight (the original design; for torch without
    ``out_dtype``, and as a reference). It is kept off ``named_parameters()``, never
    allocated while a CUDA graph is being captured, marked dirty by ``load_weights``,
    and also checked before each eager use against the live weight's storage, version
    counter and a strided sample of its values, because some refits write straight into
    the parameter (``param.data.copy_``) and never call ``load_weights``. A rebuild
    copies in place when it can (so captured graphs see it) and is checked equal to the
    live head.

``1`` picks ``fp32out`` where the kernel exists and ``copy`` elsewhere. vLLM's own
``head_dtype=float32`` (0.26+) is recognised and left to do the work; a quantized head
or a LoRA logits processor falls back to vLLM's stock path. Each decision is logged
once per head, not per step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fp32patch.runtime import fp32out, modes

if TYPE_CHECKING:
    import torch

ENV = modes.VLLM_ENV_VAR
OFF_VALUES = ("", *modes.VLLM_OFF_VALUES)  # an empty value is unset
# "1" asks for the best way available; the others name one
WAYS = {value: ("auto" if value == "1" else value) for value in modes.VLLM_ON_VALUES}
VALID_VALUES = (*modes.VLLM_OFF_VALUES, *modes.VLLM_ON_VALUES)
_UNQUANTIZED = {"UnquantizedEmbeddingMethod", "UnquantizedLinearMethod"}
_SAMPLE_POINTS = 1 << 16  # elements of the weight compared before each eager use of a copy

# A child of vLLM's logger, so these lines go where vLLM's own go.
logger = logging.getLogger("vllm.fp32patch")


def requested_way(environ: Any = None) -> str | None:
    """The way ``NRL_VLLM_FP32_LM_HEAD`` asks for: None (off), "auto", "fp32out" or "copy"."""
    value = (environ if environ is not None else os.environ).get(ENV, "").strip()
    if value in OFF_VALUES:
        return None
    if value not in WAYS:
        raise ValueError(
            f"{ENV}={value!r} is not a valid value; use one of {', '.join(VALID_VALUES)} (unset or 0 is off)"
        )
    return WAYS[value]


# ---------------------------------------------------------------- finding heads


def _unwrap(model: Any) -> Any:
    for _ in range(16):  # CUDA-graph and compile wrappers expose the real module by unwrap()
        inner = model.unwrap() if callable(getattr(model, "unwrap", None)) else model
        if inner is model:
            return model
        model = inner
    return model


def _has_head(module: Any) -> bool:
    return getattr(module, "lm_head", None) is not None and getattr(module, "logits_processor", None) is not None


def resolve_heads(model: Any) -> list[Any]:
    """The modules that own an ``lm_head`` and a ``logits_processor`` in ``model``.

    Looks through ``unwrap()``, then ``language_model`` nesting (VL models), then scans
    the module tree. A model with none raises: a refit hook that silently finds nothing
    would leave a stale copy behind.
    """
    seen: set[int] = set()
    module = _unwrap(model)
    while module is not None and id(module) not in seen:
        seen.add(id(module))
        if _has_head(module):
            return [module]
        module = (
            _unwrap(getattr(module, "language_model", None))
            if getattr(module, "language_model", None) is not None
            else None
        )
    root = _unwrap(model)
    found = [m for _, m in root.named_modules() if _has_head(m)] if hasattr(root, "named_modules") else []
    if not found:
        raise LookupError(
            f"fp32patch: no LM head found in {type(root).__name__}: looked through unwrap(), "
            "language_model and every submodule for a module with lm_head and logits_processor"
        )
    return found


# ---------------------------------------------------------------- per-head state


@dataclass
class _Copy:
    """The fp32 copy of one head's weight and what it was built from."""

    weight: torch.Tensor | None = None
    key: tuple = ()
    sample: torch.Tensor | None = None
    dirty: bool = True
    builds: int = 0


@dataclass
class _State:
    way: str  # "fp32out", "copy", "native", "stock"
    requested: str
    copy: _Copy = field(default_factory=_Copy)


def _state(owner: Any, requested: str, hidden_dtype: torch.dtype) -> _State:
    head = owner.lm_head
    state = head.__dict__.get("_fp32patch_state")
    if state is None or state.requested != requested:
        way, why = _decide(owner, requested, hidden_dtype)
        state = _State(way=way, requested=requested)
        # object.__setattr__: a plain attribute, never a registered buffer or parameter
        object.__setattr__(head, "_fp32patch_state", state)
        level = logging.INFO if way in ("fp32out", "copy", "native") else logging.WARNING
        logger.log(level, "fp32patch: %s.lm_head: %s (%s=%s)", type(owner).__name__, why, ENV, os.environ.get(ENV, ""))
    return state


def _decide(owner: Any, requested: str, hidden_dtype: torch.dtype) -> tuple[str, str]:
    import torch

    processor, head = owner.logits_processor, owner.lm_head
    if "LoRA" in type(processor).__name__:
        return "stock", "LoRA logits processor: LoRA adds its logits in the model dtype, so the stock bf16 path is kept"
    if getattr(processor, "head_dtype", None) == torch.float32:
        return "native", "vLLM computes this head in fp32 itself (head_dtype=float32); fp32patch defers to it"
    method = type(getattr(head, "quant_method", None)).__name__
    if method not in _UNQUANTIZED:
        return "stock", f"quantized head ({method}): no bf16 weight to multiply in fp32, the stock path is kept"
    weight = getattr(head, "weight", None)
    if weight is None or hidden_dtype == torch.float32:
        return "stock", "the head already runs in fp32"
    supported = fp32out.out_dtype_supported(weight.device, weight.dtype)
    if requested == "auto":
        way = "fp32out" if supported else "copy"
    else:
        way = requested
    if way == "fp32out":
        how = (
            "bf16 GEMM with fp32 output"
            if supported
            else "exact upcast per call (this torch has no out_dtype kernel here)"
        )
        return "fp32out", f"fp32 logits by fp32out: {how}, no weight copy"
    return "copy", "fp32 logits by copy: an fp32 copy of the weight, rebuilt after every refit"


# ---------------------------------------------------------------- the copy way


def _capturing(weight: torch.Tensor) -> bool:
    import torch

    return weight.is_cuda and torch.cuda.is_current_stream_capturing()


def _key(weight: torch.Tensor) -> tuple:
    return (weight.data_ptr(), tuple(weight.shape), weight.dtype, weight.device, weight._version)


def _sample(weight: torch.Tensor) -> torch.Tensor:
    # a strided walk over the flattened weight (every element of a small head); with a
    # stride that is not a multiple of the row length it visits a different column in
    # each row it passes. A refit rewrites the whole matrix and so shows in the sample; a
    # write of a few elements outside it would not: integrations doing that call sync().
    flat = weight.detach().reshape(-1)
    stride = max(1, flat.numel() // _SAMPLE_POINTS)
    if weight.dim() == 2 and stride % weight.shape[1] == 0:
        stride += 1
    return flat[::stride]


def _stale(copy: _Copy, weight: torch.Tensor) -> bool:
    import torch

    if copy.weight is None or copy.dirty or copy.key != _key(weight):
        return True
    return not torch.equal(copy.sample, _sample(weight))


def _equal_chunked(a: torch.Tensor, b: torch.Tensor, rows: int = 8192) -> bool:
    import torch

    return all(torch.equal(a[i : i + rows], b[i : i + rows].float()) for i in range(0, b.shape[0], rows))


def _rebuild(copy: _Copy, weight: torch.Tensor) -> None:
    import torch

    with torch.no_grad():
        if copy.weight is not None and copy.weight.shape == weight.shape and copy.weight.device == weight.device:
            copy.weight.copy_(weight)  # in place: a captured graph keeps reading the same memory
        else:
            copy.weight = weight.detach().float()
        if not _equal_chunked(copy.weight, weight.detach()):
            raise RuntimeError("fp32patch: the rebuilt fp32 LM-head copy differs from the live bf16 head")
        copy.sample = _sample(weight).clone()
    copy.key = _key(weight)
    copy.dirty = False
    copy.builds += 1
    if copy.builds > 1:
        logger.debug("fp32patch: fp32 LM-head copy rebuilt after a refit (build %d)", copy.builds)


def _copy_weight(state: _State, weight: torch.Tensor) -> torch.Tensor:
    copy = state.copy
    if _capturing(weight):
        if copy.weight is None:
            raise RuntimeError(
                "fp32patch: the fp32 LM-head copy would be allocated inside CUDA-graph capture; "
                "run one eager forward first (vLLM's warm-up does) or use NRL_VLLM_FP32_LM_HEAD=fp32out"
            )
        return copy.weight  # no checks and no allocation inside a capture
    if _stale(copy, weight):
        _rebuild(copy, weight)
    assert copy.weight is not None
    return copy.weight


# ---------------------------------------------------------------- the head stand-in


class _Fp32Method:
    """Plays ``lm_head.quant_method`` for vLLM's LogitsProcessor, returning fp32 logits."""

    def __init__(self, state: _State):
        self.state = state

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        import torch.nn.functional as F

        head = layer._head if isinstance(layer, _Fp32Head) else layer
        weight = head.weight
        if self.state.way == "copy":
            fp32_weight = _copy_weight(self.state, weight)
            return F.linear(x.float(), fp32_weight, bias.float() if bias is not None else None)
        return fp32out.linear(x, weight, bias)


class _Fp32Head:
    """The real head for every attribute but ``quant_method``."""

    def __init__(self, head: Any, state: _State):
        object.__setattr__(self, "_head", head)
        object.__setattr__(self, "quant_method", _Fp32Method(state))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._head, name)


# ---------------------------------------------------------------- entry points


def compute_logits(model: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The patched ``compute_logits``: the model's own logits processor on fp32 logits."""
    requested = requested_way()
    processor, head = model.logits_processor, model.lm_head
    if requested is None:  # reachable only if the variable changes under a running process
        return processor(head, hidden_states, *args, **kwargs)
    state = _state(model, requested, hidden_states.dtype)
    if state.way in ("stock", "native"):
        return processor(head, hidden_states, *args, **kwargs)
    return processor(_Fp32Head(head, state), hidden_states, *args, **kwargs)


def mark_dirty(model: Any) -> None:
    """Weights are about to change (``load_weights``): rebuild any fp32 copy before its next use."""
    for owner in resolve_heads(model):
        state = owner.lm_head.__dict__.get("_fp32patch_state")
        if state is not None:
            state.copy.dirty = True


def sync(model: Any) -> int:
    """After a refit, bring every fp32 copy in ``model`` up to date now; returns how many.

    For integrations that write weights without ``load_weights`` and replay CUDA graphs
    before any eager call would notice. Raises if ``model`` has no resolvable LM head.
    """
    rebuilt = 0
    for owner in resolve_heads(model):
        state = owner.lm_head.__dict__.get("_fp32patch_state")
        if state is not None and state.way == "copy" and state.copy.weight is not None:
            weight = owner.lm_head.weight
            if _capturing(weight):
                raise RuntimeError("fp32patch.sync() cannot rebuild the fp32 copy during CUDA-graph capture")
            _rebuild(state.copy, weight)
            rebuilt += 1
    return rebuilt


def describe(model: Any) -> list[dict]:
    """What each head in ``model`` does now (for logs and tests)."""
    out = []
    for owner in resolve_heads(model):
        state = owner.lm_head.__dict__.get("_fp32patch_state")
        out.append(
            {
                "owner": type(owner).__name__,
                "way": state.way if state else None,
                "copy_builds": state.copy.builds if state else 0,
                "copy_bytes": (state.copy.weight.numel() * 4) if state and state.copy.weight is not None else 0,
            }
        )
    return out
