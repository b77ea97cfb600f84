"""fp32patch.runtime.context_length: the marker, the message and the overflow predicate."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fp32patch.runtime.context_length import (
    CONTEXT_LENGTH_MARKER,
    context_length_message,
    is_context_length_overflow,
)
from tests.nemo_rl_harness import (
    NEMO_GYM_LENGTH_RULE,
    renderer_overflow_message,
    serving_overflow_message,
)


class _ValidationError(Exception):
    """Like vLLM 0.33's VLLMValidationError: a client error that is not a ValueError."""


OVERFLOWS = [
    pytest.param(ValueError(context_length_message(4096, 4096)), id="clamp"),
    pytest.param(ValueError(context_length_message(5000, 4096)), id="clamp-over"),
    pytest.param(_ValidationError(renderer_overflow_message(4096, 5000)), id="online-renderer"),
    pytest.param(ValueError(serving_overflow_message(4096, 5000)), id="vllm-serving"),
]
OTHER_ERRORS = [
    # the clamp's message before the patch: an overflow nobody downstream can recognise
    pytest.param(
        ValueError("A 4096-token prompt leaves no output room under max_model_len 4096."),
        id="old-clamp-wording",
    ),
    # mentions a context length, reports no overflow (vLLM raises this one for a model bug)
    pytest.param(
        ValueError("N-gram embedding requires context length >= 1."),
        id="context-length-not-overflow",
    ),
    pytest.param(
        ValueError("`top_logprobs` must be set when requesting token information."),
        id="top-logprobs",
    ),
    pytest.param(ValueError("temperature must be non-negative, got -1.0."), id="temperature"),
    pytest.param(ValueError(), id="empty"),
    pytest.param(ValueError("Maximum Context Length exceeded"), id="other-case"),
]


def test_marker_is_what_nemo_gym_looks_for():
    assert CONTEXT_LENGTH_MARKER == "context length"
    assert CONTEXT_LENGTH_MARKER in NEMO_GYM_LENGTH_RULE.substrings


@pytest.mark.parametrize(("prompt", "limit"), [(4096, 4096), (131073, 131072), (1, 0)])
def test_message_names_the_lengths_and_carries_the_marker(prompt, limit):
    message = context_length_message(prompt, limit)
    assert CONTEXT_LENGTH_MARKER in message
    assert "maximum context length" in message
    assert f" {limit} tokens " in message and f" has {prompt}:" in message
    # as the route returns it: a 400 whose JSON body NeMo-Gym reads as finish_reason="length"
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": 400}})
    assert NEMO_GYM_LENGTH_RULE.ends_rollout_cleanly(400, body.encode())


@pytest.mark.parametrize("exc", OVERFLOWS)
def test_overflows_are_recognised(exc):
    assert is_context_length_overflow(exc)


@pytest.mark.parametrize("exc", OTHER_ERRORS)
def test_other_value_errors_are_not(exc):
    assert not is_context_length_overflow(exc)


def test_runtime_imports_neither_torch_nor_vllm():
    code = (
        "import sys, fp32patch.runtime.context_length;"
        "print(sorted(m for m in ('torch', 'vllm', 'fp32patch.patcher') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
