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
from fp32patch.runtime.kit.probe import PROBE_RPC, disagreeing_reports, disagreement, refuse
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
    bad_all, flat_all = [], []
    for engine, reports in enumerate(answers):

        def why(index: int, report: Mapping[str, Any], engine: int = engine) -> str:
            if mode is not None and route == "head_dtype":
                return f"vLLM engine {engine}: {_fell_back(index, report, asking)}"
            line = disagreement(
                index, report, expect_fp32=mode is not None, asking=asking, switch=VLLM_SWITCH, key=KEY, hint=WHERE_SET
            )
            return f"vLLM engine {engine}: {line}"

        flat, bad = disagreeing_reports(reports, mode is not None, why, where=f"{where}, engine {engine}")
        bad_all += [
            (i, r, reason if reason.startswith("vLLM engine") else f"vLLM engine {engine}: {reason}")
            for i, r, reason in bad
        ]
        flat_all.append(flat)
    if bad_all:
        refuse(
            bad_all,
            header=f"fp32patch ({where}): the rollout's logits do not follow {asking}:",
            footer="The trainer and the rollout would compute different logits. Fix the engine(s) above.",
        )
    ways = ", ".join(sorted({str(r.get("way")) for flat in flat_all for r in flat}))
    STACK.logger.info(
        "fp32patch (%s): %d vLLM engine(s), %d worker(s), compute %s logits (way: %s), as %s",
        where,
        len(flat_all),
        sum(len(flat) for flat in flat_all),
        "float32" if mode is not None else "stock",
        ways,
        asking,
    )
    return flat_all


def _fell_back(index: int, report: Mapping[str, Any], asking: str) -> str:
    """Why a worker asked for vLLM's own ``head_dtype`` float32 computes other logits."""
    worker = f"vLLM worker {index} (host {report.get('host', '?')}, pid {report.get('pid', '?')})"
    return (
        f"{worker} computes {report.get('dtype')} logits while {asking} asked vLLM for head_dtype float32 "
        "(hf_overrides): vLLM fell back to the model's dtype (a platform without fp32 support, or a quantized "
        f"head: see the engine's log); the way is {report.get('way')}: {report.get('reason') or '-'}"
    )
