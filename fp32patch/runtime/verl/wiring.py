"""verl's models and rollout servers get the fp32 LM head where ``actor_rollout_ref.model.fp32_lm_head`` asks.

``wire_hf``: the actor's and the ref's Hugging Face module, once FSDP (1 or 2) has wrapped it;
``wire_megatron``: their Megatron model chunks; a critic keeps its value head. ``set_vllm_env``:
vLLM's switch in the vLLM rollout server's process before its engine starts, so every worker it
spawns inherits it. ``sglang_args``: SGLang's own ``enable_fp32_lm_head`` in the server arguments.
Each reads the key from the model config it is handed (a DictConfig, a mapping, or verl's
``HFModelConfig``); the work is the kit's (``fp32patch.runtime.kit``).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit import rollout
from fp32patch.runtime.verl.config import KEY, STACK, model_mode

ROLES = ("actor", "ref", "critic")


def wire_hf(module: Any, model_config: Any, *, role: str) -> Any:
    """Give the actor's or the ref's HF ``module`` (FSDP1- or FSDP2-wrapped) fp32 logits when the
    key asks for them; a critic (a value head, not an LM head) is left as it is. Returns ``module``."""
    return STACK.wire(module, _lm_head_mode(model_config, role), trainer="hf", role=role)


def wire_megatron(modules: Any, model_config: Any, *, role: str) -> Any:
    """Give the actor's or the ref's Megatron model chunks fp32 logits when the key asks for
    them; a critic is left as it is. Returns ``modules``."""
    return STACK.wire(modules, _lm_head_mode(model_config, role), trainer="megatron", role=role)


def set_vllm_env(model_config: Any, *, where: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """vLLM's switch in this process (a vLLM rollout server, before its engine starts) from the
    key; returns the value vLLM's processes will see (None: unset). See ``kit.rollout.set_vllm_env``."""
    return rollout.set_vllm_env(_mode(model_config, where), key=KEY, where=where, logger=STACK.logger, environ=environ)


def sglang_args(args: dict[str, Any], model_config: Any, server_args_cls: Any, *, where: str) -> dict[str, Any]:
    """SGLang's server arguments with its own fp32 LM head (``enable_fp32_lm_head``, SGLang
    0.5.3+) on when the key asks for it; refuses an SGLang without it, the hazards of
    ``kit.sglang.check_server_args`` (the model's own switches read from verl's ``hf_config``), and a contradicting or
    one-sided ``enable_fp32_lm_head``. Returns ``args`` (changed in place)."""
    mode = _mode(model_config, where)
    hf_config = getattr(model_config, "hf_config", None)  # verl's HFModelConfig: the model's own switches
    return rollout.sglang_args(
        args, mode, server_args_cls, key=KEY, where=where, logger=STACK.logger, model_config=hf_config
    )


def _lm_head_mode(model_config: Any, role: str) -> str | None:
    """The mode ``role``'s LM head gets: None when the key is off, and for the critic, whose value
    head is no LM head (said in the log)."""
    mode = _mode(model_config, role)
    if mode is not None and role == "critic":
        STACK.logger.info("fp32patch: the critic keeps its value head (%s=%r applies to LM heads)", KEY, mode)
        return None
    return mode


def _mode(model_config: Any, where: str) -> str | None:
    try:
        return model_mode(model_config)
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
