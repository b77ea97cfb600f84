"""SkyRL's ``HFModelWrapper.forward`` at fp32 grade without the [B, T, V] logits.

Stock SkyRL runs the HF model, takes its bf16 logits, divides them by the temperature in place
(``logits_BSV.div_(temperature)``) and computes the log-probs of the rolled sequences
(``logprobs_from_logits``) and, where asked, the entropy (``chunked_entropy_from_logits``, zeroed
where the attention mask is 0). For a wrapper the switch marked (``mark``), the patched
``forward`` calls the model through ``model_call`` instead: within that call the head's forward
(``heads.hf``'s, which the wiring put on it) hands its input and weight to
``kernels.chunked_logprobs``, which computes the log-probs of the rolled sequences, and the
entropy where asked, from the bf16 operands vLLM computes with, with fp32 products, the
temperature dividing the fp32 logits, one tile at a time. FSDP2 has gathered the head's weight
for that call, and gathers it again for the backward of what the call returns, as for the stock
head. Under Ulysses sequence parallelism each rank computes its own slice, as the stock code does.

The model's output then holds, where SkyRL keeps its logits, ``HeldLogProbs``: what the rest of
the stock ``forward`` does with the logits it does with that object, which checks each step
against what was computed: ``.div_(temperature)`` (the temperature the chunked piece divided
by), ``logprobs_from_logits`` (the rolled sequences it was computed for) and the entropy
function (its ``requires_grad`` and attention mask applied as SkyRL applies them). Anything
else is refused, never guessed at.

A call that needs the logits themselves (sample-support replay scores every candidate of the
rollout's support) runs the model as it is: the head then gives full fp32 logits (``heads.hf``).

Nothing here imports torch at import time.
"""

from __future__ import annotations

import weakref
from typing import Any

from fp32patch.runtime.heads.hf import UnsupportedLmHeadError
from fp32patch.runtime.skyrl.config import KEY

# The attributes the switch sets on an ``HFModelWrapper`` instance: the trainer's mode (read by the
# patched file, skyrl_gate.py, without importing fp32patch) and its head (weakly).
MARK = "_fp32patch_lm_head"
HEAD = "_fp32patch_head"
SOFTCAP = "_fp32patch_softcap"  # the HF model's final soft-cap (None: none), read where the model is known
TURN_OFF = f"set {KEY}=false"


def mark(wrapper: Any, model: Any, mode: str, *, role: str) -> Any:
    """Route ``wrapper``'s log-probs through fp32patch's chunked piece in ``mode``; ``model`` is the
    HF model whose head ``heads.hf`` converted. Refuses a head the chunked piece cannot compute
    (a bias); a model's final soft-cap is computed on the fp32 logits. Returns ``wrapper``."""
    from fp32patch.runtime.heads.hf import chunkable_head, final_softcap

    head, _ = chunkable_head(model, role=role, turn_off=TURN_OFF)
    # plain attributes: a module here would become a submodule of the wrapper (and of its state dict)
    object.__setattr__(wrapper, MARK, mode)
    object.__setattr__(wrapper, HEAD, weakref.ref(head))
    object.__setattr__(wrapper, SOFTCAP, final_softcap(model))
    return wrapper


def model_call(wrapper: Any, targets: Any, temperature: float, log_probs: bool, entropy: bool) -> Any:
    """What the patched ``forward`` calls in place of ``self.model``: the model itself where the
    caller needs the logits (``log_probs`` false), else ``ChunkedCall``."""
    if not log_probs:
        return wrapper.model
    head = getattr(wrapper, HEAD)()
    if head is None:
        raise UnsupportedLmHeadError("fp32 LM head: the wrapper's head is gone (the model was replaced after wiring)")
    return ChunkedCall(wrapper, head, targets, float(temperature), entropy)


class ChunkedCall:
    """Runs the wrapper's model with the head computing the chunked log-probs of ``targets`` (and
    the entropy) instead of its logits; returns the model's output with ``HeldLogProbs`` as its
    logits. Any attribute read goes to the model (``self.model.config`` in the VLM branch)."""

    def __init__(self, wrapper: Any, head: Any, targets: Any, temperature: float, entropy: bool) -> None:
        self._wrapper, self._head, self._targets = wrapper, head, targets
        self._mode = getattr(wrapper, MARK)
        self._temperature, self._entropy = temperature, entropy
        self._softcap = getattr(wrapper, SOFTCAP, None)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapper.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from fp32patch.runtime.heads.hf import call_computing_log_probs

        output, packed = call_computing_log_probs(
            self._wrapper.model, self._head, self._compute, args, kwargs, softcap=self._softcap, turn_off=TURN_OFF
        )
        output["logits"] = HeldLogProbs(packed, self._targets, self._temperature, self._entropy)
        return output

    def _compute(self, hidden: Any, weight: Any) -> Any:
        """In the head's call: [..., 1] log-probs, or [..., 2] log-probs and entropy, fp32 (of the
        capped logits where the model caps them)."""
        import torch

        from fp32patch.runtime.kernels.chunked_logprobs import chunked_logprobs

        if tuple(hidden.shape[:-1]) != tuple(self._targets.shape):
            raise UnsupportedLmHeadError(
                f"fp32 LM head: the head got hidden states {tuple(hidden.shape)} for targets "
                f"{tuple(self._targets.shape)}; fp32patch's chunked log-probs need one target per position"
            )
        targets = self._targets.to(hidden.device)
        out = chunked_logprobs(
            hidden, weight, targets, mode=self._mode, temperature=self._temperature, entropy=self._entropy,
            softcap=self._softcap,
        )  # fmt: skip
        return torch.stack(list(out) if self._entropy else [out], dim=-1)


class HeldLogProbs:
    """Stands where SkyRL's wrapper keeps its logits, holding fp32patch's log-probs (and entropy)
    of the targets the call was given; each use checks that it is the one computed."""

    def __init__(self, packed: Any, targets: Any, temperature: float, entropy: bool) -> None:
        self.packed, self.targets = packed, targets
        self.temperature, self.has_entropy = temperature, entropy
        self.divided_by = 1.0

    @property
    def dtype(self) -> Any:
        return self.packed.dtype

    def __repr__(self) -> str:
        return f"HeldLogProbs(shape={tuple(self.packed.shape[:-1])}, temperature={self.temperature})"

    def div_(self, temperature: Any) -> HeldLogProbs:
        """SkyRL's in-place temperature: the one the chunked piece divided by."""
        self.divided_by *= float(temperature)
        if self.divided_by != self.temperature:
            raise UnsupportedLmHeadError(
                f"fp32 LM head: the wrapper's logits divided by {self.divided_by}, but the chunked log-probs were "
                f"computed at temperature {self.temperature}"
            )
        return self

    def _check_divided(self, what: str) -> None:
        if self.divided_by != self.temperature:
            raise UnsupportedLmHeadError(
                f"fp32 LM head: SkyRL asks for {what} of logits divided by {self.divided_by}, but the chunked piece "
                f"divided them by {self.temperature} (this release's forward is not the one the patch knows)"
            )

    def log_probs(self, labels: Any) -> Any:
        """``logprobs_from_logits(logits, labels, inplace_backward=...)``."""
        if labels is not self.targets:
            raise UnsupportedLmHeadError(
                "fp32 LM head: SkyRL asks for the log-probs of other labels than the rolled sequences the model "
                "call computed them for; this release's HFModelWrapper.forward is not the one the patch knows"
            )
        self._check_divided("the log-probs")
        return self.packed[..., 0]

    def entropy(self, requires_grad: bool = False, attention_mask: Any = None) -> Any:
        """``chunked_entropy_from_logits(logits, requires_grad=, attention_mask=, chunk_size=)``: the
        entropy, detached unless asked for its gradient, 0 where the mask is 0."""
        if not self.has_entropy:
            raise UnsupportedLmHeadError(
                "fp32 LM head: SkyRL asks for the entropy of a call that did not ask for it (compute_entropy)"
            )
        self._check_divided("the entropy")
        ent = self.packed[..., 1]
        if not requires_grad:
            ent = ent.detach()
        if attention_mask is not None:
            ent = ent * attention_mask
        return ent


def log_probs_fn(stock: Any) -> Any:
    """``logprobs_from_logits`` for a marked wrapper: the held log-probs, or the stock function on
    real logits (a call that kept them)."""

    def logprobs_from_logits(logits: Any, labels: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(logits, HeldLogProbs):
            return logits.log_probs(labels)
        return stock(logits, labels, *args, **kwargs)

    return logprobs_from_logits


def entropy_fn(stock: Any) -> Any:
    """The wrapper's entropy function for a marked wrapper: the held entropy, or the stock function
    on real logits."""

    def chunked_entropy_from_logits(logits: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(logits, HeldLogProbs):
            kwargs.pop("chunk_size", None)
            return logits.entropy(*args, **kwargs)
        return stock(logits, *args, **kwargs)

    return chunked_entropy_from_logits
