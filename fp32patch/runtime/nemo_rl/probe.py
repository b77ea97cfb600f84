"""NeMo-RL's driver holds the vLLM workers' probe reports to its config.

``check_probe_reports(reports, settings, where=...)`` refuses to go on when a vLLM worker's
logits disagree with the trainer's fp32 LM-head setting, naming the worker and the reason,
and logs one INFO line when all agree. The reports come from
``fp32patch.runtime.heads.vllm_probe.probe_vllm_model``, run in each worker through NeMo-RL's
collective_rpc under the name ``PROBE_RPC``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.probe import PROBE_RPC, disagreeing_reports, disagreement, refuse
from fp32patch.runtime.modes import VLLM_ENV_VAR, trainer_mode
from fp32patch.runtime.nemo_rl.config import (
    DTENSOR_KEY,
    MEGATRON_KEY,
    ONE_SIDED_KEY,
    STACK,
    Fp32LmHeadSettings,
    checked_settings,
)

__all__ = ["PROBE_RPC", "check_probe_reports"]

logger = STACK.logger


def check_probe_reports(
    reports: Any, settings_or_mode: Any, *, where: str = "driver", asked_by: str | None = None
) -> None:
    """Refuse to go on when any vLLM worker's logits disagree with Megatron's setting.

    ``reports`` is what NeMo-RL's collective_rpc of ``PROBE_RPC`` returns: one report per
    worker (nested lists, one per engine, are flattened in order). ``settings_or_mode`` is the
    ``Fp32LmHeadSettings`` from ``check_config`` or a ``megatron_cfg.fp32_lm_head`` value.
    Megatron fp32: every worker must compute float32 logits. Megatron off: none may. Raises
    ``Fp32LmHeadMismatchError`` naming each disagreeing worker (index, host, pid) and why;
    logs one INFO line when all agree.

    A caller that knows only the vLLM switch (NeMo-RL's driver holds the generation config,
    and the config guard holds Megatron's key to that switch) passes any mode for "on" and
    names the switch in ``asked_by`` (``"NRL_VLLM_FP32_LM_HEAD='1' in ..."``): the messages
    then say what asked, not a Megatron mode the caller does not know.
    """
    recorded = checked_settings(where)  # the guard's verdict in this process, if it ran here
    if isinstance(settings_or_mode, Fp32LmHeadSettings):
        mode, key = settings_or_mode.trainer, settings_or_mode.trainer_key
        expect_fp32 = settings_or_mode.vllm_on if settings_or_mode.vllm is not None else mode is not None
    else:
        try:
            mode = trainer_mode(settings_or_mode)
        except ValueError as exc:
            raise Fp32LmHeadConfigError(f"fp32patch ({where}): {MEGATRON_KEY}: {exc}") from None
        key, expect_fp32 = MEGATRON_KEY, mode is not None
        if asked_by is not None and recorded is not None:  # it knows the trainer's backend
            key = recorded.trainer_key
    flat, bad = disagreeing_reports(
        reports,
        expect_fp32,
        lambda i, r: _disagreement(i, r, mode if expect_fp32 else None, key, asked_by),
        where=where,
    )
    if bad:
        if expect_fp32:
            why = "vLLM's switch asks every worker for fp32 logits, and these would generate from bf16 ones"
        else:
            why = "vLLM's switch is off, and these workers would generate from fp32 logits all the same"
        refuse(
            bad,
            header=f"fp32patch ({where}): the fp32 LM head is not on in both engines alike:",
            footer=f"{why}: a mix the config did not ask for. Fix the worker(s) above, or turn both switches off.",
        )
    ways = ", ".join(sorted({str(r.get("way")) for r in flat}))
    dtypes = ", ".join(sorted({str(r.get("dtype")) for r in flat}))
    if asked_by is not None:
        logger.info(
            "fp32patch (%s): LM head fp32 %s in every vLLM worker, as %s asks: %d vLLM worker(s) compute %s "
            "logits (%s); %s",
            where,
            "on" if expect_fp32 else "off",
            asked_by,
            len(flat),
            dtypes,
            "way: " + ways if expect_fp32 else "stock",
            _trainer_said(recorded),
        )
    elif mode is not None or expect_fp32:
        logger.info(
            "fp32patch (%s): LM head fp32 in %s: %s, %d vLLM worker(s) compute float32 logits (way: %s)",
            where,
            "both engines" if mode is not None else "vLLM only",
            f"{_backend(key)} fp32_lm_head={mode!r}"
            if mode is not None
            else f"the trainer's head is bf16 ({ONE_SIDED_KEY})",
            len(flat),
            ways,
        )
    else:
        logger.info(
            "fp32patch (%s): LM head fp32 off in both engines: %d vLLM worker(s) compute %s logits",
            where,
            len(flat),
            dtypes,
        )


def _backend(key: str) -> str:
    return "DTensor" if key == DTENSOR_KEY else "Megatron"


def _trainer_said(settings: Fp32LmHeadSettings | None) -> str:
    """What the probe's line says of the trainer, from the guard's verdict in this process."""
    if settings is None:
        return f"the config guard holds the trainer's switch ({MEGATRON_KEY} or {DTENSOR_KEY}) to the same switch"
    if settings.trainer is None:
        state = "off"
    else:
        state = f"{settings.trainer!r}"
    said = f"the trainer: {settings.trainer_key} is {state}"
    if settings.one_sided:
        return said + f" (one side alone, accepted by policy.{ONE_SIDED_KEY})"
    return said + ", held to the same switch by the config guard"


def _disagreement(index: int, report: Mapping[str, Any], mode: str | None, key: str, asked_by: str | None) -> str:
    # what asked for this worker's logits, as the messages name it
    if asked_by is not None:
        asking = asked_by
    else:
        asking = f"{key}={mode!r}" if mode is not None else f"{key} is off"
    hint = " (set it in policy.generation.vllm_cfg.env_vars, not only in the driver's environment)"
    return disagreement(
        index, report, expect_fp32=mode is not None, asking=asking, switch=VLLM_ENV_VAR, key=key, hint=hint
    )
