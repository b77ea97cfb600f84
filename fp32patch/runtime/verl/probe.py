"""verl's vLLM rollout servers hold their workers' probe reports to the key.

Each server asks every vLLM worker of its engine, once the model is loaded (after verl's own
``monkey_patch_model``), for ``probe_vllm_model``'s report through the engine's
``collective_rpc`` under ``PROBE_RPC`` (a method the patch adds to verl's worker extension),
and refuses to start when a worker's logits are not what ``actor_rollout_ref.model.fp32_lm_head``
asks: the run fails at startup, not after a day of one-sided training. Each SGLang rollout server
(``SGLangHttpServer``, whose tokenizer manager lives in its process) is probed the kit's way
(``kit.sglang.probe_tokenizer_manager``): its arguments read, the grade of its log-probs measured.
"""

from __future__ import annotations

import inspect
from typing import Any

from fp32patch.runtime.kit import sglang
from fp32patch.runtime.kit.probe import PROBE_RPC, hold_reports
from fp32patch.runtime.modes import VLLM_ENV_VAR
from fp32patch.runtime.verl.config import KEY, STACK, model_mode

__all__ = ["PROBE_RPC", "check_reports", "probe_model", "probe_server", "probe_sglang"]

logger = STACK.logger


async def probe_server(engine_client: Any, model_config: Any, *, where: str) -> list[Any]:
    """Ask every worker of ``engine_client`` (vLLM's AsyncLLM) for its report; check them."""
    reports = engine_client.collective_rpc(PROBE_RPC)
    if inspect.isawaitable(reports):
        reports = await reports
    check_reports(reports, model_config, where=where)
    return reports


def probe_model(model: Any, model_config: Any, *, where: str) -> dict[str, Any]:
    """Probe a vLLM model loaded in this process (verl 0.6.1 and 0.7.0 run vLLM's worker inside
    the trainer's); check its report."""
    from fp32patch.runtime.heads.vllm_probe import probe_vllm_model

    report = probe_vllm_model(model)
    check_reports([report], model_config, where=where)
    return report


def check_reports(reports: Any, model_config: Any, *, where: str) -> None:
    """Refuse (``Fp32LmHeadMismatchError``) when a worker's logits disagree with the key: on, every
    worker computes float32 logits; off, none does. Logs one line when all agree."""
    hold_reports(reports, model_mode(model_config), where=where, key=KEY, switch=VLLM_ENV_VAR, logger=logger)


async def probe_sglang(tokenizer_manager: Any, model_config: Any, *, where: str) -> Any:
    """Probe the SGLang server whose ``TokenizerManager`` lives in this process (verl's
    ``SGLangHttpServer``, once up); refuse it (``Fp32LmHeadMismatchError``) where what it computes
    disagrees with the key. Returns its report."""
    return await sglang.probe_tokenizer_manager(
        tokenizer_manager, model_mode(model_config), where=where, key=KEY, logger=logger
    )
