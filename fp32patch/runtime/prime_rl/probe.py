"""The inference server's startup probe: every vLLM worker measured, held to Prime-RL's switch.

Prime-RL's worker extension (``prime_rl.inference.vllm.worker``) monkey-patches vLLM's
``LogitsProcessor`` at import, and each ``LogitsProcessor`` reads
``additional_config["fp32_lm_head"]`` when it is built; the patch can be missing in a worker (an
extension class that does not import it), read off there, or fail at the first call (a torch
whose ``torch.mm`` has no ``out_dtype``). The probe runs the model's own ``compute_logits`` in
each worker (``heads.vllm_probe``) and says, beside the dtype, whether Prime-RL's patch is
installed and enabled in that worker."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fp32patch.runtime.kit import probe as kit_probe
from fp32patch.runtime.modes import VLLM_SWITCH
from fp32patch.runtime.prime_rl.config import KEY, STACK

logger = STACK.logger


def worker_report(worker: Any) -> dict[str, Any]:
    """What one vLLM worker computes (``heads.vllm_probe.probe_vllm_model``), and the state of
    Prime-RL's monkey-patch there: ``prime_rl_patch`` (installed on vLLM's ``LogitsProcessor``)
    and ``prime_rl_enabled`` (what the model's logits processor read from additional_config)."""
    from fp32patch.runtime.heads.vllm_probe import probe_vllm_model

    model = worker.model_runner.model
    report = probe_vllm_model(model)
    report["prime_rl_patch"], report["prime_rl_enabled"] = _prime_rl_state(model)
    if report.get("dtype") == "float32" and report.get("way") == "native" and _prime_rl_on(report):
        # the generic probe's reason names vLLM's own head_dtype; here Prime-RL's patch made them
        report["way"] = "prime-rl"
        report["reason"] = (
            "fp32 logits by Prime-RL's own vLLM patch (monkey_patch_fp32_lm_head: bf16 operands, "
            "torch.mm out_dtype float32), on by additional_config fp32_lm_head"
        )
    return report


def _prime_rl_on(report: Mapping[str, Any]) -> bool:
    return bool(report.get("prime_rl_patch")) and report.get("prime_rl_enabled") is True


def _prime_rl_state(model: Any) -> tuple[bool, bool | None]:
    """Whether Prime-RL's monkey-patch is on vLLM's ``LogitsProcessor`` class, and what the
    model's logits processor read from additional_config (None: it read nothing)."""
    from fp32patch.runtime.heads import vllm as vllm_lm_head

    processor = getattr(vllm_lm_head.resolve_heads(model)[0], "logits_processor", None)
    method = getattr(type(processor), "_get_logits", None)
    installed = "monkey_patch_fp32_lm_head" in str(getattr(method, "__qualname__", ""))
    enabled = getattr(processor, "_fp32_lm_head_enabled", None)
    return installed, None if enabled is None else bool(enabled)


async def probe_workers(engine_client: Any, args: Any, *, where: str = "inference server") -> list[Any]:
    """Ask every worker of the engine (``collective_rpc``) and hold them to Prime-RL's switch as
    the server's arguments carry it (``additional_config["fp32_lm_head"]``): all fp32, or none.
    Raises ``Fp32LmHeadMismatchError`` with one line per disagreeing worker."""
    reports = await engine_client.collective_rpc(kit_probe.PROBE_RPC)
    return hold(reports, expected(args), where=where)


def expected(args: Any) -> bool:
    extra = getattr(args, "additional_config", None)
    return bool(isinstance(extra, Mapping) and extra.get("fp32_lm_head"))


def hold(reports: Any, expect_fp32: bool, *, where: str) -> list[Any]:
    """The check itself (also for a caller that gathered the reports another way)."""
    asking = f"{KEY} = {str(expect_fp32).lower()}"
    flat, bad = kit_probe.disagreeing_reports(
        reports, expect_fp32, lambda i, r: _why(i, r, expect_fp32, asking), where=where
    )
    if bad:
        kit_probe.refuse(
            bad,
            header=f"fp32patch ({where}): the vLLM workers' logits do not follow {asking}:",
            footer="The trainer's LM head follows that switch, so it and the rollout would compute different logits. "
            "Fix the worker(s) above.",
        )
    logger.info(
        "fp32patch (%s): %d vLLM worker(s) compute %s logits, as %s asks",
        where,
        len(flat),
        "float32" if expect_fp32 else "stock",
        asking,
    )
    return flat


def _why(index: int, report: Mapping[str, Any], expect_fp32: bool, asking: str) -> str:
    host, pid, dtype = report.get("host", "?"), report.get("pid", "?"), report.get("dtype")
    worker = f"vLLM worker {index} (host {host}, pid {pid})"
    if expect_fp32 and dtype != "float32":
        said = f"{worker} computes {dtype or 'no'} logits while {asking}: "
        if dtype is None:
            return said + (report.get("reason") or "compute_logits failed")
        if not report.get("prime_rl_patch"):
            return said + (
                "Prime-RL's monkey_patch_fp32_lm_head is not installed on vLLM's LogitsProcessor there (its worker "
                "extension, prime_rl.inference.vllm.worker, installs it when imported)"
            )
        if report.get("prime_rl_enabled") is False:
            return said + (
                "Prime-RL's patch is installed but that worker's LogitsProcessor read additional_config['fp32_lm_head'] "
                "as off"
            )
        return said + (
            "Prime-RL's patch is installed and on, but another layer computes the logits (vLLM's LoRA logits "
            f"processor? a model's own compute_logits?): {report.get('model')}"
        )
    return kit_probe.disagreement(index, report, expect_fp32=expect_fp32, asking=asking, switch=VLLM_SWITCH, key=KEY)
