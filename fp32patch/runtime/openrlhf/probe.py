"""OpenRLHF's driver holds every vLLM engine's LM heads to ``--fp32_lm_head`` before the first rollout.

Each engine is a Ray actor (``RolloutRayActor``; ``LLMRayActor`` up to 0.10.1.post2) whose vLLM
workers carry OpenRLHF's ``WorkerWrap``; the patch gives both a method named ``kit.probe.PROBE_RPC``:
the engine's asks its workers through vLLM's ``collective_rpc``, the worker's measures its model
(``heads.vllm_probe.probe_vllm_model``). The driver asks every engine once they are built (before
sleep mode can release their weights) and refuses a worker whose logits are not float32 (vLLM's
``head_dtype`` falls back to bf16 on a platform it does not support with only a warning), naming
the engine and the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fp32patch.runtime.kit import rollout
from fp32patch.runtime.kit.probe import PROBE_RPC, disagreement, fell_back, hold_units
from fp32patch.runtime.modes import VLLM_SWITCH
from fp32patch.runtime.openrlhf.config import KEY, STACK
from fp32patch.runtime.openrlhf.wiring import rollout_mode

WHERE_SET = f" (fp32patch sets it in the engine's Ray runtime_env from {KEY} for vLLM before 0.26)"


def worker_report(worker: Any) -> dict[str, Any]:
    """In a vLLM worker (``WorkerWrap``): the probe's report on its model."""
    from fp32patch.runtime.heads.vllm_probe import probe_vllm_model

    return probe_vllm_model(worker.model_runner.model)


def probe_engines(engines: Any, *, where: str = "vLLM engines", get: Any = None) -> list[list[Any]]:
    """Ask every engine's workers (``engine.<PROBE_RPC>.remote()``) and hold them to the driver's
    flag; ``get`` resolves the Ray references (default ``ray.get``). Returns each engine's reports."""
    mode = rollout_mode()
    if mode is None or not engines:
        return []
    if get is None:
        import ray

        get = ray.get
    answers = get([getattr(engine, PROBE_RPC).remote() for engine in engines])
    route = rollout.vllm_route(rollout.installed_vllm_version())
    return check_engines(answers, mode, where=where, route=route)


def check_engines(answers: Any, mode: str | None, *, where: str, route: str = "variable") -> list[list[Any]]:
    """Every engine's workers float32 where the flag is on (``mode``), none where it is off; else
    refuse with one line per disagreeing worker, naming its engine. ``route``: how the engines were
    asked (``kit.rollout.vllm_route``), for the reason a worker gives. Logs one line when all agree."""
    asking = f"{KEY}={mode!r}" if mode is not None else f"{KEY} is off"

    def why(label: str, index: int, report: Mapping[str, Any]) -> str:
        if mode is not None and route == "head_dtype":
            return f"{label}: {fell_back(index, report, asking, 'engine')}"
        line = disagreement(
            index, report, expect_fp32=mode is not None, asking=asking, switch=VLLM_SWITCH, key=KEY, hint=WHERE_SET
        )
        return f"{label}: {line}"

    units = [(f"vLLM engine {engine}", f"engine {engine}", reports) for engine, reports in enumerate(answers)]
    return hold_units(units, mode, why, where=where, asking=asking, unit="engine", logger=STACK.logger)
