"""AReaL's trainer engines and rollout servers get the fp32 LM head where ``enable_fp32_lm_head`` asks.

``check_config``: what AReaL's patched ``load_expr_config`` calls, the guard (``config``'s rules),
then the reference model's key and the vLLM workers' environment made to follow the actor's.
``wire_engine``: an ``FSDPEngine``'s model once FSDP2 (and TP, SP) wrapped it, before the optimizer
(``heads.hf``), or a ``MegatronEngine``'s model chunks as ``make_mcore_model`` built them
(``heads.megatron``, in place of AReaL's own IEEE fp32 forward and mbridge's fp32 option, which the
patch makes step aside); a critic keeps its value head. ``server_args``: the arguments the single
controller starts each rollout server with: SGLang's own ``enable_fp32_lm_head``, or vLLM 0.26+'s
``head_dtype`` (``--hf-overrides``). ``rollout_env_vars``: for a vLLM before 0.26, fp32patch's
variable in the rollout workers' ``env_vars`` (the servers they start inherit it; fp32patch's vLLM
patch reads it). The work is the kit's.
"""

from __future__ import annotations

import json
import os
from typing import Any

from fp32patch.runtime.areal.config import KEY_NAME, MODE, STACK, ArealSettings, get, put, validate_fp32_lm_head_config
from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit import rollout, sglang


def check_config(config: Any, *, where: str = "load_expr_config", environ: Any = None) -> ArealSettings:
    """What AReaL's patched ``load_expr_config`` calls once the config is loaded: refuses what cannot
    give both engines the same logits (``Fp32LmHeadConfigError``, naming ``where``), then makes the
    reference model's key and the vLLM rollout workers' environment follow the actor's key (changed
    in ``config``), logs the notes and one line saying what runs."""
    environ = os.environ if environ is None else environ
    settings = STACK.guard(validate_fp32_lm_head_config, config, where=where, environ=environ)
    if settings.mode is None:
        return settings
    if settings.ref is not None:
        _, section, name = settings.ref.split(".")
        target = get(get(config, "ref"), section)
        if target is not None and get(target, name) is not True:
            put(target, name, True)
            STACK.logger.info("fp32patch (%s): %s follows %s", where, settings.ref, settings.key)
    if settings.rollout == "vllm":
        rollout_env_vars(config, settings, where=where)
    STACK.logger.info(
        "fp32patch (%s): %s: the %s actor's LM head (fp32patch's %s)%s, and %s",
        where,
        settings.key,
        settings.trainer,
        settings.mode,
        " and its reference model's" if settings.ref else "",
        f"every {settings.rollout} rollout server's, probed at startup" if settings.rollout else "no rollout",
    )
    return settings


def wire_engine(engine: Any, *, trainer: str) -> Any:
    """Give an AReaL train engine's model fp32 logits (``trainer``: ``"fsdp"`` or ``"megatron"``),
    where its own config section's key is on; a critic (``config.is_critic``) is left as it is.
    A head fp32patch cannot convert is refused, naming the engine. Returns the engine."""
    config = engine.config
    section = get(config, trainer)
    where = f"AReaL {type(engine).__name__}"
    key = f"{trainer}.{KEY_NAME}"
    if get(section, KEY_NAME) is not True:
        on = [name for name in ("megatron", "fsdp", "archon") if get(get(config, name), KEY_NAME) is True]
        raise Fp32LmHeadConfigError(
            f"fp32patch ({where}): {on[0]}.{KEY_NAME} is true but this engine is {trainer}: that section's key "
            f"would change nothing. Set {key} instead"
        )
    if get(config, "is_critic", False):
        STACK.logger.info("fp32patch (%s): the critic keeps its value head (%s applies to LM heads)", where, key)
        return engine
    if trainer == "megatron" and get(section, "enable_chunked_logits", False):
        raise Fp32LmHeadConfigError(
            f"fp32patch ({where}): {key} is true with enable_chunked_logits: AReaL's chunked-logits head computes "
            "its own output, which fp32patch does not wire. Set enable_chunked_logits to false"
        )
    role = f"{trainer} engine ({get(config, 'experiment_name', '?')}/{get(config, 'trial_name', '?')})"
    try:
        STACK.wire(engine.model, MODE, trainer="hf" if trainer == "fsdp" else "megatron", role=role)
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise Fp32LmHeadConfigError(
            f"fp32patch ({where}): {key} is true but fp32patch cannot give this model fp32 logits: {exc}. "
            f"Set {key} to false"
        ) from None
    return engine


def server_args(args: dict[str, Any], config: Any, backend: str, *, where: str | None = None) -> dict[str, Any]:
    """The arguments of a rollout server (AReaL's ``SGLangConfig``/``vLLMConfig.build_args``, changed
    in place) with its engine's fp32 head on, as the actor's key asks. Returns ``args``."""
    where = where or f"{backend} rollout server"
    settings = _settings(config, where)
    if settings.mode is None:
        return args
    if backend == "sglang":
        return sglang.sglang_args(
            args,
            settings.mode,
            _sglang_server_args_cls(),
            key=settings.key or KEY_NAME,
            where=where,
            logger=STACK.logger,
        )
    if backend != "vllm":
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {settings.key} is true but the rollout is {backend!r}")
    if vllm_route() == "head_dtype":
        given = args.get("hf_overrides")
        try:
            current = json.loads(given) if isinstance(given, str) and given else given
            overrides = rollout.head_dtype_overrides(current, key=settings.key or KEY_NAME, mode=settings.mode)
        except (Fp32LmHeadConfigError, ValueError) as exc:
            raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
        args["hf_overrides"] = json.dumps(overrides)  # AReaL hands every argument on as str(value)
        STACK.logger.info("fp32patch (%s): vLLM's own head_dtype float32 (%s)", where, settings.key)
    return args


def rollout_env_vars(config: Any, settings: ArealSettings, *, where: str) -> None:
    """For a vLLM before 0.26 (or none in this process): fp32patch's variable in every rollout
    scheduling spec's ``env_vars``, which AReaL's scheduler gives the rollout workers and the vLLM
    servers they start; a contradicting value there is refused."""
    if vllm_route() == "head_dtype":
        return
    specs = get(get(config, "rollout"), "scheduling_spec") or ()
    for index, spec in enumerate(specs):
        env_vars = get(spec, "env_vars")
        if env_vars is None:
            env_vars = {}
            put(spec, "env_vars", env_vars)
        rollout.set_vllm_env(
            settings.mode,
            key=settings.key or KEY_NAME,
            where=f"{where}, rollout.scheduling_spec[{index}].env_vars",
            logger=STACK.logger,
            environ=env_vars,
        )


def vllm_route() -> str:
    """``"head_dtype"`` where this process's vLLM is 0.26 or later, else ``"variable"`` (an older
    vLLM, or none here: the servers' own vLLM then needs fp32patch's vLLM patch, which the probe
    checks)."""
    version = rollout.installed_vllm_version()
    return "variable" if version is None else rollout.vllm_route(version)


def _settings(config: Any, where: str) -> ArealSettings:
    try:
        return validate_fp32_lm_head_config(config)
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None


class _ServerArgsWithFlag:
    """SGLang's ``ServerArgs`` where it cannot be imported here but its release has the flag (0.5.3+)."""

    enable_fp32_lm_head = False


class _ServerArgsWithoutFlag:
    """SGLang's ``ServerArgs`` where neither it nor a release with the flag is here."""


def _sglang_server_args_cls() -> type:
    try:
        from sglang.srt.server_args import ServerArgs
    except Exception:  # an SGLang that cannot import in this process (no GPU), or none
        version = sglang.installed_sglang_version()
        return _ServerArgsWithFlag if version is not None and version >= (0, 5, 3) else _ServerArgsWithoutFlag
    return ServerArgs
