"""Refuse AReaL configs that would give the rollout and the trainer different logits.

AReaL's switch is one key, ``enable_fp32_lm_head``, in the section of the actor's trainer backend:
``actor.megatron.enable_fp32_lm_head`` (AReaL's own key in its repository's 2.0 line, an IEEE fp32
GEMM on the trainer alone; the patch adds it to 1.0.4) or ``actor.fsdp.enable_fp32_lm_head`` (the
patch adds it to both). A boolean, as AReaL types it: true means fp32patch's ``fp32out`` (bf16
operands, fp32 logits, at about the bf16 head's cost). It turns on, together: the actor's and the
reference model's LM head (Megatron: ``heads.megatron``; FSDP: ``heads.hf``, after FSDP2 wraps the
model; AReaL's log-prob code then reads fp32 logits), and the rollout's: SGLang's own
``enable_fp32_lm_head`` in every server's arguments, or vLLM's fp32 head (``head_dtype`` on 0.26+,
else fp32patch's vLLM patch and its variable in the rollout workers' ``env_vars``), each server
probed once the single controller has started it.

``validate_fp32_lm_head_config(config)`` raises ``Fp32LmHeadConfigError`` unless

- the key is on in the actor's own backend section, or nowhere (the key in another section, or
  on for the reference model or the critic alone, would change nothing or one side only);
- the trainer is FSDP or Megatron (Archon is refused by name: fp32patch does not wire its
  model), in bf16 or fp16, and a Megatron actor does not use AReaL's CUDA-only chunked-logits head
  (``enable_chunked_logits``, which computes its own output);
- the rollout is SGLang or vLLM started by the single controller (``scheduler.type=local`` and
  the other schedulers; the deprecated SPMD launchers start the servers in processes the patch
  does not reach), and SGLang's own settings do not undo its flag (``kit.sglang``);
- with the key off, vLLM's switch is not on in this process, nor SGLang's own fp32 switches (a model
  family's variable, a model config's switch): the rollout fp32, the trainer bf16.

Notes, not refusals: no rollout backend (SFT, a trainer alone), a critic (its value head stays), a
teacher (its servers keep their logits). ``wiring.check_config`` runs these rules where the patched
``load_expr_config`` calls it. Pure Python: no torch, no AReaL.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.config import ONE_SIDED_EVIDENCE
from fp32patch.runtime.kit.stack import Stack

KEY_NAME = "enable_fp32_lm_head"
# the trainer backends whose config section can hold the key, and those fp32patch wires
SECTIONS: tuple[str, ...] = ("megatron", "fsdp", "archon")
WIRED_TRAINERS: tuple[str, ...] = ("fsdp", "megatron")
ROLLOUTS: tuple[str, ...] = ("sglang", "vllm")
ENGINES: tuple[str, ...] = ("actor", "ref", "critic")
# AReaL's key is a boolean; on, the trainer's head runs fp32patch's fp32-output GEMM
MODE = "fp32out"
LOW_PRECISION = ("bfloat16", "float16", "bf16", "fp16")

STACK = Stack("AReaL", "areal.fp32patch", key=f"actor.<backend>.{KEY_NAME}")


@dataclass(frozen=True)
class ArealSettings:
    """What a valid AReaL config asks for.

    ``mode``: the trainer's head (None: off). ``trainer``: the actor's backend (``fsdp``,
    ``megatron``). ``rollout``: ``sglang``, ``vllm`` or None (no rollout in this config).
    ``key``: the switch as the config spells it (``actor.megatron.enable_fp32_lm_head``).
    ``ref``: the reference model's section that follows the actor (None: no reference model).
    ``notes``: lines for the log (not part of equality).
    """

    mode: str | None
    trainer: str | None = None
    rollout: str | None = None
    key: str | None = None
    ref: str | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)


def get(obj: Any, name: str, default: Any = None) -> Any:
    """``obj.name`` or ``obj[name]`` (AReaL's dataclasses, OmegaConf's DictConfig, a dict)."""
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def backend_of(spec: Any) -> str | None:
    """The backend an AReaL ``backend`` string names (``"megatron:d4t2"`` -> ``"megatron"``), None
    where there is none (unset, OmegaConf's ``???``)."""
    if not isinstance(spec, str) or ":" not in spec:
        return None
    return spec.split(":", 1)[0].strip().lower() or None


def allocation_backends(config: Any) -> tuple[str | None, str | None]:
    """(the actor's trainer backend, the rollout's backend) as the config names them: each engine's
    ``backend`` field, else the deprecated top-level ``allocation_mode`` (``"sglang:d4+fsdp:d4"``)."""
    trainer = backend_of(get(get(config, "actor"), "backend"))
    rollout = backend_of(get(get(config, "rollout"), "backend"))
    legacy = get(config, "allocation_mode")
    if isinstance(legacy, str):
        for part in legacy.split("+"):
            name = backend_of(part.strip())
            if name in ROLLOUTS and rollout is None:
                rollout = name
            elif name in SECTIONS and trainer is None:
                trainer = name
    return trainer, rollout


def keys_on(config: Any) -> list[str]:
    """Every ``<engine>.<section>.enable_fp32_lm_head`` that is true in ``config``."""
    found = []
    for engine in ENGINES:
        for section in SECTIONS:
            value = get(get(get(config, engine), section), KEY_NAME, False)
            if value is not False and value is not None:
                if value is not True:
                    raise Fp32LmHeadConfigError(
                        f"{engine}.{section}.{KEY_NAME} = {value!r} is not valid; AReaL's key is a boolean: true or false"
                    )
                found.append(f"{engine}.{section}.{KEY_NAME}")
    return found


def vllm_switch_on(environ: Mapping[str, str]) -> str | None:
    """The name of vLLM's switch where it is on in ``environ``, else None."""
    from fp32patch.runtime.modes import VLLM_OFF_VALUES, vllm_switch

    try:
        found = vllm_switch(environ)
    except ValueError as exc:
        raise Fp32LmHeadConfigError(f"{exc} (in the environment)") from None
    if found is None or found[1] in VLLM_OFF_VALUES:
        return None
    return f"{found[0]}={found[1]!r}"


def validate_fp32_lm_head_config(config: Any, *, environ: Mapping[str, str] | None = None) -> ArealSettings:
    """Check AReaL's loaded experiment config (its dataclass, or a mapping of the same shape) and
    this process's environment (``environ``, default ``os.environ``)."""
    environ = os.environ if environ is None else environ
    on = keys_on(config)
    trainer, rollout = allocation_backends(config)
    key = f"actor.{trainer}.{KEY_NAME}" if trainer else f"actor.<backend>.{KEY_NAME}"
    actor_keys = [k for k in on if k.startswith("actor.")]

    if not actor_keys:
        others = [k for k in on if not k.startswith("actor.")]
        if others:
            raise Fp32LmHeadConfigError(
                f"{others[0]} is true but {key} is not: the {others[0].split('.')[0]} model would compute fp32 "
                f"logits and the actor bf16 ones. Set {key}, which turns the trainer, its reference model and the "
                f"rollout on together, and drop {others[0]}"
            )
        switch = vllm_switch_on(environ)
        if switch is not None:
            raise Fp32LmHeadConfigError(
                f"vLLM's switch {switch} is on in this process but {key} is off: the rollout would compute fp32 "
                f"logits and the trainer bf16 ones ({ONE_SIDED_EVIDENCE}). Set {key} instead of the variable"
            )
        if rollout == "sglang":
            _sglang_alone(config, key, environ)  # a model family's variable: SGLang fp32 alone
        return ArealSettings(mode=None, trainer=trainer, rollout=rollout, key=key)

    if trainer == "archon":
        raise Fp32LmHeadConfigError(
            f"{actor_keys[0]} is true but the actor's backend is Archon: fp32patch does not wire Archon's model, so "
            "its logits would stay bf16 while the rollout's became fp32. Use actor.backend fsdp:... or megatron:..., "
            f"or set {actor_keys[0]} to false"
        )
    if trainer not in WIRED_TRAINERS:
        raise Fp32LmHeadConfigError(
            f"{actor_keys[0]} is true but the actor's backend is {trainer!r}: fp32patch wires FSDP and Megatron "
            "actors only (actor.backend fsdp:... or megatron:...)"
        )
    if actor_keys != [key]:
        wrong = next(k for k in actor_keys if k != key)
        raise Fp32LmHeadConfigError(
            f"{wrong} is true but the actor's backend is {trainer} (actor.backend "
            f"{get(get(config, 'actor'), 'backend')!r}): that section's key would change nothing. Set {key} instead"
        )
    actor = get(config, "actor")
    dtype = str(get(actor, "dtype", "bfloat16")).removeprefix("torch.")
    if dtype not in LOW_PRECISION:
        raise Fp32LmHeadConfigError(
            f"{key} is true but actor.dtype is {dtype!r}: an fp32 trainer computes fp32 logits already, from "
            "weights the rollout's bf16 head does not have; the key is for a bf16 or fp16 trainer"
        )
    if trainer == "megatron" and get(get(actor, "megatron"), "enable_chunked_logits", False):
        raise Fp32LmHeadConfigError(
            f"{key} is true with actor.megatron.enable_chunked_logits: AReaL's CUDA-only chunked-logits head "
            "replaces Megatron's output layer and computes its own output, which fp32patch does not wire. Set "
            "actor.megatron.enable_chunked_logits to false, or the key to false"
        )
    notes: list[str] = []
    if rollout is None:
        notes.append(f"{key} with no rollout backend in this config: the trainer's logits are fp32, nothing else")
    elif rollout not in ROLLOUTS:
        raise Fp32LmHeadConfigError(
            f"{key} is true but the rollout's backend is {rollout!r}: fp32patch turns on SGLang's and vLLM's heads"
        )
    elif _spmd(environ):
        raise Fp32LmHeadConfigError(
            f"{key} is true under AReaL's SPMD launchers (AREAL_SPMD_MODE is set): they start the {rollout} servers "
            "in processes fp32patch does not reach, so their logits would stay bf16. Run the single controller "
            "(python3 train.py ... scheduler.type=local, or ray/slurm), which AReaL recommends"
        )
    elif rollout == "sglang":
        notes.extend(_sglang_notes(config, key))
    ref_section = None
    ref = get(config, "ref")
    if ref is not None:
        ref_trainer = backend_of(get(ref, "backend")) or trainer
        if ref_trainer not in WIRED_TRAINERS:
            raise Fp32LmHeadConfigError(
                f"{key} is true but the reference model's backend is {ref_trainer!r}: fp32patch cannot give it fp32 "
                "logits, and its log-probs would be bf16 beside the actor's fp32 ones. Use fsdp or megatron for ref"
            )
        ref_section = f"ref.{ref_trainer}.{KEY_NAME}"
    if get(config, "critic") is not None:
        notes.append(f"the critic keeps its value head ({key} applies to the actor's and the reference's LM heads)")
    if get(config, "teacher") is not None:
        notes.append(f"the teacher's rollout servers keep their own logits ({key} applies to the actor's rollout)")
    return ArealSettings(mode=MODE, trainer=trainer, rollout=rollout, key=key, ref=ref_section, notes=tuple(notes))


def put(obj: Any, name: str, value: Any) -> None:
    """``obj.name = value`` or ``obj[name] = value`` (the shapes ``get`` reads)."""
    if isinstance(obj, dict):
        obj[name] = value
    else:
        setattr(obj, name, value)


def _spmd(environ: Mapping[str, str]) -> bool:
    return str(environ.get("AREAL_SPMD_MODE", "")).strip().lower() in ("1", "true", "yes", "on")


def sglang_config_args(config: Any) -> dict[str, Any]:
    """AReaL's ``sglang`` section as SGLang's server arguments (the fields AReaL hands on)."""
    section = get(config, "sglang")
    if section is None:
        return {}
    if dataclasses.is_dataclass(section):
        return dataclasses.asdict(section)
    return dict(section) if isinstance(section, Mapping) else dict(vars(section))


def _sglang_notes(config: Any, key: str) -> list[str]:
    """SGLang's settings in the ``sglang`` section that undo or skip its flag (``kit.sglang``)."""
    from fp32patch.runtime.kit import sglang

    args = {**sglang_config_args(config), sglang.SGLANG_SWITCH: True}
    try:
        return sglang.check_server_args(args, on=True, where="sglang", key=key)
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(str(exc).removeprefix("fp32patch (sglang): ")) from None


def _sglang_alone(config: Any, key: str, environ: Mapping[str, str]) -> None:
    """With the key off: SGLang's own switches that would make its logits fp32 alone (``kit.sglang``:
    a model family's variable in this process, a model config's switch), refused."""
    from fp32patch.runtime.kit import sglang

    try:
        sglang.check_server_args(sglang_config_args(config), on=False, where="sglang", key=key, environ=environ)
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(str(exc).removeprefix("fp32patch (sglang): ")) from None
