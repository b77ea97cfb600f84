"""OpenRLHF's ``Actor.forward`` at fp32 grade without the [B, T, V] logits.

Stock OpenRLHF runs the HF model, takes its bf16 logits, upcasts them to fp32 (a [B, T, V] fp32
tensor besides the bf16 one), divides them by the temperature and computes the entropy and the
log-probs from them. For an actor the switch marked (``mark``), the patched ``forward`` calls the
model through ``model_call`` instead: within that call the head's forward (``heads.hf``'s, which
``mark`` put on it) hands its input and weight to ``kernels.chunked_logprobs``, which computes
the log-probs of the next tokens, and the entropy where asked, from the bf16 operands vLLM
computes with, with fp32 products, the temperature dividing the fp32 logits, never holding more
than one tile of them. Computing them *inside* the head's call is what makes DeepSpeed ZeRO-3
work: its hooks have gathered the head's weight for that call, and gather it again before the
backward of the tensor the call returns, as for the stock head. ZeRO-2 and one process need
nothing else.

The model's output then holds, where OpenRLHF keeps its logits, ``Fp32LogProbs``: what the rest
of the stock ``forward`` does with the logits it does with that object, which checks each step
against what was computed: ``.to(torch.float32)`` (nothing to do), ``.div_(temperature)``
(0.11.1+; the same temperature), ``compute_entropy`` (before the division up to 0.11.0, after it
from 0.11.1, as each release computes it: ``entropy_after_temperature``) and
``log_probs_from_logits`` (with the release's temperature argument up to 0.11.0). Anything else
is refused, never guessed at.

A call that wants the logits themselves (no action mask, no log-probs) runs the model as it is:
the head then gives full fp32 logits (``heads.hf``), as the switch promises.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import weakref
from typing import Any

from fp32patch.runtime.heads.hf import UnsupportedLmHeadError

# The attributes the switch sets on an ``Actor`` instance: the trainer's mode (read by the
# patched files, openrlhf_gate.py, without importing fp32patch) and its head (weakly).
MARK = "_fp32patch_lm_head"
HEAD = "_fp32patch_head"
SOFTCAP = "_fp32patch_softcap"  # the HF model's final soft-cap (None: none), read before an engine wraps it


def marked_mode(actor: Any) -> str | None:
    """The mode ``mark`` gave ``actor``, or None."""
    return getattr(actor, MARK, None)


def mark(actor: Any, model: Any, mode: str, *, role: str) -> Any:
    """Route ``actor``'s log-probs through fp32patch's chunked piece in ``mode``; ``model`` is the
    HF model (or PEFT's wrapper) whose head ``heads.hf`` converted. Refuses a head the chunked
    piece cannot compute (a bias); a model's final soft-cap is computed on the fp32 logits.
    Returns ``actor``."""
    from fp32patch.runtime.heads.hf import chunkable_head, final_softcap

    head, _ = chunkable_head(model, role=role, turn_off="drop --fp32_lm_head")
    # plain attributes: a module here would become a submodule of the actor (and of its state dict)
    setattr(actor, MARK, mode)
    setattr(actor, HEAD, weakref.ref(head))
    setattr(actor, SOFTCAP, final_softcap(model))
    return actor


def model_call(actor: Any, targets: Any, log_probs: bool, entropy: bool, *, entropy_after_temperature: bool) -> Any:
    """What the patched ``Actor.forward`` calls in place of ``self.model``: the model itself where
    the caller wants the logits (``log_probs`` false), else ``ChunkedCall``."""
    if not log_probs:
        return actor.model
    head = getattr(actor, HEAD)()
    if head is None:
        raise UnsupportedLmHeadError("fp32 LM head: the actor's head is gone (the model was replaced after wiring)")
    return ChunkedCall(actor, head, targets, entropy=entropy, entropy_after_temperature=entropy_after_temperature)


class ChunkedCall:
    """Runs the actor's model with the head computing the chunked log-probs of ``targets`` (and
    the entropy) instead of its logits; returns the model's output with ``Fp32LogProbs`` as its
    logits."""

    def __init__(self, actor: Any, head: Any, targets: Any, *, entropy: bool, entropy_after_temperature: bool) -> None:
        self.actor, self.head, self.targets = actor, head, targets
        self.mode = marked_mode(actor)
        self.temperature = float(getattr(actor, "temperature", 1.0))
        self.entropy_temperature = (self.temperature if entropy_after_temperature else 1.0) if entropy else None
        self.softcap = getattr(actor, SOFTCAP, None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from fp32patch.runtime.heads.hf import call_computing_log_probs

        output, packed = call_computing_log_probs(
            self.actor.model,
            self.head,
            self.compute,
            args,
            kwargs,
            softcap=self.softcap,
            turn_off="drop --fp32_lm_head",
        )
        output["logits"] = Fp32LogProbs(packed, self.targets, self.temperature, self.entropy_temperature)
        return output

    def compute(self, hidden: Any, weight: Any) -> Any:
        """In the head's call: [..., 1] log-probs, or [..., 2] log-probs and entropy, fp32 (of the
        capped logits where the model caps them)."""
        import torch

        from fp32patch.runtime.kernels.chunked_logprobs import chunked_logprobs

        if tuple(hidden.shape[:-1]) != tuple(self.targets.shape):
            raise UnsupportedLmHeadError(
                f"fp32 LM head: the head got hidden states {tuple(hidden.shape)} for targets "
                f"{tuple(self.targets.shape)}; fp32patch's chunked log-probs need one target per position"
            )
        targets = self.targets.to(hidden.device)

        def call(temperature: float, entropy: bool = False) -> Any:
            return chunked_logprobs(
                hidden, weight, targets, mode=self.mode, temperature=temperature, entropy=entropy, softcap=self.softcap
            )

        if self.entropy_temperature is None:
            columns = [call(self.temperature)]
        elif self.entropy_temperature == self.temperature:
            columns = list(call(self.temperature, entropy=True))
        else:  # up to 0.11.0 the entropy is that of the logits before the temperature divides them
            columns = [call(self.temperature), call(1.0, entropy=True)[1]]
        return torch.stack(columns, dim=-1)


class Fp32LogProbs:
    """Stands where OpenRLHF's actor keeps its logits, holding fp32patch's log-probs (and entropy)
    of the targets the call was given; each use checks that it is the one computed."""

    def __init__(self, packed: Any, targets: Any, temperature: float, entropy_temperature: float | None) -> None:
        self.packed, self.targets = packed, targets
        self.temperature, self.entropy_temperature = temperature, entropy_temperature
        self.divided_by = 1.0

    @property
    def dtype(self) -> Any:
        return self.packed.dtype

    def __repr__(self) -> str:
        return f"Fp32LogProbs(shape={tuple(self.packed.shape[:-1])}, temperature={self.temperature})"

    def to(self, *args: Any, **kwargs: Any) -> Fp32LogProbs:
        """``.to(torch.float32)``: they are fp32 already. Any other conversion is refused."""
        import torch

        dtype = kwargs.get("dtype", args[0] if args else None)
        if dtype is not torch.float32:
            raise UnsupportedLmHeadError(
                f"fp32 LM head: OpenRLHF converts the logits with .to({args}, {kwargs}); fp32patch's log-probs are "
                "fp32 and this release was expected to ask for float32"
            )
        return self

    def div_(self, temperature: Any) -> Fp32LogProbs:
        """OpenRLHF 0.11.1+'s in-place temperature: the one the chunked piece divided by."""
        self.divided_by *= float(temperature)
        self._check(self.divided_by, "the actor's logits divided by")
        return self

    def log_probs(self, labels: Any, temperature: float = 1.0) -> Any:
        """``log_probs_from_logits(logits, labels[, temperature])``."""
        if labels is not self.targets:
            raise UnsupportedLmHeadError(
                "fp32 LM head: OpenRLHF asks for the log-probs of other labels than the rolled sequences the "
                "model call computed them for; this release's Actor.forward is not the one the patch knows"
            )
        self._check(self.divided_by * float(temperature), "log_probs_from_logits' temperature")
        return self.packed[..., 0]

    def entropy(self) -> Any:
        """``compute_entropy(logits)``, at the temperature the logits are divided by at that point."""
        if self.entropy_temperature is None:
            raise UnsupportedLmHeadError(
                "fp32 LM head: OpenRLHF asks for the entropy of a call that did not ask for it (return_entropy)"
            )
        if self.divided_by != self.entropy_temperature:
            raise UnsupportedLmHeadError(
                f"fp32 LM head: OpenRLHF computes the entropy of the logits divided by {self.divided_by}, but the "
                f"patch computed it at {self.entropy_temperature} (its variant for this release is wrong)"
            )
        return self.packed[..., 1]

    def _check(self, temperature: float, what: str) -> None:
        if temperature != self.temperature:
            raise UnsupportedLmHeadError(
                f"fp32 LM head: {what} {temperature}, but the chunked log-probs were computed at the actor's "
                f"temperature {self.temperature}"
            )


def log_probs_fn(stock: Any) -> Any:
    """``log_probs_from_logits`` for a marked actor: the held log-probs, or the stock function on
    real logits (a call that kept them)."""

    def log_probs_from_logits(logits: Any, labels: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(logits, Fp32LogProbs):
            return logits.log_probs(labels, *args, **kwargs)
        return stock(logits, labels, *args, **kwargs)

    return log_probs_from_logits


def entropy_fn(stock: Any) -> Any:
    """``compute_entropy`` for a marked actor: the held entropy, or the stock function on real logits."""

    def compute_entropy(logits: Any) -> Any:
        if isinstance(logits, Fp32LogProbs):
            return logits.entropy()
        return stock(logits)

    return compute_entropy
