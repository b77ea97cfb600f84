"""NeMo-RL's trainer models get fp32patch's fp32 LM head where the config asks for it.

``wire_megatron``: the Megatron worker's model chunks (``megatron_lm_head``).
``wire_dtensor``: the DTensor workers' Hugging Face model, v1 and v2 (``hf_lm_head``), after
it is parallelized (FSDP2, TP), loaded and re-tied; a reward model keeps its stock head.
"""

from __future__ import annotations

from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.config import plain
from fp32patch.runtime.modes import trainer_mode
from fp32patch.runtime.nemo_rl.config import DTENSOR_KEY, MEGATRON_KEY, STACK


def wire_megatron(model: Any, megatron_cfg: Any) -> Any:
    """Give ``model`` (the chunk list from ``get_model``, or one module) fp32 logits when
    ``megatron_cfg.fp32_lm_head`` asks for them; returns ``model``.

    ``megatron_cfg`` is NeMo-RL's ``policy.megatron_cfg`` (a mapping or pydantic model; the
    whole policy section is accepted too). Off (false, null, missing) leaves ``model`` as it
    is. Idempotent: wiring the same model twice with the same mode changes nothing, with a
    different mode raises.
    """
    mode = _mode(megatron_cfg, "megatron_cfg", MEGATRON_KEY, "wire_megatron")
    return STACK.wire(model, mode, trainer="megatron", role="policy")


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
        STACK.logger.info(
            "fp32patch: %s is a reward model (policy.reward_model_cfg.enabled): it keeps its stock "
            "score head; %s=%r applies to LM heads",
            type(model).__name__,
            DTENSOR_KEY,
            mode,
        )
        return model
    return STACK.wire(model, mode, trainer="hf", role="DTensor policy")


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
        return trainer_mode(section.get("fp32_lm_head"))
    except ValueError as exc:
        raise Fp32LmHeadConfigError(f"{key}: {exc}") from None
