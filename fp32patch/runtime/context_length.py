"""Context overflow: the marker NeMo-Gym looks for, the message, and the predicate.

NeMo-Gym's vLLM proxy ends a rollout cleanly (an empty completion with
``finish_reason="length"``) only when the endpoint answers HTTP 400 and the raw body
contains ``"context length"`` (or ``"max_tokens"``). Any other failure is retried and a
rollout that cannot fit burns its whole retry budget. So an overflowing prompt must
surface as a 400 whose message carries the marker, and nothing else may.

Every overflow message this module knows says ``"maximum context length"``: vLLM's
renderer ("This model's maximum context length is N tokens. However, your prompt
contains ..."), vLLM's serving layer ("Input length (N) exceeds model's maximum context
length (M)."), and the clamp message below. That phrase, not the bare marker, decides the
predicate, because vLLM also raises ``ValueError``s that merely mention a context length
("N-gram embedding requires context length >= 1.") and those are server bugs.

The patched NeMo-RL file carries its own copy of ``context_length_message`` and of the
phrase (it must run where fp32patch is not installed); the tests pin the copies to
these definitions.
"""

from __future__ import annotations

CONTEXT_LENGTH_MARKER = "context length"
# What every overflow message says; it contains the marker, so a body built from an
# overflow message always satisfies NeMo-Gym.
OVERFLOW_PHRASE = "maximum " + CONTEXT_LENGTH_MARKER


def context_length_message(prompt_tokens: int, max_model_len: int) -> str:
    """The error for a prompt that leaves no room for output tokens."""
    return (
        f"This model's {OVERFLOW_PHRASE} is {max_model_len} tokens and the prompt "
        f"alone has {prompt_tokens}: no room is left for output tokens."
    )


def is_context_length_overflow(exc: BaseException) -> bool:
    """Whether ``exc`` reports a prompt that does not fit the model's context.

    The type is the caller's business (NeMo-RL's route asks for ``ValueError``s; vLLM's
    ``VLLMValidationError`` is a ``ValueError`` in some releases and not in others), so
    only the message counts. Case-sensitive, as NeMo-Gym's own check is.
    """
    return OVERFLOW_PHRASE in str(exc)
