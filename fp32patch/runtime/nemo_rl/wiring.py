"""NeMo-RL's trainer models get fp32patch's fp32 LM head where the config asks for it.

``wire_megatron``: the Megatron worker's model chunks (``megatron_lm_head``).
``wire_dtensor``: the DTensor workers' Hugging Face model, v1 and v2 (``hf_lm_head``), after
it is parallelized (FSDP2, TP), loaded and re-tied; a reward model keeps its stock head.
"""

from __future__ import annotations

import logging
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.config import plain
from fp32patch.runtime.modes import megatron_mode
from fp32patch.runtime.nemo_rl.config import DTENSOR_KEY, MEGATRON_KEY

logger = logging.getLogger("nemo_rl.fp32patch")


def wire_megatron(model: Any, megatron_cfg: Any) -> Any:
    """Give ``model`` (the chunk list from ``get_model``, or one module) fp32 logits when
    ``megatron_cfg.fp32_lm_head`` asks for them; returns ``model``.

    ``megatron_cfg`` is NeMo-RL's ``policy.megatron_cfg`` (a mapping or pydantic model; the
    whole policy section is accepted too). Off (false, null, missing) leaves ``model`` as it
    is. Idempotent: wiring the same model twice with the same mode changes nothing, with a
    different mode raises.
    """
    mode = _mode(megatron_cfg, "megatron_cfg", MEGATRON_KEY, "wire_megatron")
    if mode is None:
        return model
    from fp32patch.runtime.heads.megatron import apply_fp32_lm_head

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


def wire_dtensor(model: Any, dtensor_cfg: Any, *, reward_model: bool = False) -> Any:
    """Give ``model`` (the DTensor worker's Hugging Face model, already parallelized, loaded
    and re-tied) fp32 logits when ``dtensor_cfg.fp32_lm_head`` asks for them; returns ``model``.

    ``dtensor_cfg`` is NeMo-RL's ``policy.dtensor_cfg`` (the whole policy section is accepted
    too). Off leaves ``model`` as it is. The same mode again changes nothing, another raises
    ``ValueError``; a head that cannot take the override (LoRA, a custom linear, an fp32 head
    weight, no LM head at all) raises ``hf_lm_head.UnsupportedLmHeadError`` naming it.

    ``reward_model``: the worker builds a reward model (NeMo-RL's ``reward_model_cfg.enabled``),
    whose head scores sequences and gives no logits over the vocabulary: the value is still
    checked, the model is left as it is, and a log line says so.
    """
    mode = _mode(dtensor_cfg, "dtensor_cfg", DTENSOR_KEY, "wire_dtensor")
    if mode is None:
        return model
    if reward_model:
        logger.info(
            "fp32patch: %s is a reward model (policy.reward_model_cfg.enabled): it keeps its stock "
            "score head; %s=%r applies to LM heads",
            type(model).__name__,
            DTENSOR_KEY,
            mode,
        )
        return model
    from fp32patch.runtime.heads.hf import apply_fp32_lm_head

    apply_fp32_lm_head(model, mode)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    logger.info(
        "fp32patch: DTensor policy's LM head in fp32 (mode %r): %s of %s",
        mode,
        type(head).__name__ if head is not None else "the head",
        type(model).__name__,
    )
    return model


def _mode(cfg: Any, section_name: str, key: str, caller: str) -> str | None:
    """The trainer mode that NeMo-RL's ``policy.<section_name>`` asks for (None: off)."""
    section = plain(cfg)
    if not isinstance(section, dict):
        raise TypeError(
            f"{caller} expects NeMo-RL's policy.{section_name} (a mapping), got "
            f"{type(cfg).__module__}.{type(cfg).__name__}"
        )
    if "fp32_lm_head" not in section and isinstance(section.get(section_name), dict):
        section = section[section_name]  # the policy section was passed
    try:
        return megatron_mode(section.get("fp32_lm_head"))
    except ValueError as exc:
        raise Fp32LmHeadConfigError(f"{key}: {exc}") from None
