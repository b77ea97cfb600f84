"""vLLM 0.33's own overflow errors, raised by vLLM itself, against the runtime predicate.

The main suite's doubles word vLLM's overflow messages by hand; here the real ones are
raised (the renderer's length check and the serving layer's get_max_tokens) and must be
recognised, carry NeMo-Gym's marker, and keep the doubles honest.
"""

from __future__ import annotations

import json

import pytest

from fp32patch.runtime.context_length import is_context_length_overflow
from tests.nemo_rl_harness import (
    NEMO_GYM_LENGTH_RULE,
    renderer_overflow_message,
    serving_overflow_message,
)

MAX_MODEL_LEN, PROMPT = 8, 9


def _renderer_error() -> BaseException:
    from vllm.renderers.params import TokenizeParams

    params = TokenizeParams(max_total_tokens=MAX_MODEL_LEN)
    with pytest.raises(Exception) as info:
        params.apply_post_tokenization(None, {"prompt_token_ids": list(range(PROMPT))})
    return info.value


def _serving_error() -> BaseException:
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    with pytest.raises(ValueError) as info:
        get_max_tokens(MAX_MODEL_LEN, None, PROMPT, {})
    return info.value


@pytest.mark.parametrize("raise_it", [_renderer_error, _serving_error], ids=["renderer", "serving"])
def test_vllm_overflow_is_recognised_and_reads_as_length(raise_it):
    exc = raise_it()
    assert is_context_length_overflow(exc)
    # the body NeMo-RL's route builds from it
    body = json.dumps({"error": {"message": str(exc), "type": "invalid_request_error", "code": 400}})
    assert NEMO_GYM_LENGTH_RULE.ends_rollout_cleanly(400, body.encode())


def test_renderer_error_reaches_the_validation_handler():
    # The route needs both handlers: the renderer's overflow is a VLLMValidationError (a
    # ValueError subclass up to vLLM 0.25, no longer one in 0.33, so an `except ValueError`
    # alone would miss it there); the clamp and the serving layer raise plain ValueErrors.
    from vllm.exceptions import VLLMValidationError

    exc = _renderer_error()
    assert isinstance(exc, VLLMValidationError)
    assert isinstance(_serving_error(), ValueError) and not isinstance(_serving_error(), VLLMValidationError)


def test_doubles_word_the_overflows_as_vllm_does():
    real = str(_renderer_error())
    first_sentence = renderer_overflow_message(MAX_MODEL_LEN, PROMPT).split(". ")[0]
    assert real.startswith(first_sentence + ". ")
    assert str(_serving_error()) == serving_overflow_message(MAX_MODEL_LEN, PROMPT)
