"""verl's rollout: one key reaches every vLLM worker process, and the server's probe holds them to it.

verl (0.7.1 on) starts vLLM in a rollout server (a Ray actor per node) with vLLM's ``mp``
executor, whose worker processes inherit the server's environment. The patched server calls
``fp32patch.runtime.verl.set_vllm_env(model_config)`` in its ``__init__``, before any engine
exists, and ``probe_server`` once the model is loaded. Here this test process plays the server:
it calls the same function with a verl-shaped model config, then spawns two tensor-parallel
workers that set nothing themselves (they inherit, as vLLM's do), load a real vLLM model from
the patched import root and run the probe's measurement; the server then checks their reports
as ``probe_server`` does.
"""

from __future__ import annotations

import logging
import os
from importlib.metadata import version

import pytest
import torch
from packaging.version import Version

from fp32patch.runtime.fp32out import out_dtype_supported
from fp32patch.runtime.verl import (
    Fp32LmHeadConfigError,
    Fp32LmHeadMismatchError,
    check_reports,
    set_vllm_env,
)
from tests.heavy.vllm.conftest import PATCHED_ROOT
from tests.heavy.vllm.rollout_worker import worker
from tests.support.rendezvous import file_store

VAR = "NRL_VLLM_FP32_LM_HEAD"
WHERE = "vLLM rollout server"


@pytest.fixture
def server_env(monkeypatch):
    """This process's environment, as a fresh rollout server's: the variable unset; restored after."""
    monkeypatch.setenv(VAR, "placeholder")
    monkeypatch.delenv(VAR)
    return monkeypatch


def _spawn_workers(drop_var: bool = False) -> list[dict]:
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    with file_store() as init_method:
        mp.spawn(worker, args=(2, init_method, str(PATCHED_ROOT), drop_var, results), nprocs=2, join=True)
    return [dict(results[rank]) for rank in range(2)]


@pytest.mark.parametrize("mode", ["fp32out", True])
def test_the_key_reaches_every_worker_and_the_probe_passes(server_env, caplog, mode):
    model_config = {"fp32_lm_head": mode}  # actor_rollout_ref.model, as the server is handed it
    assert set_vllm_env(model_config, where=WHERE) == "1"
    assert os.environ[VAR] == "1"
    reports = _spawn_workers()
    # "1" is the best way there is: vLLM's own head_dtype from 0.26 (outside every verl release's
    # pin, tested all the same), before it fp32out where torch has the out_dtype kernel (CUDA), else copy
    if Version(version("vllm")) >= Version("0.26"):
        way = "native"
    else:
        way = "fp32out" if out_dtype_supported(torch.device("cpu"), torch.bfloat16) else "copy"
    assert [(r["dtype"], r["way"], r["env"]) for r in reports] == [("float32", way, "1")] * 2
    assert len({r["pid"] for r in reports} | {os.getpid()}) == 3
    with caplog.at_level(logging.INFO, logger="verl.fp32patch"):
        check_reports([reports], model_config, where=WHERE)  # one engine's collective_rpc result
    assert f"2 vLLM worker(s) compute float32 logits (way: {way})" in caplog.text


def test_the_key_off_leaves_the_workers_stock(server_env):
    model_config = {"fp32_lm_head": False}
    assert set_vllm_env(model_config, where=WHERE) is None and VAR not in os.environ
    reports = _spawn_workers()
    assert [(r["dtype"], r["way"]) for r in reports] == [("bfloat16", "off")] * 2
    check_reports(reports, model_config, where=WHERE)


def test_a_worker_without_the_variable_stops_the_server(server_env):
    model_config = {"fp32_lm_head": "fp32out"}
    set_vllm_env(model_config, where=WHERE)
    reports = _spawn_workers(drop_var=True)
    assert [r["dtype"] for r in reports] == ["bfloat16", "bfloat16"]
    with pytest.raises(Fp32LmHeadMismatchError) as info:
        check_reports(reports, model_config, where=WHERE)
    message = str(info.value)
    assert message.startswith(f"fp32patch ({WHERE}): the rollout's logits do not follow")
    for index, r in enumerate(reports):
        assert (
            f"vLLM worker {index} (host {r['host']}, pid {r['pid']}) computes bfloat16 logits while "
            f"actor_rollout_ref.model.fp32_lm_head='fp32out': {VAR} is unset in that process"
        ) in message


def test_the_variable_alone_is_refused_before_any_worker_starts(server_env):
    server_env.setenv(VAR, "1")
    with pytest.raises(Fp32LmHeadConfigError, match="would compute fp32 logits and the trainer bf16 ones"):
        set_vllm_env({"fp32_lm_head": False}, where=WHERE)
    server_env.setenv(VAR, "0")
    with pytest.raises(Fp32LmHeadConfigError, match="the two disagree"):
        set_vllm_env({"fp32_lm_head": "fp32out"}, where=WHERE)
