"""Refuse NeMo-RL policy configs that would run the fp32 LM head other than the user meant.

The trainer's switch is the enabled backend's: ``megatron_cfg.fp32_lm_head`` (Megatron) or
``dtensor_cfg.fp32_lm_head`` (DTensor v1 and v2), each one of false, true, "fp32", "tf32",
"fp32out", "fp32out-hilo", "fp32out-bf16grad" (missing or null: false; the string "false" and
"TF32" are errors, never quietly off). vLLM's switch is ``generation.vllm_cfg.fp32_lm_head``
(true/false, or "tf32" as upstream NeMo-RL's alias of true; upstream's key since September
2026) or, the older spelling, ``NRL_VLLM_FP32_LM_HEAD`` (or fp32patch's neutral name for it,
``FP32PATCH_VLLM_LM_HEAD``) in ``generation.vllm_cfg.env_vars``
("1", "fp32out", "copy"; "0" or unset is off), else in the driver's environment. ``validate_fp32_lm_head_config``
raises ``Fp32LmHeadConfigError`` unless

- the trainer's switch sits under the backend that trains: a switch under a disabled backend
  (``megatron_cfg.enabled: false``, or the other backend enabled) is an error naming the
  enabled one, since nothing would apply it;
- with Megatron's on, ``megatron_cfg.use_fused_linear_logprobs`` (``use_linear_ce_fusion_loss``
  before July 2026) is accepted: that path computes log-probs from the hidden states and the
  output weight and never calls the output layer, and the patched fused forward computes them at
  fp32 grade in the head's mode (``nemo_rl.fused``). Where this process has imported NeMo-RL's
  fused forward or its temperature scaling unpatched (an image patched before fp32patch knew
  the fused path), the combination is refused: it would compute bf16 logits;
- when generation runs vLLM (``generation.backend`` "vllm", or "dynamo", whose managed fleet is
  vLLM started with the same ``vllm_cfg``), vLLM's switch is on exactly when the trainer's is,
  unless ``policy.allow_one_sided_fp32_lm_head: true`` accepts one side alone (with a warning
  that quotes the measurement: bench/RESULTS.md, the agreement of two engines). Other backends
  (and no ``generation`` section) skip this rule. The two vLLM spellings, where both are given,
  must agree.

The env var is read as NeMo-RL passes it to the workers: ``str()`` of the YAML value (so ``1``
and ``0`` work, while YAML ``true`` becomes "True" and is refused). Missing sections are empty.

A key that looks like one of the switches but is not spelled as it (``fp32_lm_heads``,
``fp32LmHead`` or ``fp32_lm_head`` one level too high; a misspelt ``NRL_VLLM_FP32_LM_HEAD`` in
``env_vars``) is an error naming the right key: NeMo-RL keeps unknown keys without a word, so
a near miss would silently mean "off".

``check_config(cfg, where=...)`` is what NeMo-RL's patched files call: the same guard on the
master config or its ``policy`` section, as a dict or a pydantic model (NeMo-RL's
``MasterConfig`` is pydantic with ``extra="allow"``: it keeps a misspelt key without a word,
so this check is the one that sees it), plus ``megatron_cfg.fp32_residual_connection`` (a
boolean, not also set in ``megatron_cfg.model_overrides``); its messages name the caller, and
it logs the warnings (one side alone, the older vLLM spelling). Pure Python.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.config import (
    ONE_SIDED_EVIDENCE,
    closest,
    near_miss,
    plain,
    quoted_boolean,
    section,
    trainer_mode,
)
from fp32patch.runtime.kit.rollout import read_vllm_switch
from fp32patch.runtime.kit.stack import Stack
from fp32patch.runtime.modes import TRAINER_MODES, VLLM_ENV_VAR, VLLM_ON_VALUES, VLLM_SWITCHES

# The switches as NeMo-RL's messages name them.
MEGATRON_KEY = "policy.megatron_cfg.fp32_lm_head"
DTENSOR_KEY = "policy.dtensor_cfg.fp32_lm_head"
VLLM_KEY = "policy.generation.vllm_cfg.fp32_lm_head"
RESIDUAL = "fp32_residual_connection"
# The trainer backends NeMo-RL chooses between (lm_policy: Megatron if enabled, else DTensor).
TRAINER_SECTIONS: tuple[str, ...] = ("megatron_cfg", "dtensor_cfg")
BACKEND_NAMES = {"megatron_cfg": "Megatron", "dtensor_cfg": "DTensor"}
# The explicit opt-in to fp32 logits on one engine only, under policy.
ONE_SIDED_KEY = "allow_one_sided_fp32_lm_head"

# Generation backends that start vLLM with generation.vllm_cfg.
VLLM_BACKENDS = ("vllm", "dynamo")

STACK = Stack("NeMo-RL", "nemo_rl.fp32patch", key=MEGATRON_KEY)
logger = STACK.logger


@dataclass(frozen=True)
class Fp32LmHeadSettings:
    """What a valid config asks for.

    ``megatron`` / ``dtensor``: the mode to hand to that backend's ``apply_fp32_lm_head``
    (None: off). ``vllm``: the ``NRL_VLLM_FP32_LM_HEAD`` value vLLM's workers are to see (None:
    unset, or generation is not vLLM). ``one_sided``: the config gives fp32 logits to one
    engine only, accepted by ``policy.allow_one_sided_fp32_lm_head``. ``notes``: warnings for
    the log (not part of equality).
    """

    megatron: str | None
    vllm: str | None
    dtensor: str | None = None
    one_sided: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)
    # the trainer's section ("megatron_cfg", "dtensor_cfg"), where the config says which trains
    section: str | None = field(default=None, compare=False)

    @property
    def trainer(self) -> str | None:
        """The trainer's mode, whichever backend runs it (None: off)."""
        return self.megatron or self.dtensor

    @property
    def trainer_key(self) -> str:
        """The trainer's switch as the messages name it."""
        if self.dtensor is not None or (self.megatron is None and self.section == "dtensor_cfg"):
            return DTENSOR_KEY
        return MEGATRON_KEY

    @property
    def vllm_on(self) -> bool:
        return self.vllm in VLLM_ON_VALUES


def validate_fp32_lm_head_config(
    cfg: Mapping[str, Any], *, environ: Mapping[str, str] | None = None
) -> Fp32LmHeadSettings:
    """Check ``cfg`` (NeMo-RL's ``policy`` section, or a whole config holding one).

    ``environ`` stands for the driver's environment (default ``os.environ``); tests pass
    their own. Raises ``Fp32LmHeadConfigError`` naming the key and the valid values.
    """
    cfg, prefix = _policy(cfg)
    sections = {name: section(cfg, name, prefix) for name in TRAINER_SECTIONS}
    _refuse_near_misses(cfg, sections, prefix)
    modes = {name: _trainer_mode(section, name, prefix) for name, section in sections.items()}
    trainer = _trainer_section(sections, modes, prefix)
    if modes["megatron_cfg"] is not None:
        _check_fused_path_patched(sections["megatron_cfg"], prefix)
    mode = modes[trainer] if trainer is not None else None
    allow = _one_sided_allowed(cfg, prefix)
    settings = {"megatron": modes["megatron_cfg"], "dtensor": modes["dtensor_cfg"], "section": trainer}

    generation = section(cfg, "generation", prefix)
    if generation.get("backend") not in VLLM_BACKENDS:
        return Fp32LmHeadSettings(vllm=None, **settings)
    vllm, source, notes = _vllm_value(generation, prefix, os.environ if environ is None else environ)
    vllm_on = vllm in VLLM_ON_VALUES
    if (mode is not None) == vllm_on:
        return Fp32LmHeadSettings(vllm=vllm, notes=notes, **settings)
    # one engine alone
    key = f"{prefix}{trainer or 'megatron_cfg'}.fp32_lm_head"
    opt_in = f"{prefix}{ONE_SIDED_KEY}"
    if mode is not None:
        seen = "is not set" if vllm is None else f'is "{vllm}"'
        what = (
            f"{key} is {mode!r} but {source} {seen}: vLLM would still round its logits to bf16 "
            "(fp32 logits on the trainer only)"
        )
        fix = f"Set {prefix}generation.vllm_cfg.fp32_lm_head to true, or {key} to false"
    else:
        shown = "true" if source.endswith("vllm_cfg.fp32_lm_head") else f'"{vllm}"'
        what = f"{source} is {shown} but {key} is off: the trainer would still round its logits to bf16 (fp32 logits on vLLM only)"
        fix = f"Set {key} to one of {_quoted(TRAINER_MODES)} (or true), or turn vLLM's switch off"
    if not allow:
        raise Fp32LmHeadConfigError(
            f"{what}. One side alone is refused unless asked for: {ONE_SIDED_EVIDENCE}. {fix}; or, "
            f"to accept one side alone (e.g. a trainer fp32patch cannot wire), set {opt_in}: true"
        )
    warning = f"{what}, accepted by {opt_in}: {ONE_SIDED_EVIDENCE}. Compare a both-sides run if you can"
    return Fp32LmHeadSettings(vllm=vllm, one_sided=True, notes=(*notes, warning), **settings)


def _policy(cfg: Any) -> tuple[Mapping[str, Any], str]:
    """The policy section and the key prefix that leads to it."""
    if not isinstance(cfg, Mapping):
        raise Fp32LmHeadConfigError(f"expected the policy config as a mapping, got {type(cfg).__name__}")
    # A whole config was passed: validating its top level would silently find nothing.
    if "megatron_cfg" not in cfg and "generation" not in cfg and "policy" in cfg:
        return section(cfg, "policy", ""), "policy."
    return cfg, ""


def _trainer_mode(section: Mapping[str, Any], name: str, prefix: str) -> str | None:
    return trainer_mode(section.get("fp32_lm_head"), f"{prefix}{name}.fp32_lm_head")


def _enabled_backend(sections: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The section of the backend that trains, as NeMo-RL chooses it (None: the config does not say)."""
    megatron, dtensor = sections["megatron_cfg"], sections["dtensor_cfg"]
    if megatron.get("enabled"):
        return "megatron_cfg"
    if dtensor.get("enabled"):
        return "dtensor_cfg"
    return None


def _trainer_section(
    sections: Mapping[str, Mapping[str, Any]], modes: Mapping[str, str | None], prefix: str
) -> str | None:
    """The section whose switch is the trainer's (None: the config does not say); refuses a
    switch that nothing would apply."""
    enabled = _enabled_backend(sections)
    asked = [name for name in TRAINER_SECTIONS if modes[name] is not None]
    for name in asked:
        section = sections[name]
        if enabled is not None and name != enabled:
            raise Fp32LmHeadConfigError(
                f"{prefix}{name}.fp32_lm_head is on but the policy trains with {BACKEND_NAMES[enabled]} "
                f"({prefix}{enabled}.enabled is true), so nothing would apply it and the trainer's "
                f"logits would stay bf16. Move the switch to {prefix}{enabled}.fp32_lm_head"
            )
        if "enabled" in section and not section["enabled"]:
            raise Fp32LmHeadConfigError(
                f"{prefix}{name}.fp32_lm_head is on but {prefix}{name}.enabled is {section['enabled']!r}: the "
                f"policy does not train with {BACKEND_NAMES[name]}, so its logits would stay bf16. Set the "
                "switch of the backend that trains ("
                + " or ".join(f"{prefix}{n}.fp32_lm_head" for n in TRAINER_SECTIONS)
                + "), or set this one to false"
            )
    if len(asked) > 1:
        raise Fp32LmHeadConfigError(
            f"both {prefix}megatron_cfg.fp32_lm_head and {prefix}dtensor_cfg.fp32_lm_head are on, and the "
            "config does not say which backend trains: keep the switch of the enabled backend only"
        )
    if asked:
        return asked[0]
    megatron = sections["megatron_cfg"]
    if enabled is None and "enabled" in megatron and not megatron["enabled"]:
        return "dtensor_cfg"  # NeMo-RL's other trainer
    return enabled


# NeMo-RL's switch of its fused log-prob path (use_linear_ce_fusion_loss from 2026-03-19, renamed
# on 2026-07-04), and the modules of the path with the name fp32patch's gate defines in each
FUSED_KEYS = ("use_fused_linear_logprobs", "use_linear_ce_fusion_loss")
_FUSED_FILES = {
    "nemo_rl.distributed.model_utils": ("_gpt_forward_with_linear_ce_fusion", "_fp32patch_fused_logprobs"),
    "nemo_rl.models.megatron.train": ("apply_temperature_scaling", "_fp32patch_temperature_applied"),
}


def _check_fused_path_patched(megatron: Mapping[str, Any], prefix: str) -> None:
    """With the fp32 head on, NeMo-RL's fused log-prob path must be fp32patch's: refuse it where
    this process imported NeMo-RL's fused forward, or the temperature scaling after it, as
    upstream wrote them (its bf16 logits; the fused log-probs divided by the temperature)."""
    import sys

    key = next((k for k in FUSED_KEYS if megatron.get(k)), None)
    if key is None:
        return
    for name, (upstream, ours) in _FUSED_FILES.items():
        module = sys.modules.get(name)
        if module is None or not hasattr(module, upstream) or hasattr(module, ours):
            continue
        where = getattr(module, "__file__", name)
        raise Fp32LmHeadConfigError(
            f"{prefix}megatron_cfg.fp32_lm_head is on together with {prefix}megatron_cfg.{key}, but "
            f"NeMo-RL's fused log-prob path in {where} is not patched by fp32patch: it would compute bf16 "
            f"logits (and divide the log-probs, not the logits, by the temperature). Run fp32patch apply on "
            f"this NeMo-RL checkout, or set {prefix}megatron_cfg.{key} to false"
        )


def _one_sided_allowed(policy: Mapping[str, Any], prefix: str) -> bool:
    value = policy.get(ONE_SIDED_KEY, False)
    if value is None or isinstance(value, bool):
        return bool(value)
    hint = " (a quoted string is not a boolean)" if isinstance(value, str) else ""
    raise Fp32LmHeadConfigError(
        f"{prefix}{ONE_SIDED_KEY} = {value!r} is not valid{hint}: write true or false without quotes"
    )


MEGATRON_KEY_NAME = "fp32_lm_head"


def _refuse_near_misses(policy: Mapping[str, Any], sections: Mapping[str, Mapping[str, Any]], prefix: str) -> None:
    generation = policy.get("generation")
    vllm_cfg = generation.get("vllm_cfg") if isinstance(generation, Mapping) else None
    places = {**sections, "generation.vllm_cfg": vllm_cfg if isinstance(vllm_cfg, Mapping) else {}}
    for place, keys in places.items():
        right = f"{prefix}{place}.{MEGATRON_KEY_NAME}"
        for key in keys:
            if near_miss(key, MEGATRON_KEY_NAME):
                raise Fp32LmHeadConfigError(
                    f"{prefix}{place}.{key} is not a key fp32patch or NeMo-RL reads: did you mean "
                    f"{right}? NeMo-RL keeps unknown keys without a word, so this one would leave "
                    f"the logits in bf16. Rename it to {right}"
                )
    for key in policy:
        if key == ONE_SIDED_KEY:
            continue
        if key == MEGATRON_KEY_NAME or near_miss(key, MEGATRON_KEY_NAME):
            raise Fp32LmHeadConfigError(
                f"{prefix}{key} is in the wrong place: the switches are "
                + ", ".join(f"{prefix}{place}.{MEGATRON_KEY_NAME}" for place in places)
                + ", and NeMo-RL ignores this key without a word"
            )
    env_vars = vllm_cfg.get("env_vars") if isinstance(vllm_cfg, Mapping) else None
    for key in env_vars if isinstance(env_vars, Mapping) else ():
        meant = closest(key, [name for name in VLLM_SWITCHES if near_miss(key, name)])
        if meant is not None and key not in VLLM_SWITCHES:
            raise Fp32LmHeadConfigError(
                f"{prefix}generation.vllm_cfg.env_vars.{key} is not the variable vLLM's patched "
                f"files read: did you mean {meant}? Better, use "
                f"{prefix}generation.vllm_cfg.fp32_lm_head: true"
            )


# generation.vllm_cfg.fp32_lm_head -> the NRL_VLLM_FP32_LM_HEAD value it stands for. A boolean,
# as upstream NeMo-RL types it (its worker sets "1" for any true value), so that one YAML means
# the same on every checkout; the way ("copy") is chosen by the variable, where it may be.
# Upstream NeMo-RL (late 2026) also takes "tf32" there as an alias of true, for configs written
# for its first head; so does fp32patch, saying what vLLM runs then.
_VLLM_KEY_VALUES: dict[bool, str] = {True: "1", False: "0"}
_VLLM_KEY_TF32_ALIAS = "tf32"


def _vllm_value(
    generation: Mapping[str, Any], prefix: str, environ: Mapping[str, str]
) -> tuple[str | None, str, tuple[str, ...]]:
    """The value vLLM's workers will see for the switch, where it comes from, and notes for the log."""
    vllm_cfg = section(generation, "vllm_cfg", f"{prefix}generation.")
    env_vars = section(vllm_cfg, "env_vars", f"{prefix}generation.vllm_cfg.")
    key = f"{prefix}generation.vllm_cfg.fp32_lm_head"
    from_key = None
    key_notes: tuple[str, ...] = ()
    if vllm_cfg.get("fp32_lm_head") is not None:
        raw = vllm_cfg["fp32_lm_head"]
        if isinstance(raw, bool):
            from_key = _VLLM_KEY_VALUES[raw]
        elif raw == _VLLM_KEY_TF32_ALIAS:
            from_key = _VLLM_KEY_VALUES[True]
            key_notes = (
                f'{key} = "{_VLLM_KEY_TF32_ALIAS}" is read as true (upstream NeMo-RL\'s alias): vLLM gets '
                f"{VLLM_ENV_VAR}=1, fp32 logits from fp32patch's default way, not a TF32 GEMM; write true",
            )
        else:
            raise Fp32LmHeadConfigError(
                f'{key} = {raw!r} is not valid{quoted_boolean(raw)}; valid values: false, true, "{_VLLM_KEY_TF32_ALIAS}" '
                f'(an alias of true; the way, e.g. "copy", is {VLLM_ENV_VAR}\'s to choose)'
            )
    # the variable in env_vars, else (where the key is not set) in the driver's environment
    switch = read_vllm_switch(env_vars, f"{prefix}generation.vllm_cfg.env_vars", environ if from_key is None else {})
    if switch is None:
        return from_key, key, key_notes
    value, raw, source = switch.value, switch.raw, switch.source
    if from_key is None:
        notes: tuple[str, ...] = ()
        if source.startswith(prefix + "generation") and switch.name == VLLM_ENV_VAR:
            said = "false" if value == "0" else "true"
            way = f' (the key is a boolean; keep {switch.name}="{value}" beside it to choose that way)'
            notes = (
                f"{source} is the older spelling of vLLM's switch: NeMo-RL since 2026-08-31 reserves that "
                f"variable and refuses it in env_vars; write {key}: {said} instead (fp32patch accepts it "
                f"on every NeMo-RL checkout){way if value not in ('0', '1') else ''}",
            )
        return value, source, notes
    if (from_key in VLLM_ON_VALUES) != (value in VLLM_ON_VALUES):
        raise Fp32LmHeadConfigError(
            f"{key} = {vllm_cfg['fp32_lm_head']!r} and {source} = {raw!r} disagree: keep {key} and remove "
            f"{switch.name} from env_vars"
        )
    # both on: the variable may name the way ("copy") where the key says only true
    return (value if from_key == "1" else from_key), key, key_notes


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(f'"{v}"' for v in values)


# ---------------------------------------------------------------- what NeMo-RL's patched files call


# Whose head Megatron gets: fp32patch's (every mode), or upstream NeMo-RL's own after its
# September 2026 rework (the provider's logit_dtype), which fp32patch keeps rather than stack a
# second head on, and which takes upstream's values only.
MEGATRON_HEADS = ("fp32patch", "upstream")


def check_config(
    cfg: Any, *, where: str, environ: Mapping[str, str] | None = None, megatron_head: str = "fp32patch"
) -> Fp32LmHeadSettings:
    """Refuse a NeMo-RL config that would give fp32 logits to one engine only, or a bad value.

    ``cfg`` is the master config or its ``policy`` section: a dict, any Mapping, or a pydantic
    model. ``where`` names the caller in messages ("driver", "megatron worker rank 3").
    ``environ`` stands for this process's environment (default ``os.environ``).
    ``megatron_head``: "upstream" where the checkout gives Megatron upstream's own fp32 head (then
    fp32patch's mode names on Megatron are refused, saying why). Returns what the config asks
    for; raises ``Fp32LmHeadConfigError``.
    """
    if megatron_head not in MEGATRON_HEADS:
        raise ValueError(f"megatron_head must be one of {MEGATRON_HEADS}, not {megatron_head!r}")
    return STACK.guard(_rules, cfg, where=where, environ=environ, megatron_head=megatron_head)


def _rules(cfg: Any, *, environ: Mapping[str, str] | None, megatron_head: str) -> Fp32LmHeadSettings:
    """NeMo-RL's rules over the master config or its policy section, as ``check_config`` runs them."""
    policy = _policy_of(cfg)
    # Validated as part of a master config, so every message names the full YAML path.
    settings = validate_fp32_lm_head_config({"policy": policy}, environ=environ)
    _check_residual(policy)
    if megatron_head == "upstream":
        _check_upstream_megatron_head(policy, settings)
    return settings


def checked_settings(where: str = "driver") -> Fp32LmHeadSettings | None:
    """The settings ``check_config(..., where=where)`` last returned in this process, if any."""
    return STACK.verdict(where)


_CHECKED = STACK.verdicts


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


def _check_upstream_megatron_head(policy: Mapping[str, Any], settings: Fp32LmHeadSettings) -> None:
    """Megatron's switch where upstream's own head serves it: true, false or "tf32" only."""
    if settings.megatron is None:
        return
    value = policy["megatron_cfg"]["fp32_lm_head"]
    if value is None or isinstance(value, bool) or value == "tf32":
        return
    raise Fp32LmHeadConfigError(
        f"{MEGATRON_KEY} = {value!r} is one of fp32patch's modes, but on this NeMo-RL (after its "
        "September 2026 rework) Megatron's fp32 head is NeMo-RL's own (the model provider's "
        "logit_dtype: Megatron's fp32-output GEMM), switched by true or false (\"tf32\" is NeMo-RL's "
        "alias of true). fp32patch keeps that head rather than stack a second one on it, so its "
        "modes do not apply to Megatron here: write true (its backward, with bf16 grad_output, costs "
        "what fp32out-bf16grad costs). DTensor takes every mode"
    )


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
