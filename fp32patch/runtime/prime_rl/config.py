"""Refuse Prime-RL configs that would give vLLM and the trainer different logits.

Prime-RL's switch is its own: ``inference.enable_fp32_lm_head`` (default true), which its vLLM
worker extension turns into ``torch.mm(..., out_dtype=float32)`` in vLLM's ``LogitsProcessor``.
The patch adds the trainer's side, ``trainer.model.fp32_lm_head``: unset, it follows
Prime-RL's switch; ``false``; ``true`` (``fp32out``, the product Prime-RL's vLLM patch computes)
or one of fp32patch's modes (``modes.py``).

``validate_rl_config(config)`` (the rl launcher's ``RLConfig``, all three sections) returns
the trainer's mode and raises ``Fp32LmHeadConfigError`` when

- ``trainer.model.fp32_lm_head`` says one thing and ``inference.enable_fp32_lm_head`` the
  other (one side alone);
- vLLM computes fp32 by another route while Prime-RL's switch is off: fp32patch's vLLM variable
  (``FP32PATCH_VLLM_LM_HEAD`` / ``NRL_VLLM_FP32_LM_HEAD``, in the environment or an ``env_vars``)
  or vLLM's own ``head_dtype`` in ``inference.vllm``;
- the trainer's head would not be the one fp32patch computes: quantized (``trainer.model.
  quantization`` whose ``ignore_patterns`` leave ``lm_head`` out) or LoRA-adapted
  (``trainer.model.lora.target_modules`` matching ``lm_head`` as Prime-RL matches them).

``validate_trainer_config(config)`` (the RL trainer's own ``TrainerConfig``, as a trainer
started alone reads it) resolves an unset key to Prime-RL's default (``fp32out``, since the
rollout's switch defaults to true; a note says so) and refuses the same trainer hazards.

Notes, not refusals: no ``[inference]`` section (servers started by hand: the trainer follows
the switch's default, and the servers' own probe holds them to their switch), vLLM's LoRA
(the probe measures what the adapted workers compute), the vLLM variable set as well as
Prime-RL's switch (Prime-RL's monkey-patch computes those logits). Pure Python: no torch, no
Prime-RL, no vLLM.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.config import ONE_SIDED_EVIDENCE, plain, section, trainer_mode
from fp32patch.runtime.kit.stack import Stack
from fp32patch.runtime.modes import VLLM_SWITCHES

KEY = "inference.enable_fp32_lm_head"
TRAINER_KEY = "trainer.model.fp32_lm_head"
# what true means on the trainer: the product Prime-RL's vLLM patch computes (bf16 operands, fp32 output)
DEFAULT_MODE = "fp32out"
# the spellings of a boolean a command line or an environment hands over as a string
_STRING_BOOLEANS = {**dict.fromkeys(("true", "yes", "1", "on"), True), **dict.fromkeys(("false", "no", "0", "off", ""), False)}  # fmt: skip

STACK = Stack("Prime-RL", "prime_rl.fp32patch", key=KEY)
logger = STACK.logger


@dataclass(frozen=True)
class PrimeRlSettings:
    """What a valid Prime-RL config asks for.

    ``mode``: the trainer's head (None: Prime-RL's bf16 head). ``rollout``: whether the vLLM
    workers compute fp32 logits (Prime-RL's switch; None: no ``[inference]`` section here).
    ``notes``: lines for the log (not part of equality).
    """

    mode: str | None
    rollout: bool | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)


def requested_mode(raw: Any, key: str = TRAINER_KEY) -> str | None:
    """The trainer mode ``raw`` asks for (None: off): ``true`` is ``fp32out``, strings of booleans
    are read as booleans; raises ``Fp32LmHeadConfigError`` naming ``key`` and the valid values."""
    if isinstance(raw, str) and raw.strip().lower() in _STRING_BOOLEANS:
        raw = _STRING_BOOLEANS[raw.strip().lower()]
    if raw is True:
        return DEFAULT_MODE
    return trainer_mode(raw, key)


def validate_rl_config(config: Any, *, environ: Mapping[str, str] | None = None) -> PrimeRlSettings:
    """Check the rl launcher's config (``RLConfig`` or its dict); ``environ``: the launcher's
    environment (default ``os.environ``), under the configs' ``env_vars``."""
    data = plain(config)
    trainer = section(data, "trainer", "")
    model = section(trainer, "model", "trainer.")
    raw = model.get("fp32_lm_head")
    inference = data.get("inference")
    notes: list[str] = []
    if inference is None:
        mode = requested_mode(raw) if raw is not None else DEFAULT_MODE
        if raw is None:
            notes.append(_follows_default())
        notes.append(
            "no [inference] section: the rl launcher starts no vLLM server, so it cannot hold one to the trainer; "
            f"start yours with {KEY} = {'true' if mode else 'false'} (each server's probe holds its workers to "
            "its own switch)"
        )
        return PrimeRlSettings(mode=mode, rollout=None, notes=tuple(notes + _trainer_hazards(model, mode)))
    inference = section(data, "inference", "")
    rollout = bool(inference.get("enable_fp32_lm_head", True))
    if raw is None:
        mode = DEFAULT_MODE if rollout else None
    else:
        mode = requested_mode(raw)
        if (mode is not None) != rollout:
            trainer_side, vllm_side = ("fp32", "bf16") if mode is not None else ("bf16", "fp32")
            raise Fp32LmHeadConfigError(
                f"{TRAINER_KEY} = {raw!r} but {KEY} = {str(rollout).lower()}: the trainer would compute "
                f"{trainer_side} logits and vLLM {vllm_side} ones ({ONE_SIDED_EVIDENCE}). Leave {TRAINER_KEY} "
                f"unset (it follows {KEY}), or set both sides alike"
            )
    env = {**(environ if environ is not None else os.environ), **_env(data), **_env(inference)}
    notes += _rollout_hazards(inference, env, rollout)
    notes += _trainer_hazards(model, mode)
    return PrimeRlSettings(mode=mode, rollout=rollout, notes=tuple(notes))


def validate_trainer_config(config: Any) -> PrimeRlSettings:
    """Check the RL trainer's own config (``TrainerConfig`` or its dict), as a trainer reads it."""
    data = plain(config)
    model = section(data, "model", "")
    raw = model.get("fp32_lm_head")
    mode = requested_mode(raw) if raw is not None else DEFAULT_MODE
    notes = [_follows_default()] if raw is None else []
    return PrimeRlSettings(mode=mode, notes=tuple(notes + _trainer_hazards(model, mode)))


def _follows_default() -> str:
    return (
        f"{TRAINER_KEY} is unset: it follows {KEY}, whose default is true, so the trainer's LM head is "
        f"{DEFAULT_MODE}; if your vLLM servers run with {KEY} = false, set {TRAINER_KEY} = false"
    )


def _env(section_data: Mapping[str, Any]) -> dict[str, str]:
    value = section_data.get("env_vars")
    return {str(k): str(v) for k, v in value.items()} if isinstance(value, Mapping) else {}


def _rollout_hazards(inference: Mapping[str, Any], env: Mapping[str, str], rollout: bool) -> list[str]:
    """What makes vLLM's logits differ from what Prime-RL's switch says: another route to fp32."""
    vllm = section(inference, "vllm", "inference.")
    notes: list[str] = []
    switches = {name: env[name] for name in VLLM_SWITCHES if str(env.get(name, "")).strip() not in ("", "0")}
    if switches:
        shown = ", ".join(f"{name}={value!r}" for name, value in switches.items())
        if not rollout:
            raise Fp32LmHeadConfigError(
                f"{shown} turns fp32patch's vLLM head on while {KEY} = false: vLLM would compute fp32 logits and the "
                f"trainer bf16 ones ({ONE_SIDED_EVIDENCE}). Unset it, or set {KEY} = true (Prime-RL's own switch, "
                "which turns both sides on)"
            )
        notes.append(
            f"{shown} is set as well as {KEY}: Prime-RL's monkey-patch computes vLLM's logits (fp32, bf16 operands); "
            "the variable is not needed"
        )
    head_dtype = vllm.get("head_dtype")
    if head_dtype is not None and str(head_dtype).removeprefix("torch.") in ("float32", "fp32") and not rollout:
        raise Fp32LmHeadConfigError(
            f"inference.vllm.head_dtype = {head_dtype!r} computes vLLM's head in fp32 while {KEY} = false: the "
            f"trainer's logits would stay bf16. Drop head_dtype, or set {KEY} = true"
        )
    if rollout and vllm.get("enable_lora"):
        notes.append(
            "vLLM's LoRA is on (inference.vllm.enable_lora): the startup probe measures the adapted workers' logits "
            "and refuses to serve if they are not fp32"
        )
    return notes


def _trainer_hazards(model: Mapping[str, Any], mode: str | None) -> list[str]:
    """Refuse a trainer head fp32patch would not compute: a quantized or a LoRA-adapted one."""
    if mode is None:
        return []
    quantization = model.get("quantization")
    if isinstance(quantization, Mapping):
        patterns = quantization.get("ignore_patterns")
        if isinstance(patterns, (list, tuple)) and not any(_searches(p, "lm_head") for p in patterns):
            raise Fp32LmHeadConfigError(
                f"{TRAINER_KEY} = {mode!r} but trainer.model.quantization ({quantization.get('type')}) quantizes "
                f"lm_head (its ignore_patterns {list(patterns)} leave it out): a quantized head cannot give the fp32 "
                'logits vLLM computes. Add "lm_head" to ignore_patterns, or turn the fp32 head off on both sides '
                f"({KEY} = false)"
            )
    lora = model.get("lora")
    if isinstance(lora, Mapping):
        targets = [str(p) for p in lora.get("target_modules") or ()]
        hit = [p for p in targets if _lora_matches("lm_head", p)]
        if hit:
            raise Fp32LmHeadConfigError(
                f"{TRAINER_KEY} = {mode!r} but trainer.model.lora.target_modules {hit} adapt lm_head: a LoRA term on "
                "the head is not computed by fp32patch's head. Keep lm_head out of target_modules (modules_to_save "
                f"trains it in full), or turn the fp32 head off on both sides ({KEY} = false)"
            )
    return []


# Prime-RL's LoRA tells a plain name from a regex by these characters (a plain name matches a
# component of the module's dotted name; a regex is searched anywhere in it)
_REGEX_CHARACTERS = set(".*+?^$[]{}()|\\")


def _lora_matches(name: str, pattern: str) -> bool:
    if any(ch in _REGEX_CHARACTERS for ch in pattern):
        return _searches(pattern, name)
    return pattern in name.split(".")


def _searches(pattern: Any, name: str) -> bool:
    try:
        return re.search(str(pattern), name) is not None
    except re.error:
        return False
