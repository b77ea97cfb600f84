"""Refuse NeMo-RL policy configs that would run the fp32 LM head on one engine only.

fp32 logits help only when the trainer (Megatron) and the generator (vLLM) both have
them: one side alone makes the train/generation mismatch worse. So
``validate_fp32_lm_head_config(policy_cfg)`` raises ``Fp32LmHeadConfigError`` unless

- ``megatron_cfg.fp32_lm_head`` is one of false, true, "fp32", "tf32", "fp32out",
  "fp32out-hilo", "fp32out-bf16grad" (missing or null: false). The string "false" and "TF32" are errors,
  never quietly off;
- it is off when ``megatron_cfg.enabled`` is false (nothing would apply it) and when
  ``megatron_cfg.use_fused_linear_logprobs`` is true (that path computes log-probs from
  the hidden states and the output weight directly, bypassing the output layer);
- when generation runs vLLM (``generation.backend`` "vllm", or "dynamo", whose managed
  fleet is vLLM started with the same ``vllm_cfg.env_vars``), ``NRL_VLLM_FP32_LM_HEAD``
  is on ("1", "fp32out", "copy") exactly when Megatron's switch is on, and is otherwise
  unset or "0". Other backends (and no ``generation`` section) skip this rule.

The vLLM value is read as NeMo-RL passes it to the workers: ``str()`` of the YAML value
in ``generation.vllm_cfg.env_vars`` (so ``1`` and ``0`` work, while YAML ``true`` becomes
"True" and is refused), else the driver's environment, which NeMo-RL copies into
workers that the config does not override. Missing sections are empty.

A key that looks like one of the switches but is not spelled as it (``fp32_lm_heads``,
``fp32LmHead`` or ``fp32_lm_head`` one level too high under ``megatron_cfg``; a misspelt
``NRL_VLLM_FP32_LM_HEAD`` in ``env_vars``) is an error naming the right key: NeMo-RL keeps
unknown keys without a word, so a near miss would silently mean "off".

``check_config(cfg, where=...)`` is what NeMo-RL's patched files call: the same guard on the
master config or its ``policy`` section, as a dict or a pydantic model (NeMo-RL's
``MasterConfig`` is pydantic with ``extra="allow"``: it keeps a misspelt key without a word,
so this check is the one that sees it), plus ``megatron_cfg.fp32_residual_connection`` (a
boolean, not also set in ``megatron_cfg.model_overrides``); its messages name the caller.
Pure Python.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.modes import (
    MEGATRON_MODES,
    MEGATRON_VALUES_TEXT,
    VLLM_ENV_VAR,
    VLLM_OFF_VALUES,
    VLLM_ON_VALUES,
    VLLM_VALUES_TEXT,
    megatron_mode,
)

# The switch as NeMo-RL's messages name it.
MEGATRON_KEY = "policy.megatron_cfg.fp32_lm_head"
DTENSOR_KEY = "policy.dtensor_cfg.fp32_lm_head"
RESIDUAL = "fp32_residual_connection"

# Generation backends that start vLLM with generation.vllm_cfg.env_vars.
VLLM_BACKENDS = ("vllm", "dynamo")


@dataclass(frozen=True)
class Fp32LmHeadSettings:
    """What a valid config asks for.

    ``megatron`` is the mode to hand to ``apply_fp32_lm_head`` (None: off). ``vllm`` is the
    ``NRL_VLLM_FP32_LM_HEAD`` value vLLM will see (None: unset, or generation is not vLLM).
    """

    megatron: str | None
    vllm: str | None


def validate_fp32_lm_head_config(
    cfg: Mapping[str, Any], *, environ: Mapping[str, str] | None = None
) -> Fp32LmHeadSettings:
    """Check ``cfg`` (NeMo-RL's ``policy`` section, or a whole config holding one).

    ``environ`` stands for the driver's environment (default ``os.environ``); tests pass
    their own. Raises ``Fp32LmHeadConfigError`` naming the key and the valid values.
    """
    cfg, prefix = _policy(cfg)
    megatron = _section(cfg, "megatron_cfg", prefix)
    _refuse_near_misses(cfg, megatron, prefix)
    mode = _megatron_mode(megatron, prefix)
    if mode is not None:
        _check_megatron_applies(megatron, prefix)

    generation = _section(cfg, "generation", prefix)
    backend = generation.get("backend")
    if backend not in VLLM_BACKENDS:
        return Fp32LmHeadSettings(megatron=mode, vllm=None)
    vllm, source = _vllm_value(generation, prefix, os.environ if environ is None else environ)
    vllm_on = vllm in VLLM_ON_VALUES
    key = f"{prefix}megatron_cfg.fp32_lm_head"
    if mode is not None and not vllm_on:
        seen = "is not set" if vllm is None else f'is "{vllm}"'
        raise Fp32LmHeadConfigError(
            f"{key} is {mode!r} but {source} {seen}: vLLM would still round its logits to "
            "bf16, and fp32 logits on the trainer alone make the train/generation mismatch "
            f"worse. Set {prefix}generation.vllm_cfg.env_vars.{VLLM_ENV_VAR} to one of "
            f"{_quoted(VLLM_ON_VALUES)}, or set {key} to false"
        )
    if mode is None and vllm_on:
        raise Fp32LmHeadConfigError(
            f'{source} is "{vllm}" but {key} is off: Megatron would still round its logits '
            "to bf16, and fp32 logits on vLLM alone make the train/generation mismatch "
            f"worse. Set {key} to one of {_quoted(MEGATRON_MODES)} (or true), or unset "
            f"{VLLM_ENV_VAR}"
        )
    return Fp32LmHeadSettings(megatron=mode, vllm=vllm)


def _policy(cfg: Any) -> tuple[Mapping[str, Any], str]:
    """The policy section and the key prefix that leads to it."""
    if not isinstance(cfg, Mapping):
        raise Fp32LmHeadConfigError(f"expected the policy config as a mapping, got {type(cfg).__name__}")
    # A whole config was passed: validating its top level would silently find nothing.
    if "megatron_cfg" not in cfg and "generation" not in cfg and "policy" in cfg:
        return _section(cfg, "policy", ""), "policy."
    return cfg, ""


def _section(parent: Mapping[str, Any], key: str, prefix: str) -> Mapping[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise Fp32LmHeadConfigError(f"{prefix}{key} must be a mapping, not {type(value).__name__} ({value!r})")
    return value


def _megatron_mode(megatron: Mapping[str, Any], prefix: str) -> str | None:
    raw = megatron.get("fp32_lm_head")
    try:
        return megatron_mode(raw)
    except ValueError:
        hint = ""
        if isinstance(raw, str) and raw.strip().lower() in ("false", "true", "no", "yes"):
            hint = " (a quoted string is not a boolean: write false or true without quotes)"
        elif isinstance(raw, str) and raw.strip().lower() in MEGATRON_MODES:
            hint = f' (did you mean "{raw.strip().lower()}"? the names are lower case)'
        raise Fp32LmHeadConfigError(
            f"{prefix}megatron_cfg.fp32_lm_head = {raw!r} is not valid{hint}; valid values: {MEGATRON_VALUES_TEXT}"
        ) from None


def _check_megatron_applies(megatron: Mapping[str, Any], prefix: str) -> None:
    """Refuse an fp32 head that nothing would apply."""
    key = f"{prefix}megatron_cfg"
    if "enabled" in megatron and not megatron["enabled"]:
        raise Fp32LmHeadConfigError(
            f"{key}.fp32_lm_head is on but {key}.enabled is {megatron['enabled']!r}: the "
            "policy does not train with Megatron, so its logits would stay bf16. Set "
            f"{key}.fp32_lm_head to false (and unset {VLLM_ENV_VAR})"
        )
    fused = megatron.get("use_fused_linear_logprobs", False)
    if fused:
        raise Fp32LmHeadConfigError(
            f"{key}.fp32_lm_head is on together with {key}.use_fused_linear_logprobs = "
            f"{fused!r}: the fused path computes log-probs from the hidden states and the "
            "output weight directly, so the fp32 output layer would never run. Set "
            f"{key}.use_fused_linear_logprobs to false, or {key}.fp32_lm_head to false"
        )


MEGATRON_KEY_NAME = "fp32_lm_head"
# How close (difflib ratio of the normalised spellings) a key must come to count as a near miss.
_CLOSENESS = 0.85


def _normalised(key: str) -> str:
    return key.lower().replace("_", "").replace("-", "").replace(" ", "")


def _near_miss(key: object, right: str) -> bool:
    """``key`` looks like ``right`` but is not it: another case or separator, a letter more or
    less, or any spelling with "fp32", "lm" and "head" in it (NeMo-RL's patched files take a
    megatron_cfg key starting "fp32" with "lm" and "head" in it as asking for fp32patch)."""
    if not isinstance(key, str) or key == right:
        return False
    got, want = _normalised(key), _normalised(right)
    if got == want:
        return True
    if "fp32" in got and "lm" in got and "head" in got:
        return True
    return difflib.SequenceMatcher(None, got, want).ratio() >= _CLOSENESS


def _refuse_near_misses(policy: Mapping[str, Any], megatron: Mapping[str, Any], prefix: str) -> None:
    right = f"{prefix}megatron_cfg.{MEGATRON_KEY_NAME}"
    for key in megatron:
        if _near_miss(key, MEGATRON_KEY_NAME):
            raise Fp32LmHeadConfigError(
                f"{prefix}megatron_cfg.{key} is not a key fp32patch or NeMo-RL reads: did you mean "
                f"{right}? NeMo-RL keeps unknown keys without a word, so this one would leave "
                f"Megatron's logits in bf16. Rename it to {right} (valid values: {MEGATRON_VALUES_TEXT})"
            )
    for key in policy:
        if key == MEGATRON_KEY_NAME or _near_miss(key, MEGATRON_KEY_NAME):
            raise Fp32LmHeadConfigError(
                f"{prefix}{key} is in the wrong place: the switch is {right} (under megatron_cfg), "
                "and NeMo-RL ignores this key without a word"
            )
    generation = policy.get("generation")
    vllm_cfg = generation.get("vllm_cfg") if isinstance(generation, Mapping) else None
    env_vars = vllm_cfg.get("env_vars") if isinstance(vllm_cfg, Mapping) else None
    for key in env_vars if isinstance(env_vars, Mapping) else ():
        if _near_miss(key, VLLM_ENV_VAR):
            raise Fp32LmHeadConfigError(
                f"{prefix}generation.vllm_cfg.env_vars.{key} is not the variable vLLM's patched "
                f"files read: did you mean {VLLM_ENV_VAR}? Rename it to "
                f"{prefix}generation.vllm_cfg.env_vars.{VLLM_ENV_VAR}"
            )


def _vllm_value(generation: Mapping[str, Any], prefix: str, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The value vLLM's workers will see for the switch, and where it comes from."""
    vllm_cfg = _section(generation, "vllm_cfg", f"{prefix}generation.")
    env_vars = _section(vllm_cfg, "env_vars", f"{prefix}generation.vllm_cfg.")
    if VLLM_ENV_VAR in env_vars:
        raw = env_vars[VLLM_ENV_VAR]
        source = f"{prefix}generation.vllm_cfg.env_vars.{VLLM_ENV_VAR}"
        value = str(raw)  # what NeMo-RL hands to the workers
    elif VLLM_ENV_VAR in environ:
        raw = value = environ[VLLM_ENV_VAR]
        source = f"the environment variable {VLLM_ENV_VAR}"
    else:
        return None, f"{prefix}generation.vllm_cfg.env_vars.{VLLM_ENV_VAR}"
    if value not in VLLM_ON_VALUES and value not in VLLM_OFF_VALUES:
        hint = ""
        if isinstance(raw, bool) or raw is None:
            spelled = {True: "true", False: "false", None: "null"}[raw]
            hint = f' (YAML {spelled} reaches vLLM as the string "{value}"; write 1 or 0)'
        raise Fp32LmHeadConfigError(f"{source} = {raw!r} is not valid{hint}; valid values: {VLLM_VALUES_TEXT}")
    return value, source


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f'"{v}"' for v in values)


# ---------------------------------------------------------------- what NeMo-RL's patched files call


def check_config(cfg: Any, *, where: str, environ: Mapping[str, str] | None = None) -> Fp32LmHeadSettings:
    """Refuse a NeMo-RL config that would give fp32 logits to one engine only, or a bad value.

    ``cfg`` is the master config or its ``policy`` section: a dict, any Mapping, or a pydantic
    model. ``where`` names the caller in messages ("driver", "megatron worker rank 3").
    ``environ`` stands for this process's environment (default ``os.environ``). Returns what
    the config asks for; raises ``Fp32LmHeadConfigError``.
    """
    try:
        policy = _policy_of(cfg)
        # Validated as part of a master config, so every message names the full YAML path.
        settings = validate_fp32_lm_head_config({"policy": policy}, environ=environ)
        _check_residual(policy)
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
    return settings


def plain(value: Any) -> Any:
    """Mappings and pydantic models as plain dicts (pydantic keeps extra keys in its dump)."""
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    dump = getattr(value, "model_dump", None)  # pydantic 2
    if callable(dump) and not isinstance(value, type):
        return plain(dump())
    legacy = getattr(value, "dict", None)  # pydantic 1
    if callable(legacy) and hasattr(value, "__fields__") and not isinstance(value, type):
        return plain(legacy())
    return value


def _policy_of(cfg: Any) -> dict[str, Any]:
    whole = plain(cfg)
    if not isinstance(whole, dict):
        raise Fp32LmHeadConfigError(
            f"expected NeMo-RL's master config or its policy section (a mapping or a pydantic model), "
            f"got {type(cfg).__name__}"
        )
    if "megatron_cfg" not in whole and "generation" not in whole and "policy" in whole:
        policy = whole["policy"]
        if not isinstance(policy, dict):
            raise Fp32LmHeadConfigError(f"policy must be a mapping, not {type(policy).__name__} ({policy!r})")
        return policy
    return whole


def _check_residual(policy: Mapping[str, Any]) -> None:
    megatron = policy.get("megatron_cfg")
    if not isinstance(megatron, Mapping) or RESIDUAL not in megatron:
        return
    key = f"policy.megatron_cfg.{RESIDUAL}"
    value = megatron[RESIDUAL]
    if not isinstance(value, bool):
        hint = " (a quoted string is not a boolean)" if isinstance(value, str) else ""
        raise Fp32LmHeadConfigError(
            f"{key} = {value!r} is not valid{hint}: write true or false without quotes, or leave the key out"
        )
    overrides = megatron.get("model_overrides")
    if isinstance(overrides, Mapping) and RESIDUAL in overrides:
        raise Fp32LmHeadConfigError(
            f"{key} = {value!r} and policy.megatron_cfg.model_overrides.{RESIDUAL} = "
            f"{overrides[RESIDUAL]!r} both set Megatron's {RESIDUAL}: keep {key} and remove it "
            "from model_overrides"
        )
