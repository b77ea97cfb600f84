"""The heads a stack wired, found again from the weight its fused log-prob path is handed.

A stack's fused log-prob path (verl's ``FusedLinearForPPO`` and ``linear_cross_entropy``, TRL's
chunked log-probs) computes log-probs from the hidden states and the head's weight directly and
never calls the head, so the head's fp32 forward does not reach it. ``Stack.wire`` remembers
every head it wires (``remember``); at a fused call, ``wired_mode(weight)`` tells whether
``weight`` is, at that moment, the weight of such a head and in which mode: the stack then
computes the log-probs with ``kernels.chunked_logprobs`` in that mode, and an unwired model's
call goes on to the stack's own kernel untouched.

The weight is compared by identity with what the head itself would read at that moment (the
HF head's ``weight``, which FSDP swaps for the unsharded parameter during the forward; the
shared embedding of a tied Megatron model), so a fused call of the same forward finds the same
object. Heads are held weakly: a model that is gone is forgotten. Pure Python until called with
a model; imports torch only through the heads.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

# Engines whose trainer heads the kit wires: Megatron's (``heads.megatron``) and PyTorch/HF's (``heads.hf``).
TRAINERS = ("megatron", "hf")

_LOCK = threading.Lock()
# (weak reference to the module that reads the weight, the trainer whose head it is)
_WIRED: list[tuple[weakref.ref, str]] = []


def remember(model: Any, trainer: str) -> int:
    """Remember the wired heads of ``model`` (as ``Stack.wire`` handed it to the trainer's head:
    a module, or Megatron's chunk list); returns how many it holds. ``trainer``: ``"hf"`` or
    ``"megatron"``. A head already remembered is not added twice."""
    if trainer not in TRAINERS:
        raise ValueError(f"trainer must be one of {TRAINERS}, not {trainer!r}")
    found = _hf_heads(model) if trainer == "hf" else _megatron_owners(model)
    with _LOCK:
        _WIRED[:] = [(ref, kind) for ref, kind in _WIRED if ref() is not None]
        known = {id(ref()) for ref, _ in _WIRED}
        for module in found:
            if id(module) not in known:
                _WIRED.append((weakref.ref(module), trainer))
                known.add(id(module))
    return len(found)


def wired_mode(weight: Any, trainer: str | None = None) -> str | None:
    """The mode of the wired head whose weight ``weight`` is at this moment (None: no wired
    head's, and the stack's own fused kernel runs). ``trainer`` limits the search to one
    trainer's heads."""
    found = wired_head(weight, trainer)
    return None if found is None else found[1]


def wired_head(weight: Any, trainer: str | None = None) -> tuple[Any, str] | None:
    """``(module, mode)`` of the wired head whose weight ``weight`` is at this moment, or None:
    the HF head itself, or the Megatron module that owns the output layer (whose flags, such as
    ``output_layer.gradient_accumulation_fusion``, a fused path follows)."""
    with _LOCK:
        wired = list(_WIRED)
    for ref, kind in wired:
        module = ref()
        if module is None or (trainer is not None and kind != trainer):
            continue
        if _current_weight(module, kind) is weight:
            mode = _mode(module, kind)
            return None if mode is None else (module, mode)
    return None


def forget_all() -> None:
    """Forget every remembered head (tests; a process that rebuilds its models)."""
    with _LOCK:
        _WIRED.clear()


def _hf_heads(model: Any) -> list[Any]:
    """The heads of ``model`` that the HF head's override runs on."""
    from fp32patch.runtime.heads.hf import Fp32HeadForward

    modules = model.modules() if hasattr(model, "modules") else [model]
    return [
        m
        for m in modules
        if isinstance(getattr(getattr(m, "__dict__", {}).get("forward"), "__func__", None), Fp32HeadForward)
    ]


def _megatron_owners(model: Any) -> list[Any]:
    """The modules whose ``output_layer`` is a wired Megatron output layer (they know whether
    the layer's weight is the shared embedding's)."""
    from fp32patch.runtime.heads.megatron import fp32_lm_head_mode

    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    owners = []
    for chunk in chunks:
        for module in chunk.modules() if hasattr(chunk, "modules") else [chunk]:
            layer = getattr(module, "output_layer", None)
            if layer is not None and fp32_lm_head_mode(layer) is not None:
                owners.append(module)
    return owners


def _current_weight(module: Any, kind: str) -> Any:
    if kind == "hf":
        return getattr(module, "weight", None)
    shared = getattr(module, "shared_embedding_or_output_weight", None)
    if callable(shared) and getattr(module, "share_embeddings_and_output_weights", False):
        return shared()
    return getattr(module.output_layer, "weight", None)


def _mode(module: Any, kind: str) -> str | None:
    if kind == "hf":
        from fp32patch.runtime.heads.hf import fp32_lm_head_mode

        return fp32_lm_head_mode(module)
    from fp32patch.runtime.heads.megatron import fp32_lm_head_mode

    return fp32_lm_head_mode(module.output_layer)
