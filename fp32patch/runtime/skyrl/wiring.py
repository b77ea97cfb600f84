"""SkyRL's trainer models and vLLM servers get the fp32 LM head where ``trainer.fp32_lm_head`` asks.

``wire_hf``: the FSDP worker's ``HFModelWrapper`` (the policy, the reference model) once
``strategy.prepare`` has sharded it: its HF model's head through the kit (``Stack.wire(...,
trainer="hf")``), and the mark that routes its log-probs through ``fused.ChunkedCall``.
``wire_megatron``: a ``MegatronModelWrapper``'s model chunks (policy or reference), whose output
layer then gives fp32 logits in the mode (``heads.megatron``, fp32out's cost), read by SkyRL's own
log-prob collection; its fused LM-head path finds the wired head by its weight (``megatron``). ``engine_args``: the vLLM server arguments ``build_vllm_cli_args`` returns get
vLLM's own ``head_dtype`` float32 (``kit.rollout.head_dtype_overrides``).
"""

from __future__ import annotations

from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit import rollout
from fp32patch.runtime.skyrl.config import KEY, STACK, check_config, requested_mode
from fp32patch.runtime.skyrl.fused import mark

ROLES = ("policy", "reference model")


def wire_hf(wrapper: Any, cfg: Any, *, role: str) -> Any:
    """Give ``role``'s ``HFModelWrapper`` (``cfg``: SkyRL's trainer config) the fp32 head and chunked
    log-probs in the switch's mode. Returns ``wrapper``."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    mode = _mode(cfg, role)
    if mode is None:
        return wrapper
    STACK.wire(wrapper.model, mode, trainer="hf", role=role)
    mark(wrapper, wrapper.model, mode, role=role)
    STACK.logger.info("fp32patch: the %s's log-probs are computed in chunks from its fp32 head (mode %r)", role, mode)
    return wrapper


def wire_megatron(wrapper: Any) -> Any:
    """Give a ``MegatronModelWrapper``'s chunks (``wrapper.actor_module``) fp32 logits in the
    switch's mode. SkyRL's fused LM-head path (``trainer.fused_lm_head_logprob``), which never
    calls the output layer, then finds the wired head by its weight (``megatron``)."""
    role = "policy" if getattr(wrapper, "actor_optimizer", None) is not None else "Megatron model"
    mode = _mode(wrapper.cfg, role)
    if mode is None:
        return wrapper
    STACK.wire(wrapper.actor_module, mode, trainer="megatron", role=role)
    if getattr(wrapper, "_fused_lm_head", False):
        STACK.logger.info(
            "fp32patch: the %s's fused LM-head log-probs (trainer.fused_lm_head_logprob) are computed in tiles "
            "from its fp32 head (mode %r), without the [B, T, V] logits",
            role,
            mode,
        )
    return wrapper


def engine_args(args: Any, cfg: Any, *, where: str = "build_vllm_cli_args") -> Any:
    """vLLM's own ``head_dtype`` float32 in the server arguments ``args`` (a Namespace), after the
    guard has read ``cfg`` (SkyRL's whole config) again in this process. Returns ``args``."""
    settings = check_config(cfg, where=where)
    if settings.mode is None:
        return args
    version = rollout.installed_vllm_version()
    try:
        if rollout.vllm_route(version) != "head_dtype":
            raise Fp32LmHeadConfigError(
                f"{KEY} is {settings.mode!r} but vLLM {'.'.join(map(str, version))} has no head_dtype (0.26+); "
                "install the vLLM SkyRL pins"
            )
        args.hf_overrides = rollout.head_dtype_overrides(
            getattr(args, "hf_overrides", None), key=KEY, mode=settings.mode
        )
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
    STACK.logger.info(
        "fp32patch (%s): vLLM's own head_dtype float32 for every server (%s=%r)", where, KEY, settings.mode
    )
    return args


def _mode(cfg: Any, role: str) -> str | None:
    try:
        return requested_mode(cfg)
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({role}): {exc}") from None
