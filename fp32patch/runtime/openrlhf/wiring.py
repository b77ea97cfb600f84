"""OpenRLHF's actors and vLLM engines get the fp32 LM head where ``--fp32_lm_head`` asks.

``wire_actor``: an ``Actor`` (the policy, the reference model, the EMA model) once built, before
DeepSpeed wraps it: its HF model's head through the kit (``Stack.wire(..., trainer="hf")``), and the
mark that routes its log-probs through ``fused.ChunkedCall``. ``engine_options``: in the driver, each
vLLM engine's Ray actor before it starts: vLLM 0.26+ gets ``head_dtype`` float32 in the engine's
arguments (``kit.rollout.head_dtype_overrides``), earlier vLLM fp32patch's variable in the actor's
Ray ``runtime_env`` (``kit.rollout.ray_runtime_env``), which the engine's processes and its
tensor-parallel Ray workers inherit.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit import rollout
from fp32patch.runtime.openrlhf.config import GUARD, KEY, NAME, STACK, requested_mode
from fp32patch.runtime.openrlhf.fused import mark

ROLES = ("actor", "reference model", "EMA model")


def wire_actor(actor: Any, args: Any, *, role: str) -> Any:
    """Give ``role``'s ``Actor`` (its ``model`` the HF model, or PEFT's wrapper, not yet wrapped by
    DeepSpeed) the fp32 head and chunked log-probs in the flag's mode. Returns ``actor``."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    try:
        mode = requested_mode(getattr(args, NAME, None))
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({role}): {exc}") from None
    if mode is None:
        return actor
    STACK.wire(actor.model, mode, trainer="hf", role=role)
    mark(actor, actor.model, mode, role=role)
    STACK.logger.info("fp32patch: the %s's log-probs are computed in chunks from its fp32 head (mode %r)", role, mode)
    return actor


def rollout_mode() -> str | None:
    """The mode the driver's guard settled on (None: off, or the guard did not run here)."""
    settings = STACK.verdict(GUARD)
    return None if settings is None else settings.mode


def engine_options(
    actor_cls: Any, actor_kwargs: MutableMapping[str, Any], *, where: str = "create_vllm_engines"
) -> Any:
    """``actor_cls.options`` for one vLLM engine's Ray actor, with vLLM's fp32 head turned on as the
    installed vLLM takes it; ``actor_kwargs`` (the engine's arguments) may be changed in place.
    With the flag off, an on switch in the engine's arguments or runtime environment is refused."""
    mode = rollout_mode()
    try:
        route = rollout.vllm_route(rollout.installed_vllm_version()) if mode is not None else None
        if route == "head_dtype" or mode is None:
            overrides = rollout.head_dtype_overrides(actor_kwargs.get("hf_overrides"), key=KEY, mode=mode)
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
    if route == "head_dtype" or mode is None:
        if overrides or "hf_overrides" in actor_kwargs:
            actor_kwargs["hf_overrides"] = overrides
        if mode is not None:
            STACK.logger.info("fp32patch (%s): vLLM's own head_dtype float32 for the engine (%s=%r)", where, KEY, mode)

    def options(**kwargs: Any) -> Any:
        if route == "variable":
            kwargs["runtime_env"] = rollout.ray_runtime_env(
                kwargs.get("runtime_env"), mode, key=KEY, where=where, logger=STACK.logger
            )
        elif mode is None and kwargs.get("runtime_env"):  # an on switch there would be one side alone
            rollout.ray_runtime_env(kwargs["runtime_env"], None, key=KEY, where=where, logger=STACK.logger)
        return actor_cls.options(**kwargs)

    return options
