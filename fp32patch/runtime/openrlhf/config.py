"""Refuse OpenRLHF runs that would give vLLM and the trainer different logits.

OpenRLHF's switch is one command-line flag of ``train_ppo_ray``, ``--fp32_lm_head MODE`` (the
patch adds it; a plain name, so it stays top-level in the nested namespace that 0.10.2+ builds
from dotted flags): false, true ("fp32"), or a trainer mode ("fp32out", recommended;
``modes.TRAINER_MODES``). It turns on, together:

- the trainer's head for the policy, the reference and the EMA model (OpenRLHF's ``Actor``s):
  the log-probs and the entropy through fp32patch's chunked piece, computed inside the head's own
  call (DeepSpeed ZeRO-3 has gathered its weight there), and full logits, where a caller asks for
  them, through fp32patch's HF head; both from the bf16 operands vLLM receives;
- vLLM's fp32 logits in every rollout engine: vLLM 0.26 and later by its own ``head_dtype``
  (the engine's ``hf_overrides``), earlier vLLM by fp32patch's vLLM patch and its variable in the
  engines' Ray ``runtime_env``; then every engine's workers are probed before the first rollout.

``validate_fp32_lm_head_config(args, environ=...)`` raises ``Fp32LmHeadConfigError`` unless

- vLLM generates the rollouts (``--vllm.num_engines`` / ``--vllm_num_engines`` > 0): the probe
  reaches its workers, no other rollout could be probed;
- the trainer's head is one fp32patch computes: not DeepSpeed's AutoTP (``--ds.tensor_parallel_size``
  / ``--ds_tensor_parallel_size`` > 1: its sharded head is not a plain linear), not 4-bit loading
  (``--ds.load_in_4bit`` / ``--load_in_4bit``), not a LoRA adapter on the head
  (``--ds.lora.target_modules`` / ``--target_modules`` naming ``lm_head``), and in bf16 (the dtype
  OpenRLHF's vLLM engines compute in);
- vLLM's switch in the driver's environment does not contradict the flag: an on value without
  it (one side alone), "0" with it;
- no key near the flag's name is set in the namespace (argparse already exits on an unknown flag;
  a namespace built by hand gets the same care).

The importance-sampling correction stays OpenRLHF's, in all three spellings of its flags
(``--enable_vllm_is_correction`` to 0.10.1.post2, ``--algo.advantage.is_correction_enable`` from
0.10.2, ``--algo.advantage.is_correction_level`` from 0.11.2): the startup line says whether it is
on. ``check_config`` is what the patched ``train_ppo_ray`` calls. Pure Python: no torch, no OpenRLHF.
"""

from __future__ import annotations

import os
from argparse import Namespace
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.config import ONE_SIDED_EVIDENCE, near_miss, trainer_mode
from fp32patch.runtime.kit.rollout import driver_switch_notes, read_vllm_switch
from fp32patch.runtime.kit.stack import Stack

NAME = "fp32_lm_head"  # the namespace's attribute
KEY = f"--{NAME}"  # the flag as users write it
STACK = Stack("OpenRLHF", "openrlhf.fp32patch", key=KEY)
logger = STACK.logger

# where the patched train_ppo_ray runs the guard; the driver's rollout side reads its verdict
GUARD = "train_ppo_ray"

# argparse hands the flag's value as written; booleans spelled as a command line spells them
_CLI_BOOLEANS = {
    **dict.fromkeys(("true", "yes", "t", "y", "1", "on"), True),
    **dict.fromkeys(("false", "no", "f", "n", "0", "off", ""), False),
}

# each setting the guard reads, as (0.10.2+'s dotted name, the flat name before it)
VLLM_ENGINES = ("vllm.num_engines", "vllm_num_engines")
AUTOTP = ("ds.tensor_parallel_size", "ds_tensor_parallel_size")
FOUR_BIT = ("ds.load_in_4bit", "load_in_4bit")
LORA_RANK = ("ds.lora.rank", "lora_rank")
LORA_TARGETS = ("ds.lora.target_modules", "target_modules")
PARAM_DTYPE = ("ds.param_dtype", "param_dtype")
TEMPERATURE = ("rollout.temperature", "temperature")
# the importance-sampling correction's switch in each of its three spellings, and how it reads "on"
IS_CORRECTION = (
    ("algo.advantage.is_correction_level", lambda v: v not in (None, "off")),  # 0.11.2
    ("algo.advantage.is_correction_enable", bool),  # 0.10.2 to 0.11.1
    ("enable_vllm_is_correction", bool),  # to 0.10.1.post2
)
_HEAD_NAMES = ("lm_head",)


@dataclass(frozen=True)
class OpenRLHFSettings:
    """What a valid ``train_ppo_ray`` namespace asks for.

    ``mode``: the actor's, the reference's and the EMA model's head (None: off). ``engines``: the
    number of vLLM engines. ``is_correction``: the importance-sampling flag that is on, as the user
    wrote it (None: off). ``notes``: lines for the log (not part of equality).
    """

    mode: str | None
    engines: int = 0
    is_correction: str | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)


def requested_mode(raw: Any) -> str | None:
    """The trainer mode ``--fp32_lm_head`` asks for (None: off), its command-line spellings of a
    boolean read as booleans; raises ``Fp32LmHeadConfigError`` naming the flag."""
    if isinstance(raw, str) and raw.strip().lower() in _CLI_BOOLEANS:
        raw = _CLI_BOOLEANS[raw.strip().lower()]
    return trainer_mode(raw, KEY)


def setting(args: Any, names: tuple[str, ...], default: Any = None) -> tuple[str | None, Any]:
    """``(flag, value)`` of the first of ``names`` the namespace holds (a dotted name through the
    nested namespaces 0.10.2+ builds, or as one flat attribute), else ``(None, default)``."""
    for name in names:
        found, node = True, args
        for part in name.split("."):
            if not hasattr(node, part):
                found = False
                break
            node = getattr(node, part)
        if not found and hasattr(args, name):  # an un-nested namespace with dotted attribute names
            found, node = True, getattr(args, name)
        if found:
            return f"--{name}", node
    return None, default


def validate_fp32_lm_head_config(args: Any, *, environ: Mapping[str, str] | None = None) -> OpenRLHFSettings:
    """Check ``train_ppo_ray``'s parsed arguments (any release's namespace, flat or nested);
    ``environ`` stands for the driver's environment (default ``os.environ``)."""
    _refuse_near_misses(args)
    mode = requested_mode(getattr(args, NAME, None))
    switch = read_vllm_switch(None, "", os.environ if environ is None else environ)
    flag, engines = setting(args, VLLM_ENGINES, 0)
    engines = int(engines or 0)
    correction = _is_correction(args)
    notes: list[str] = []

    if mode is None:
        if switch is not None and switch.on:
            raise Fp32LmHeadConfigError(
                f'{switch.source} is "{switch.value}" but {KEY} is off: vLLM would compute fp32 logits and the '
                f"trainer bf16 ones ({ONE_SIDED_EVIDENCE}). Pass {KEY} fp32out, which turns both on, and remove "
                f"{switch.name}"
            )
        return OpenRLHFSettings(mode=None, engines=engines, is_correction=correction)

    if engines <= 0:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} but no vLLM engine generates the rollouts ({flag or '--vllm.num_engines'} is "
            f"{engines}): fp32patch turns the fp32 head on in vLLM's engines and probes their workers at startup, "
            f"and no other rollout could be checked. Start vLLM engines, or drop {KEY}"
        )
    _refuse_unwired_heads(args, mode)
    notes += driver_switch_notes(
        switch, key=KEY, mode=mode, unit="engine", how="sets vLLM's fp32 head for every engine"
    )
    return OpenRLHFSettings(mode=mode, engines=engines, is_correction=correction, notes=tuple(notes))


def _refuse_unwired_heads(args: Any, mode: str) -> None:
    """AutoTP, 4-bit loading, a LoRA-adapted head and a non-bf16 trainer are refused."""
    flag, tp = setting(args, AUTOTP, 1)
    if int(tp or 1) > 1:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} with {flag} {tp}: DeepSpeed's AutoTP shards the head into its own linear layers, "
            f"which fp32patch's head does not compute, so the trainer's logits would stay bf16. Use ZeRO-3 (the "
            f"head is gathered there), or drop {KEY}"
        )
    flag, four_bit = setting(args, FOUR_BIT, False)
    if four_bit:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} with {flag}: a 4-bit model computes from other weights than the bf16 ones vLLM "
            f"receives, so the two engines' logits would differ by more than the head's rounding. Load in bf16, "
            f"or drop {KEY}"
        )
    _, rank = setting(args, LORA_RANK, 0)
    flag, targets = setting(args, LORA_TARGETS, None)
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    adapted = [t for t in targets if any(name in str(t) for name in _HEAD_NAMES)]
    if int(rank or 0) > 0 and adapted:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} with a LoRA adapter on the head ({flag} {' '.join(map(str, adapted))}): the "
            f"adapter adds a term fp32patch's head would drop. Keep the head out of the target modules "
            f"(all-linear leaves it out), or drop {KEY}"
        )
    flag, dtype = setting(args, PARAM_DTYPE, "bf16")
    if dtype not in (None, "bf16", "bfloat16"):
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} with {flag} {dtype}: OpenRLHF's vLLM engines compute in bf16, so the two "
            f"engines' operands would differ before the head. Use bf16, or drop {KEY}"
        )


def _is_correction(args: Any) -> str | None:
    """The importance-sampling flag that is on, in the spelling this release uses (None: off)."""
    for name, on in IS_CORRECTION:
        flag, value = setting(args, (name,))
        if flag is None:
            continue
        if not on(value):
            return None
        return flag if isinstance(value, bool) else f"{flag} {value}"
    return None


def _refuse_near_misses(args: Any, prefix: str = "") -> None:
    """A key near ``fp32_lm_head`` anywhere in the namespace (``--ds.fp32_lm_head``, ``fp32-lm-head``)."""
    for key, value in vars(args).items():
        if near_miss(key, NAME) or (prefix and key == NAME):
            raise Fp32LmHeadConfigError(
                f"--{prefix}{key} is not fp32patch's flag: write {KEY} (a plain name, not under a section)"
            )
        if isinstance(value, (SimpleNamespace, Namespace)):
            _refuse_near_misses(value, f"{prefix}{key}.")


def check_config(args: Any, *, where: str = GUARD, environ: Mapping[str, str] | None = None) -> OpenRLHFSettings:
    """What the patched ``train_ppo_ray`` calls on its parsed arguments: refuses what cannot give
    both engines the same logits (``Fp32LmHeadConfigError``, naming ``where``), logs the notes and
    one line saying what runs; the verdict stays for this driver's rollout side."""
    settings = STACK.guard(validate_fp32_lm_head_config, args, where=where, environ=environ)
    if settings.mode is not None:
        correction = f"on ({settings.is_correction})" if settings.is_correction else "off"
        logger.info(
            "fp32patch (%s): fp32 LM head %r for the actor, the reference and the EMA model (chunked log-probs), "
            "and in %d vLLM engine(s), probed at startup; OpenRLHF's importance-sampling correction is %s",
            where,
            settings.mode,
            settings.engines,
            correction,
        )
    return settings
