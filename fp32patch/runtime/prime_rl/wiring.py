"""Where Prime-RL's patched files hand fp32patch a config or a model: the rl launcher's config
(the trainer's key follows Prime-RL's switch) and the RL trainer's model (its head)."""

from __future__ import annotations

from typing import Any

from fp32patch.runtime.prime_rl import head
from fp32patch.runtime.prime_rl.config import (
    KEY,
    STACK,
    TRAINER_KEY,
    PrimeRlSettings,
    validate_rl_config,
    validate_trainer_config,
)

logger = STACK.logger


def check_rl_config(config: Any, *, where: str = "rl config") -> Any:
    """The rl launcher's ``RLConfig`` after its own validators: the guard, then the trainer's key
    set to what it resolves to (a mode, or false), so the trainer.json the launcher writes says it.
    Returns ``config``."""
    settings: PrimeRlSettings = STACK.guard(validate_rl_config, config, where=where)
    config.trainer.model.fp32_lm_head = settings.mode if settings.mode is not None else False
    rollout = {True: "fp32 in vLLM (Prime-RL's own patch)", False: "bf16 in vLLM", None: "no vLLM server here"}
    logger.info(
        "fp32patch (%s): %s=%r; %s: %s",
        where,
        TRAINER_KEY,
        config.trainer.model.fp32_lm_head,
        KEY,
        rollout[settings.rollout],
    )
    return config


def wire_trainer(model: Any, config: Any, *, where: str = "trainer") -> Any:
    """The RL trainer's model from ``setup_model``, with fp32patch's forward on its LM head where
    the trainer's config (``TrainerConfig``) asks; returns ``model``."""
    settings: PrimeRlSettings = STACK.guard(validate_trainer_config, config, where=where)
    if settings.mode is None:
        return model
    kind = head.install(model, settings.mode)
    logger.info(
        "fp32patch (%s): the %s computes %s at fp32 grade (mode %r)",
        where,
        kind,
        "log-probs and entropy with fp32patch's chunked kernel" if head.KINDS[kind][0] else "fp32 logits",
        settings.mode,
    )
    return model
