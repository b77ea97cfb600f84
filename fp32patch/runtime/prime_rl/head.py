"""fp32-grade forwards for the LM heads Prime-RL's ``inject_prime_lm_head`` installs.

Prime-RL replaces a model's ``lm_head`` by one of four ``nn.Linear`` subclasses, called as
``lm_head(hidden_states, labels, temperature=...)`` by the forward it binds to the model:

- ``FusedOutputLinear`` (``chunk_size`` tokens per chunk) and ``GemmaFusedOutputLinear`` (with a
  ``softcap``) return ``{"logprobs", "entropy"}`` [B, S] from bf16 logits chunks upcast to fp32;
- ``VanillaOutputLinear`` and ``GemmaVanillaOutputLinear`` return ``{"logits"}`` (bf16; the
  Gemma kind soft-caps them in bf16), which the trainer divides by the per-token temperatures.

``install(model, mode)`` gives that head, on the instance, a forward that computes the same
outputs at fp32 grade: the fused kinds with ``kernels.chunked_logprobs`` (fp32 logits from the
bf16 operands, Gemma's cap in fp32 after the GEMM, each token's temperature, the entropy and
its gradient; the chunk of tokens is the head's ``chunk_size``), the vanilla kinds with the HF
head's fp32-output GEMM (``heads.hf.fp32_linear``) and the cap in fp32. The class, its names,
state dict and FSDP2's hooks stay; the weight is read at every call.

The per-token temperatures go to the kernel as they come (its Triton steps divide each row by
its own, and apply the soft-cap, on CUDA): no device sync asks whether they are all one value.

Refused (``UnsupportedLmHeadError``, naming what was found): a head of another class (FP8 or
LoRA wrapping, a model's own head), a soft-capped model whose head is not Prime-RL's Gemma kind
or caps at another value, a ``forward`` already replaced by someone else. Imports torch only
when called.
"""

from __future__ import annotations

from types import MethodType
from typing import Any

from fp32patch.runtime.heads.hf import UnsupportedLmHeadError

# Prime-RL's head classes: name -> (fused, soft-capped)
KINDS: dict[str, tuple[bool, bool]] = {
    "FusedOutputLinear": (True, False),
    "VanillaOutputLinear": (False, False),
    "GemmaFusedOutputLinear": (True, True),
    "GemmaVanillaOutputLinear": (False, True),
}


class PrimeHeadForward:
    """Stands in for a Prime-RL head's ``forward``, bound to it; its presence in the head's
    ``__dict__`` marks the head, and ``mode`` says how it computes."""

    __name__ = "forward"

    def __init__(self, kind: str, mode: str) -> None:
        self.kind = kind
        self.mode = mode
        self.fused, self.capped = KINDS[kind]
        self.__qualname__ = repr(self)

    def __repr__(self) -> str:
        return f"PrimeHeadForward(kind={self.kind!r}, mode={self.mode!r})"

    def __call__(self, head: Any, hidden_states: Any, labels: Any = None, temperature: Any = None) -> dict[str, Any]:
        softcap = float(head.softcap) if self.capped else None
        if not self.fused:
            return {"logits": vanilla_logits(hidden_states, head.weight, self.mode, softcap)}
        if labels is None or temperature is None:
            raise ValueError(f"fp32patch: {self.kind} needs labels and per-token temperatures, as Prime-RL's own does")
        logprobs, entropy = fused_logprobs(
            hidden_states, head.weight, labels, temperature, self.mode, softcap, int(head.chunk_size)
        )
        return {"logprobs": logprobs, "entropy": entropy}


def vanilla_logits(hidden: Any, weight: Any, mode: str, softcap: float | None) -> Any:
    """fp32 logits [B, S, V] from the bf16 operands, capped in fp32."""
    import torch

    from fp32patch.runtime.heads.hf import fp32_linear

    logits = fp32_linear(hidden, weight, None, mode)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


# The logits one of our tiles may hold here (8 bytes each at the backward's peak): Prime-RL's own
# head held a step of a 0.5B model at 4,096 tokens 0.75 GiB over what the step holds besides the
# head's tiles, on an H100 (2026-12-05, bench/RESULTS.md), where our 8192 x 30400 tiles held it
# 0.17 GiB over Prime-RL's. 4096 x 22528 logits: 0.69 GiB, under Prime-RL's with a margin for
# what was not measured (other models, other token counts).
TILE_LOGITS = 4096 * 22528


def fused_logprobs(hidden: Any, weight: Any, labels: Any, temperature: Any, mode: str, softcap: Any, chunk: int):
    """Log-probs and entropy [B, S] of each label under the capped, temperature-scaled fp32 logits."""
    from fp32patch.runtime.kernels.chunked_logprobs import choose_tiles, chunked_logprobs

    b, s, h = hidden.shape
    weight = compute_weight(weight)
    width = choose_tiles(b * s, weight.shape[0], h, rows=chunk, logits=TILE_LOGITS)[1]
    temps = temperature.reshape(b * s)
    logprobs, entropy = chunked_logprobs(
        hidden.reshape(b * s, h),
        weight,
        labels.reshape(b * s),
        mode=mode,
        temperature=temps,
        entropy=True,
        softcap=softcap,
        chunk_rows=chunk,
        chunk_vocab=width,
    )
    return logprobs.reshape(b, s), entropy.reshape(b, s)


def compute_weight(weight: Any) -> Any:
    """The weight the GEMM takes: bf16/fp16 as FSDP2's ``param_dtype`` hands it; an fp32 weight
    only under a bf16/fp16 autocast (cast inside the graph, as the HF head does); a DTensor is
    refused (Prime-RL shards the head with FSDP2 alone, whose forward sees a plain tensor)."""
    from fp32patch.runtime.heads import hf

    if hf._is_dtensor(weight):
        raise UnsupportedLmHeadError(
            f"fp32patch: the head's weight is a DTensor {tuple(weight.placements)} in the forward; Prime-RL's heads "
            "are sharded by FSDP2 alone, which hands the forward a plain tensor"
        )
    if str(weight.dtype).removeprefix("torch.") in hf._LOW_PRECISION:
        return weight
    dtype = hf._autocast_dtype(weight.device.type)
    if dtype is None:
        raise UnsupportedLmHeadError(hf._fp32_weight(weight.dtype, "Prime-RL's fused head"))
    return weight.to(dtype)


def install(model: Any, mode: str) -> str:
    """Give ``model.lm_head`` (as ``inject_prime_lm_head`` left it, after quantization, LoRA and
    FSDP2) the fp32-grade forward in ``mode``; returns the head's kind. The same mode again is
    a no-op; another raises ``ValueError``."""
    head = getattr(model, "lm_head", None)
    if head is None:
        raise UnsupportedLmHeadError(f"fp32patch: {type(model).__name__} has no lm_head for Prime-RL's head to be")
    kind = kind_of(head)
    current = mode_of(head)
    if current is not None:
        if current != mode:
            raise ValueError(f"fp32patch: the {kind} already computes in mode {current!r}; refusing {mode!r}")
        return kind
    if kind is None:
        found = f"{type(head).__module__}.{type(head).__qualname__}"
        raise UnsupportedLmHeadError(
            f"fp32patch: the model's lm_head is a {found}, not one of the heads Prime-RL's inject_prime_lm_head "
            f"installs ({', '.join(KINDS)}): a quantized (FP8) or LoRA-wrapped head, or a model's own, computes its "
            "own logits, which fp32patch would not make fp32. Keep lm_head out of quantization and LoRA, or set "
            "inference.enable_fp32_lm_head = false (both sides bf16)"
        )
    _check_softcap(model, head, kind)
    if "forward" in head.__dict__:
        raise UnsupportedLmHeadError(
            f"fp32patch: the {kind}'s forward was already replaced by {head.__dict__['forward']!r}; refusing to stack on it"
        )
    head.forward = MethodType(PrimeHeadForward(kind, mode), head)
    return kind


def kind_of(head: Any) -> str | None:
    """Which of Prime-RL's heads ``head`` is (through FSDP2's class swap), or None."""
    import torch

    for cls in type(head).__mro__:
        if cls.__name__ in KINDS and issubclass(cls, torch.nn.Linear):
            extra = [n for n in getattr(head, "_modules", {})] + [
                n for n in getattr(head, "_parameters", {}) if n not in ("weight", "bias")
            ]
            return None if extra or getattr(head, "bias", None) is not None else cls.__name__
    return None


def mode_of(head: Any) -> str | None:
    forward = getattr(head, "__dict__", {}).get("forward")
    if isinstance(forward, MethodType) and isinstance(forward.__func__, PrimeHeadForward):
        return forward.__func__.mode
    return None


def _check_softcap(model: Any, head: Any, kind: str) -> None:
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(text, "final_logit_softcapping", None)
    capped = KINDS[kind][1]
    if cap and not capped:
        raise UnsupportedLmHeadError(
            f"fp32patch: the model caps its logits (final_logit_softcapping={cap}) but its head is a {kind}, which "
            "does not: the cap is computed another way than Prime-RL's Gemma heads (and vLLM) compute it"
        )
    if capped and (not cap or float(cap) != float(head.softcap)):
        raise UnsupportedLmHeadError(
            f"fp32patch: the {kind} caps at {head.softcap} but the model's final_logit_softcapping is {cap!r}; "
            "vLLM caps at the model's value"
        )
