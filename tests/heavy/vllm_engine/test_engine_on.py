"""The patched engine with the switch on: fp32 logits in the worker, right after every refit;
and the stacks' startup probes, asked through their RPCs, accept it.

One engine for the module: patched, ``NRL_VLLM_FP32_LM_HEAD=1`` (vLLM 0.25 on the CPU: the
runtime's ``copy`` way, an fp32 copy of the head that every refit must invalidate; 0.26 on:
vLLM's own ``head_dtype``), a dummy load. The reference is the OpenAI server of this suite,
started patched, on, with the real weights loaded: a refit of this engine must give its
logprobs bit for bit.
"""

from __future__ import annotations

import asyncio
import os

import pytest
from packaging.version import Version

from fp32patch.runtime.nemo_rl import PROBE_RPC, check_probe_reports
from fp32patch.runtime.verl import probe_server
from tests.heavy.vllm_engine import harness
from tests.heavy.vllm_engine.conftest import VAR, engine, vllm_version

pytestmark = pytest.mark.xdist_group("engine-on")


@pytest.fixture(scope="module")
def llm(model_dir, plugin_dir):
    with engine(model_dir, plugin_dir, "1", load_format="dummy") as llm:
        assert llm.collective_rpc(harness.on_worker_gemms) == [[]]
        yield llm


@pytest.fixture(scope="module")
def served(server_on) -> list[dict]:
    """The server's generations of the suite's prompts (patched, on, the real weights loaded)."""
    out = []
    for prompt in harness.PROMPTS:
        response = harness.completion(server_on, prompt)
        assert response.status_code == 200, response.text
        generation = harness.as_generation(response)
        del generation["token_logprobs"]
        out.append(generation)
    return out


def expected_way() -> str:
    # vLLM's own head_dtype from 0.26; before it, no out_dtype GEMM on the CPU: the copy
    return "native" if vllm_version() >= Version("0.26") else "copy"


def refit_by_load_weights(llm, path, **kw) -> list[dict]:
    llm.collective_rpc(harness.on_worker_load_weights, args=(str(path),), kwargs=kw)
    return harness.generate(llm)


def fp32_after(llm, step) -> dict:
    """``step()`` with the worker's logits recorded; they must be fp32 within 1e-5 of float64
    of the same hidden states and the live head."""
    llm.collective_rpc(harness.on_worker_capture)
    result = step()
    (captured,) = llm.collective_rpc(harness.on_worker_captured_logits)
    assert captured["dtypes"] == ["float32"] and captured["calls"] >= harness.NEW_TOKENS, captured
    assert captured["rel_err"] < 1e-5, captured
    assert captured["pid"] != os.getpid()
    return result


def test_the_switch_reaches_the_worker(llm):
    assert llm.collective_rpc(harness.on_worker_environ, args=(VAR,)) == ["1"]


def test_a_dummy_load_then_a_refit_through_load_weights_is_the_real_load(llm, model_dir, served):
    assert fp32_after(llm, lambda: refit_by_load_weights(llm, model_dir / "model.safetensors")) == served


def test_a_refit_by_name_through_collective_rpc_is_the_real_load(llm, model_dir, other_weights, served):
    refit_by_load_weights(llm, other_weights)
    blob = (model_dir / "model.safetensors").read_bytes()
    assert llm.collective_rpc("fp32patch_test_update_weights", args=(blob,)) == [len(harness.qwen2_weights(0))]
    assert fp32_after(llm, lambda: harness.generate(llm)) == served


def test_several_refits_in_a_row(llm, model_dir, other_weights, served):
    for _ in range(2):
        assert fp32_after(llm, lambda: refit_by_load_weights(llm, other_weights)) != served
        assert fp32_after(llm, lambda: refit_by_load_weights(llm, model_dir / "model.safetensors")) == served


def test_a_partial_refit_that_skips_the_head(llm, model_dir, other_weights, served):
    """vLLM's load_weights takes any subset of the checkpoint. The body alone, under the head
    already loaded; then the head alone, whose fp32 copy (the copy way) must follow it."""
    real = model_dir / "model.safetensors"
    refit_by_load_weights(llm, real)
    assert fp32_after(llm, lambda: refit_by_load_weights(llm, other_weights, skip=("lm_head.weight",))) != served
    assert fp32_after(llm, lambda: refit_by_load_weights(llm, real, skip=("lm_head.weight",))) == served
    assert fp32_after(llm, lambda: refit_by_load_weights(llm, other_weights, only=("lm_head.weight",))) != served
    assert fp32_after(llm, lambda: refit_by_load_weights(llm, real, only=("lm_head.weight",))) == served


def test_a_refit_that_writes_the_head_in_place_without_load_weights(llm, model_dir, other_weights, served):
    """Some weight syncs copy into the parameters and never call load_weights: the copy way
    must see the head's new values (its storage version and a sample of it) all the same."""
    real = model_dir / "model.safetensors"
    refit_by_load_weights(llm, other_weights)
    refit_by_load_weights(llm, real, skip=("lm_head.weight",))
    fp32_after(llm, lambda: harness.generate(llm))  # the head of the other weights, in use
    head = ("lm_head.weight",)
    assert llm.collective_rpc(harness.on_worker_copy_in_place, args=(str(real), head)) == [list(head)]
    assert fp32_after(llm, lambda: harness.generate(llm)) == served


def test_nemo_rl_probe_accepts_the_engine(llm, model_dir, caplog):
    refit_by_load_weights(llm, model_dir / "model.safetensors")
    reports = llm.collective_rpc(PROBE_RPC, args=tuple())  # NeMo-RL's generation worker's call
    (report,) = reports
    assert (report["dtype"], report["way"], report["env"]) == ("float32", expected_way(), "1")
    assert report["pid"] != os.getpid() and report["model"] == "Qwen2ForCausalLM"
    with caplog.at_level("INFO", logger="nemo_rl.fp32patch"):
        check_probe_reports([reports], "fp32out")
    assert f"1 vLLM worker(s) compute float32 logits (way: {expected_way()})" in caplog.text


def test_verl_probe_accepts_the_engine(llm, model_dir, caplog):
    refit_by_load_weights(llm, model_dir / "model.safetensors")
    with caplog.at_level("INFO", logger="verl.fp32patch"):
        (report,) = asyncio.run(probe_server(llm, {"fp32_lm_head": "fp32out"}, where="vLLM rollout server"))
    assert (report["dtype"], report["way"]) == ("float32", expected_way())
    assert f"1 vLLM worker(s) compute float32 logits (way: {expected_way()})" in caplog.text
