"""fp32 LM-head logits inside vLLM, correct across every weight refit.

Two patches call this module when vLLM's switch is set (``FP32PATCH_VLLM_LM_HEAD``, or
NeMo-RL's name for it, ``NRL_VLLM_FP32_LM_HEAD``; ``modes.vllm_switch`` reads both):

``vllm-fp32-logits`` (``vllm/model_executor/layers/logits_processor.py``, every model)
    vLLM 0.9.1-0.25: just before ``LogitsProcessor._get_logits`` runs the head GEMM,
    :func:`fp32_head` swaps the head for a stand-in whose GEMM returns fp32, and
    :func:`note_processor` logs a LoRA logits processor (whose own ``_get_logits`` keeps
    the stock path). vLLM 0.26 and later: :func:`native_head_dtype` turns on vLLM's own
    ``head_dtype=float32`` when the processor is built, and :func:`apply_head` takes only
    the heads vLLM's path refuses (a quantized head keeps the stock path).
``nemotron-h-fp32-lm-head`` (``vllm/model_executor/models/nemotron_h.py``)
    ``NemotronHForCausalLM.compute_logits`` calls :func:`compute_logits`, and
    ``load_weights`` calls :func:`mark_dirty`. With both patches applied the stand-in
    head this path hands the processor is recognised there, so the GEMM runs once.

Either way the logits still go through vLLM's own ``LogitsProcessor`` (tensor-parallel
gather, vocab-padding trim, soft-cap, scale, and on old vLLM the sampling-metadata
pruning). Two ways to the fp32 GEMM:

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
``head_dtype=float32`` (0.26+, set by the patch or by ``hf_overrides``) is recognised and
left to do the work (``native``); a quantized head or a LoRA logits processor keeps
vLLM's stock path (``stock``). Each decision is logged once per head, not per step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fp32patch.runtime import modes
from fp32patch.runtime.kernels import fp32out

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


def switch(environ: Any = None) -> tuple[str, str]:
    """vLLM's switch in this process (``environ``: default ``os.environ``): the name that is set,
    ``FP32PATCH_VLLM_LM_HEAD`` or ``NRL_VLLM_FP32_LM_HEAD``, and its value; ``(ENV, "")`` where
    neither is. Raises ``ValueError`` where both are set to different values."""
    found = modes.vllm_switch(os.environ if environ is None else environ)
    return found if found is not None else (ENV, "")


def requested_way(environ: Any = None) -> str | None:
    """The way vLLM's switch asks for: None (off), "auto", "fp32out" or "copy"."""
    name, value = switch(environ)
    if value in OFF_VALUES:
        return None
    if value not in WAYS:
        raise ValueError(
            f"{name}={value!r} is not a valid value; use one of {', '.join(VALID_VALUES)} (unset or 0 is off)"
        )
    return WAYS[value]


# ---------------------------------------------------------------- finding heads

# Where a model keeps the head it hands its logits processor, when the processor has not
# yet said (GPT-NeoX: embed_out; InternLM2: output; Gemma, Gemma2, Cohere: the tied
# input embedding, model.embed_tokens).
_HEAD_NAMES = ("lm_head", "embed_out", "output")


def _unwrap(model: Any) -> Any:
    for _ in range(16):  # CUDA-graph and compile wrappers expose the real module by unwrap()
        inner = model.unwrap() if callable(getattr(model, "unwrap", None)) else model
        if inner is model:
            return model
        model = inner
    return model


def _is_head(module: Any) -> bool:
    return module is not None and hasattr(module, "quant_method") and hasattr(module, "weight")


def _head_of(owner: Any) -> Any:
    """The head ``owner`` hands its ``logits_processor``: the one the processor last ran,
    else ``lm_head``, ``embed_out``, ``output`` or ``model.embed_tokens``; None if none."""
    processor = getattr(owner, "logits_processor", None)
    if processor is None:
        return None
    seen = _processor(processor).__dict__.get("_fp32patch_head")
    if seen is not None:
        return seen
    for name in _HEAD_NAMES:
        head = getattr(owner, name, None)
        if _is_head(head):
            return head
    head = getattr(getattr(owner, "model", None), "embed_tokens", None)
    return head if _is_head(head) else None


def _has_head(module: Any) -> bool:
    if getattr(module, "logits_processor", None) is None:
        return False
    if getattr(module, "lm_head", None) is not None:
        return True
    return _head_of(module) is not None


def resolve_heads(model: Any) -> list[Any]:
    """The modules that own a head and a ``logits_processor`` in ``model``.

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
            "language_model and every submodule for a module with a head and a logits_processor"
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
    reason: str = ""
    copy: _Copy = field(default_factory=_Copy)


def _processor(processor: Any) -> Any:
    """vLLM's own LogitsProcessor behind a LoRA wrapper (``base_layer``), else ``processor``."""
    base = getattr(processor, "base_layer", None)
    return base if base is not None else processor


def _state(processor: Any, head: Any, requested: str, hidden_dtype: torch.dtype, label: str) -> _State:
    state = head.__dict__.get("_fp32patch_state")
    if state is None or state.requested != requested:
        way, why = _decide(processor, head, requested, hidden_dtype)
        state = _State(way=way, requested=requested, reason=why)
        # object.__setattr__: a plain attribute, never a registered buffer or parameter
        object.__setattr__(head, "_fp32patch_state", state)
        level = logging.INFO if way in ("fp32out", "copy", "native") else logging.WARNING
        logger.log(level, "fp32patch: %s: %s (%s=%s)", label, why, *switch())
    return state


def _native_accepts(processor: Any) -> set[str]:
    """The head methods vLLM's own head_dtype path takes: the names its ``_apply_head``
    checks against (0.26-0.28: the embedding method only; 0.29+: the linear one too)."""
    apply_head = getattr(type(_processor(processor)), "_apply_head", None)
    names = getattr(apply_head, "__globals__", {})
    return {name for name in ("UnquantizedEmbeddingMethod", "UnquantizedLinearMethod") if name in names}


def _decide(processor: Any, head: Any, requested: str, hidden_dtype: torch.dtype) -> tuple[str, str]:
    import torch

    method = type(getattr(head, "quant_method", None)).__name__
    quantized = method not in _UNQUANTIZED
    base = _processor(processor)
    if getattr(base, "head_dtype", None) == torch.float32 and hidden_dtype != torch.float32:
        source = base.__dict__.get("_fp32patch_native_source", "hf_overrides head_dtype")
        if quantized:
            return "stock", (
                f"quantized head ({method}): vLLM's head_dtype=float32 path refuses it, the stock path is kept"
            )
        if method in _native_accepts(processor):
            return "native", f"vLLM computes this head in fp32 itself (head_dtype=float32, set by {source})"
        # vLLM 0.26-0.28 take only UnquantizedEmbeddingMethod; a quant config that excludes
        # lm_head hands out UnquantizedLinearMethod, which that path raises on
        return "fp32out", f"fp32 logits by fp32out: vLLM's head_dtype path refuses {method} in this release"
    if "LoRA" in type(processor).__name__:
        return "stock", "LoRA logits processor: LoRA adds its logits in the model dtype, so the stock bf16 path is kept"
    if quantized:
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
                f"run one eager forward first (vLLM's warm-up does) or use {switch()[0]}=fp32out"
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


# ---------------------------------------------------------------- entry points: nemotron-h-fp32-lm-head


def compute_logits(model: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The patched ``compute_logits``: the model's own logits processor on fp32 logits."""
    requested = requested_way()
    processor, head = model.logits_processor, model.lm_head
    if requested is None:  # reachable only if the variable changes under a running process
        return processor(head, hidden_states, *args, **kwargs)
    state = _state(processor, head, requested, hidden_states.dtype, f"{type(model).__name__}.lm_head")
    if state.way in ("stock", "native"):
        return processor(head, hidden_states, *args, **kwargs)
    return processor(_Fp32Head(head, state), hidden_states, *args, **kwargs)


# ---------------------------------------------------------------- entry points: vllm-fp32-logits


def _label(processor: Any, head: Any) -> str:
    return f"{type(processor).__name__}({type(head).__name__})"


def _remember(processor: Any, head: Any) -> None:
    # a plain __dict__ entry: never a registered submodule, so never in state_dict()
    _processor(processor).__dict__["_fp32patch_head"] = head


def fp32_head(processor: Any, lm_head: Any, hidden_states: torch.Tensor) -> Any:
    """vLLM 0.9.1-0.25, just before ``LogitsProcessor._get_logits`` runs the head GEMM: the
    head to run it on. A stand-in whose GEMM returns fp32, or ``lm_head`` itself where the
    stock path is kept or the head already is a stand-in (the NemotronH patch made it)."""
    if isinstance(lm_head, _Fp32Head):
        return lm_head  # routed once already: the GEMM runs once
    requested = requested_way()
    if requested is None:
        return lm_head
    _remember(processor, lm_head)
    state = _state(processor, lm_head, requested, hidden_states.dtype, _label(processor, lm_head))
    if state.way in ("fp32out", "copy"):
        return _Fp32Head(lm_head, state)
    return lm_head


def note_processor(processor: Any, lm_head: Any, hidden_states: torch.Tensor) -> None:
    """vLLM 0.9.1-0.25, after ``LogitsProcessor.forward`` got its logits: a LoRA logits
    processor ran its own ``_get_logits`` (the stock path, bf16); say so, once per head."""
    if "LoRA" not in type(processor).__name__ or isinstance(lm_head, _Fp32Head):
        return
    requested = requested_way()
    if requested is not None:
        _remember(processor, lm_head)
        _state(processor, lm_head, requested, hidden_states.dtype, _label(processor, lm_head))


def native_head_dtype(processor: Any, model_config: Any) -> torch.dtype:
    """vLLM 0.26+, as ``LogitsProcessor.__init__`` sets ``head_dtype``: float32 for ``1``, so
    vLLM's own head_dtype path computes the logits. A float32 ``head_dtype`` from
    ``hf_overrides`` is kept as it is; any other explicit one is overridden, with a log
    line. A named way (``fp32out``, ``copy``) keeps vLLM's head_dtype and is done by
    :func:`apply_head`, as on older releases."""
    import torch

    current = processor.head_dtype
    if current == torch.float32 or requested_way() != "auto":
        return current
    explicit = getattr(getattr(model_config, "hf_config", None), "head_dtype", None)
    if explicit is not None:
        logger.warning(
            "fp32patch: %s=%s overrides hf_overrides head_dtype=%s: the head runs in float32",
            *switch(),
            explicit,
        )
    processor.__dict__["_fp32patch_native_source"] = switch()[0]
    return torch.float32


def apply_head(processor: Any, lm_head: Any, hidden_states: torch.Tensor, embedding_bias: Any) -> torch.Tensor | None:
    """vLLM 0.26+, at the top of ``LogitsProcessor._apply_head``: None to let vLLM's own
    head_dtype path compute the logits, or the logits of a head that path would refuse or
    redo: the stand-in (already fp32), a quantized head (stock), an unquantized linear head
    on 0.26-0.28 (fp32out), a processor built before the variable was set (fp32out/copy)."""
    if isinstance(lm_head, _Fp32Head):
        return lm_head.quant_method.apply(lm_head, hidden_states, embedding_bias)
    requested = requested_way()
    if requested is None:
        return None
    _remember(processor, lm_head)
    state = _state(processor, lm_head, requested, hidden_states.dtype, _label(processor, lm_head))
    if state.way == "native":
        return None
    if state.way == "stock":
        return lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)
    return _Fp32Method(state).apply(lm_head, hidden_states, embedding_bias)


# ---------------------------------------------------------------- refits and reports


def _heads(model: Any) -> list[tuple[Any, Any]]:
    return [(owner, _head_of(owner) or owner.lm_head) for owner in resolve_heads(model)]


def mark_dirty(model: Any) -> None:
    """Weights are about to change (``load_weights``): rebuild any fp32 copy before its next use."""
    for _, head in _heads(model):
        state = head.__dict__.get("_fp32patch_state")
        if state is not None:
            state.copy.dirty = True


def sync(model: Any) -> int:
    """After a refit, bring every fp32 copy in ``model`` up to date now; returns how many.

    For integrations that write weights without ``load_weights`` and replay CUDA graphs
    before any eager call would notice. Raises if ``model`` has no resolvable LM head.
    """
    rebuilt = 0
    for _, head in _heads(model):
        state = head.__dict__.get("_fp32patch_state")
        if state is not None and state.way == "copy" and state.copy.weight is not None:
            weight = head.weight
            if _capturing(weight):
                raise RuntimeError("fp32patch.sync() cannot rebuild the fp32 copy during CUDA-graph capture")
            _rebuild(state.copy, weight)
            rebuilt += 1
    return rebuilt


# the gate both vLLM patches insert (fp32patch/patches/snippets/vllm_gate.py): in the
# model's module it is NemotronH's patch, in the logits processor's module the generic one
_GATE = "_fp32patch_lm_head_runtime"


def _patched_by(owner: Any, processor: Any) -> str | None:
    """Which patch routes this head: NemotronH's own, else the generic one, else none."""
    import sys

    for patch, cls in (("nemotron-h-fp32-lm-head", type(owner)), ("vllm-fp32-logits", type(_processor(processor)))):
        module = sys.modules.get(cls.__module__)
        if module is not None and _GATE in vars(module):
            return patch
    return None


def describe(model: Any) -> list[dict]:
    """What each head in ``model`` does (for startup probes, logs and tests).

    Per head: ``owner`` (the model class), ``head`` (the head's class), ``patch`` (the
    patch that routes it, or None), ``way`` ("fp32out", "copy", "native" or "stock") and
    ``reason``, the copy's builds and bytes. Before the first logits the way is the one
    the runtime would take now.
    """
    import torch

    out = []
    for owner, head in _heads(model):
        processor = owner.logits_processor
        patch = _patched_by(owner, processor)
        state = head.__dict__.get("_fp32patch_state")
        if state is not None:
            way, reason = state.way, state.reason
        else:
            native = getattr(_processor(processor), "head_dtype", None) == torch.float32
            try:
                requested = requested_way()
            except ValueError as exc:
                requested, reason = None, str(exc)
            else:
                name, value = switch()
                reason = f"{name} is unset or 0" if not value else f"{name}={value!r}"
            weight = getattr(head, "weight", None)
            if patch is None and not native:
                way, reason = "stock", "neither fp32patch vLLM patch is applied to the files this model runs"
            elif requested is None and not native:
                way = "stock"
            else:
                hidden = weight.dtype if weight is not None else torch.bfloat16
                way, reason = _decide(processor, head, requested or "auto", hidden)
        out.append(
            {
                "owner": type(owner).__name__,
                "head": type(head).__name__,
                "patch": patch,
                "way": way,
                "reason": reason,
                "copy_builds": state.copy.builds if state else 0,
                "copy_bytes": (state.copy.weight.numel() * 4) if state and state.copy.weight is not None else 0,
            }
        )
    return out
