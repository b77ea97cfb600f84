"""verl's models and rollout servers get the fp32 LM head where ``actor_rollout_ref.model.fp32_lm_head`` asks.

``wire_hf``: the actor's and the ref's Hugging Face module, once FSDP (1 or 2) has wrapped it
(``hf_lm_head``); ``wire_megatron``: their Megatron model chunks (``megatron_lm_head``); a critic
keeps its value head. ``set_vllm_env``: ``NRL_VLLM_FP32_LM_HEAD`` in the vLLM rollout server's
process before its engine starts, so every worker it spawns inherits it. ``sglang_args``: SGLang's
own ``enable_fp32_lm_head`` in the server arguments. Each reads the key from the model config it
is handed (a DictConfig, a mapping, or verl's ``HFModelConfig``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import MutableMapping
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.modes import VLLM_ENV_VAR, VLLM_OFF_VALUES, VLLM_ON_VALUES, VLLM_VALUES_TEXT
from fp32patch.runtime.verl.config import KEY, model_mode

logger = logging.getLogger("verl.fp32patch")

ROLES = ("actor", "ref", "critic")


def wire_hf(module: Any, model_config: Any, *, role: str) -> Any:
    """Give the actor's or the ref's HF ``module`` (FSDP1- or FSDP2-wrapped) fp32 logits when the
    key asks for them; a critic (a value head, not an LM head) is left as it is. Returns ``module``."""
    mode = _lm_head_mode(model_config, role)
    if mode is None:
        return module
    from fp32patch.runtime.heads.hf import apply_fp32_lm_head

    apply_fp32_lm_head(module, mode)
    logger.info("fp32patch: the %s's LM head gives fp32 logits (mode %r): %s", role, mode, type(module).__name__)
    return module


def wire_megatron(modules: Any, model_config: Any, *, role: str) -> Any:
    """Give the actor's or the ref's Megatron model chunks fp32 logits when the key asks for
    them; a critic is left as it is. Returns ``modules``."""
    mode = _lm_head_mode(model_config, role)
    if mode is None:
        return modules
    from fp32patch.runtime.heads.megatron import apply_fp32_lm_head

    layers = apply_fp32_lm_head(modules, mode)
    chunks = len(modules) if isinstance(modules, (list, tuple)) else 1
    logger.info(
        "fp32patch: the %s's Megatron output layer gives fp32 logits (mode %r): %d of %d chunk(s) hold the head",
        role,
        mode,
        len(layers),
        chunks,
    )
    return modules


def set_vllm_env(model_config: Any, *, where: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``NRL_VLLM_FP32_LM_HEAD`` in this process (a vLLM rollout server, before its engine
    starts) from the key; returns the value vLLM's processes will see (None: unset).

    The key on: the variable becomes "1" unless it already names an on value (the way,
    "copy"); "0" there is a contradiction. The key off: an "on" variable would make the rollout
    fp32 and the trainer bf16, and is refused. Raises ``Fp32LmHeadConfigError``.
    """
    environ = os.environ if environ is None else environ
    mode = _mode(model_config, where)
    current = environ.get(VLLM_ENV_VAR)
    if current is not None and current not in VLLM_ON_VALUES and current not in VLLM_OFF_VALUES:
        raise Fp32LmHeadConfigError(
            f"fp32patch ({where}): {VLLM_ENV_VAR}={current!r} is not valid; valid values: {VLLM_VALUES_TEXT}"
        )
    if mode is None:
        if current in VLLM_ON_VALUES:
            raise Fp32LmHeadConfigError(
                f'fp32patch ({where}): {VLLM_ENV_VAR}="{current}" in this process but {KEY} is off: the rollout '
                f"would compute fp32 logits and the trainer bf16 ones. Set {KEY} instead of the variable"
            )
        return current
    if current in VLLM_OFF_VALUES:
        raise Fp32LmHeadConfigError(
            f'fp32patch ({where}): {KEY} is {mode!r} but {VLLM_ENV_VAR}="{current}" in this process: the two '
            "disagree. Remove the variable; the key sets it"
        )
    if current is None:
        environ[VLLM_ENV_VAR] = "1"
    logger.info(
        "fp32patch (%s): %s=%s for the vLLM engine's processes (%s=%r)",
        where,
        VLLM_ENV_VAR,
        environ[VLLM_ENV_VAR],
        KEY,
        mode,
    )
    return environ[VLLM_ENV_VAR]


def sglang_args(args: dict[str, Any], model_config: Any, server_args_cls: Any, *, where: str) -> dict[str, Any]:
    """SGLang's server arguments with its own fp32 LM head (``enable_fp32_lm_head``, SGLang
    0.5.3+) on when the key asks for it; refuses an SGLang without it, and a contradicting or
    one-sided ``enable_fp32_lm_head``. Returns ``args`` (changed in place)."""
    mode = _mode(model_config, where)
    asked = args.get("enable_fp32_lm_head")
    if mode is None:
        if asked:
            raise Fp32LmHeadConfigError(
                f"fp32patch ({where}): enable_fp32_lm_head is on in SGLang's arguments but {KEY} is off: the "
                f"rollout would compute fp32 logits and the trainer bf16 ones. Set {KEY} instead"
            )
        return args
    names = (
        {f.name for f in dataclasses.fields(server_args_cls)}
        if dataclasses.is_dataclass(server_args_cls)
        else set(vars(server_args_cls))
    )
    if "enable_fp32_lm_head" not in names:
        raise Fp32LmHeadConfigError(
            f"fp32patch ({where}): {KEY} is {mode!r} but this SGLang's ServerArgs has no enable_fp32_lm_head "
            "(SGLang 0.5.3 and later have it): the rollout's logits would stay bf16. Upgrade SGLang, or set "
            f"{KEY} to false"
        )
    if asked is not None and asked is not True:
        raise Fp32LmHeadConfigError(
            f"fp32patch ({where}): {KEY} is {mode!r} but SGLang's enable_fp32_lm_head is {asked!r}: the two "
            "disagree. Remove it from engine_kwargs.sglang; the key turns it on"
        )
    args["enable_fp32_lm_head"] = True
    logger.info("fp32patch (%s): SGLang's enable_fp32_lm_head on (%s=%r)", where, KEY, mode)
    return args


def _lm_head_mode(model_config: Any, role: str) -> str | None:
    """The mode ``role``'s LM head gets: None when the key is off, and for the critic, whose value
    head is no LM head (said in the log)."""
    mode = _mode(model_config, role)
    if mode is not None and role == "critic":
        logger.info("fp32patch: the critic keeps its value head (%s=%r applies to LM heads)", KEY, mode)
        return None
    return mode


def _mode(model_config: Any, where: str) -> str | None:
    try:
        return model_mode(model_config)
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
