"""NeMo-RL's trainer models get fp32patch's fp32 LM head where the config asks for it."""

from __future__ import annotations

import logging
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.modes import megatron_mode
from fp32patch.runtime.nemo_rl.config import MEGATRON_KEY, plain

logger = logging.getLogger("nemo_rl.fp32patch")


def wire_megatron(model: Any, megatron_cfg: Any) -> Any:
    """Give ``model`` (the chunk list from ``get_model``, or one module) fp32 logits when
    ``megatron_cfg.fp32_lm_head`` asks for them; returns ``model``.

    ``megatron_cfg`` is NeMo-RL's ``policy.megatron_cfg`` (a mapping or pydantic model; the
    whole policy section is accepted too). Off (false, null, missing) leaves ``model`` as it
    is. Idempotent: wiring the same model twice with the same mode changes nothing, with a
    different mode raises.
    """
    section = plain(megatron_cfg)
    if not isinstance(section, dict):
        raise TypeError(
            "wire_megatron expects NeMo-RL's policy.megatron_cfg (a mapping), got "
            f"{type(megatron_cfg).__module__}.{type(megatron_cfg).__name__}"
        )
    if "fp32_lm_head" not in section and isinstance(section.get("megatron_cfg"), dict):
        section = section["megatron_cfg"]  # the policy section was passed
    raw = section.get("fp32_lm_head")
    try:
        mode = megatron_mode(raw)
    except ValueError as exc:
        raise Fp32LmHeadConfigError(f"{MEGATRON_KEY}: {exc}") from None
    if mode is None:
        return model
    from fp32patch.runtime.megatron_lm_head import apply_fp32_lm_head

    layers = apply_fp32_lm_head(model, mode)
    chunks = len(model) if isinstance(model, (list, tuple)) else 1
    logger.info(
        "fp32patch: Megatron output layer in fp32 (mode %r): %d of %d model chunk(s) hold the last "
        "pipeline stage's head",
        mode,
        len(layers),
        chunks,
    )
    return model
