"""The patched engine with the switch off: vLLM's own logits, bit for bit, through every refit;
and the stacks' startup probes, asked through their RPCs, refuse it naming the worker.

One engine for the module: patched, ``NRL_VLLM_FP32_LM_HEAD`` unset, a dummy load. Every check
refits it and compares its logprobs with the pristine engine's (the unpatched vLLM, the real
weights loaded directly).
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from fp32patch.runtime.nemo_rl import PROBE_RPC, Fp32LmHeadMismatchError, check_probe_reports
from fp32patch.runtime.verl import probe_server
from tests.heavy.vllm_engine import harness
from tests.heavy.vllm_engine.conftest import VAR, engine

pytestmark = pytest.mark.xdist_group("engine-off")

NEMO_RL_KEY = "policy.megatron_cfg.fp32_lm_head"
VERL_WHERE = "vLLM rollout server"


@pytest.fixture(scope="module")
def llm(model_dir, plugin_dir):
    with engine(model_dir, plugin_dir, None, load_format="dummy") as llm:
        assert llm.collective_rpc(harness.on_worker_gemms) == [[]]
        yield llm


@pytest.fixture
def refit(llm, model_dir):
    """Load the real weights through the model's own load_weights; what the generations become."""

    def to(path=None, **kw):
        llm.collective_rpc(
            harness.on_worker_load_weights, args=(str(path or model_dir / "model.safetensors"),), kwargs=kw
        )
        return harness.generate(llm)

    return to


def test_the_switch_is_off_in_the_worker_and_the_logits_stay_bf16(llm, refit):
    assert llm.collective_rpc(harness.on_worker_environ, args=(VAR,)) == [None]
    llm.collective_rpc(harness.on_worker_capture)
    refit()
    (captured,) = llm.collective_rpc(harness.on_worker_captured_logits)
    assert captured["dtypes"] == ["bfloat16"] and captured["calls"] >= harness.NEW_TOKENS
    assert captured["pid"] != os.getpid()  # the worker is another process
    assert captured["rel_err"] > 1e-4  # bf16's own rounding, which fp32 would take away


def test_a_dummy_load_then_a_refit_through_load_weights_is_the_pristine_engine_bit_for_bit(refit, pristine):
    assert refit() == pristine


def test_a_refit_by_name_through_collective_rpc_is_the_pristine_engine(llm, model_dir, other_weights, pristine):
    llm.collective_rpc(harness.on_worker_load_weights, args=(str(other_weights),))
    blob = (model_dir / "model.safetensors").read_bytes()
    assert llm.collective_rpc("fp32patch_test_update_weights", args=(blob,)) == [len(harness.qwen2_weights(0))]
    assert harness.generate(llm) == pristine


def test_several_refits_in_a_row(refit, other_weights, pristine):
    for _ in range(2):
        assert refit(other_weights) != pristine
        assert refit() == pristine


def test_a_partial_refit_that_skips_the_head_keeps_the_head(refit, other_weights, pristine):
    """vLLM's load_weights takes any subset of the checkpoint: the body of other weights under
    the real head, then the real body back, without the head ever being sent again."""
    refit()
    assert refit(other_weights, skip=("lm_head.weight",)) != pristine
    assert refit(skip=("lm_head.weight",)) == pristine


def test_nemo_rl_probe_refuses_the_engine_naming_the_worker(llm, refit):
    refit()
    reports = llm.collective_rpc(PROBE_RPC, args=tuple())  # NeMo-RL's generation worker's call
    (report,) = reports
    assert (report["dtype"], report["way"], report["env"], report["patched"]) == ("bfloat16", "off", None, True)
    assert report["pid"] != os.getpid() and report["host"] == socket.gethostname()
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        check_probe_reports([reports], "fp32out")
    assert (
        f"vLLM worker 0 (host {report['host']}, pid {report['pid']}) computes bfloat16 logits while "
        f"{NEMO_RL_KEY}='fp32out': {VAR} is unset in that process"
    ) in str(caught.value)
    check_probe_reports([reports], None)  # both off: agreed


def test_verl_probe_refuses_the_engine_naming_the_worker(llm, refit):
    refit()
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        asyncio.run(probe_server(llm, {"fp32_lm_head": "fp32out"}, where=VERL_WHERE))
    (report,) = llm.collective_rpc(PROBE_RPC)
    assert str(caught.value).startswith(f"fp32patch ({VERL_WHERE}): the rollout's logits do not follow")
    assert (
        f"vLLM worker 0 (host {report['host']}, pid {report['pid']}) computes bfloat16 logits: {VAR} is None"
    ) in str(caught.value)
    asyncio.run(probe_server(llm, {"fp32_lm_head": False}, where=VERL_WHERE))  # both off: agreed


def test_a_refit_that_writes_the_head_in_place_is_the_pristine_engine(llm, refit, model_dir, other_weights, pristine):
    refit(other_weights)
    refit(skip=("lm_head.weight",))
    head = ("lm_head.weight",)
    real = str(model_dir / "model.safetensors")
    assert llm.collective_rpc(harness.on_worker_copy_in_place, args=(real, head)) == [list(head)]
    assert harness.generate(llm) == pristine
