"""Refuse TRL configs that would give vLLM and the trainer different logits.

TRL's switch is one field of every TRL config, ``fp32_lm_head`` (the patch adds it to
``_BaseConfig``, which GRPOConfig, RLOOConfig and every other TRL config derive from): false,
true ("fp32"), or a trainer mode ("fp32out", recommended; ``modes.TRAINER_MODES``). On the
command line TRL hands it as a string, so ``--fp32_lm_head true`` and ``false`` read as its
booleans do. It turns on, together:

- the trainer's head for the policy and the reference model: TRL 1.15+'s chunked log-probs
  through fp32patch's chunked piece (``kernels.chunked_logprobs``), earlier releases' full logits
  through the PyTorch/HF head (``heads.hf``), each from the bf16 operands vLLM gets (under TRL's
  bf16 autocast, the autocast copy of the fp32 master weights);
- vLLM's fp32 logits: colocated, vLLM's switch in the trainer's process before ``LLM(...)`` is
  built, and the model probed in place; a server (``trl vllm-serve --fp32_lm_head ...``), its
  workers probed over HTTP at startup.

``validate_fp32_lm_head_config(config, trainer=..., path=...)`` raises
``Fp32LmHeadConfigError`` unless

- the trainer is one the patch wires (GRPO, RLOO and their subclasses): another trainer's head
  nobody wires would stay bf16;
- ``cast_lm_head_to_fp32`` is not set with it: TRL's cast computes the head from the fp32
  master weights, a function vLLM never computes, while the switch computes it from the bf16
  weights vLLM receives (``cast_lm_head_to_fp32`` alone is accepted, as stock TRL runs it, with a
  warning that it is one-sided);
- the trainer computes in bf16 or fp16 somewhere (``bf16``, ``fp16``, or bf16/fp16 weights): in
  fp32 throughout its logits are fp32 already, from other values than vLLM's;
- the log-probs come from a path fp32patch routes: before TRL 1.15 ``use_liger_kernel`` makes
  GRPO compute them from ``lm_head.weight`` in bf16 tiles (Liger's GRPO loss to 1.13, TRL's
  chunked path in 1.14);
- vLLM's switch in the trainer's environment does not contradict it where vLLM runs in that
  process (colocate): "0" with the switch on, an on value with the switch off.

Without vLLM (``use_vllm`` false) the switch gives the trainer's side alone (a note says so).
``check_config`` is what the patched trainer calls. Pure Python: no torch, no TRL.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.config import ONE_SIDED_EVIDENCE, trainer_mode
from fp32patch.runtime.kit.rollout import read_vllm_switch
from fp32patch.runtime.kit.stack import Stack
from fp32patch.runtime.modes import VLLM_OFF_VALUES, VLLM_ON_VALUES

KEY = "fp32_lm_head"
STACK = Stack("TRL", "trl.fp32patch", key=KEY)
logger = STACK.logger

# TRL trainers whose log-prob paths and vLLM rollout the patch wires (and their subclasses)
WIRED_TRAINERS: tuple[str, ...] = ("GRPOTrainer", "RLOOTrainer")
# the trainer's log-prob path, as the patched release has it: TRL 1.15+'s chunked log-probs
# from the head's weight, or the full logits of the head module (1.12 to 1.14)
PATHS: tuple[str, ...] = ("fused", "logits")
VLLM_MODES: tuple[str, ...] = ("colocate", "server")
# TRL's command line (transformers' HfArgumentParser) hands a str field's value as written; its
# booleans are spelled as its string_to_bool reads them
_CLI_BOOLEANS = {
    **dict.fromkeys(("true", "yes", "t", "y", "1"), True),
    **dict.fromkeys(("false", "no", "f", "n", "0", ""), False),
}
_LOW_PRECISION = ("bfloat16", "float16")


@dataclass(frozen=True)
class TrlSettings:
    """What a valid TRL config asks for.

    ``mode``: the policy's and the reference model's head (None: off). ``trainer``: the wired TRL
    trainer it runs as. ``path``: the trainer's log-prob path (``PATHS``). ``rollout``: vLLM's mode
    (None: no vLLM). ``vllm``: the switch's value a colocated vLLM gets (None: not colocated, or
    off). ``notes``: lines for the log (not part of equality).
    """

    mode: str | None
    trainer: str | None = None
    path: str | None = None
    rollout: str | None = None
    vllm: str | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)


def requested_mode(raw: Any) -> str | None:
    """The trainer mode ``fp32_lm_head`` asks for (None: off), its command-line spellings of a
    boolean read as TRL reads them; raises ``Fp32LmHeadConfigError`` naming the key."""
    if isinstance(raw, str) and raw.strip().lower() in _CLI_BOOLEANS:
        raw = _CLI_BOOLEANS[raw.strip().lower()]
    return trainer_mode(raw, KEY)


def wired_trainer(trainer: Any) -> str | None:
    """The TRL trainer among ``trainer``'s classes (a class or an instance) that the patch wires."""
    cls = trainer if isinstance(trainer, type) else type(trainer)
    for base in cls.__mro__:
        if base.__name__ in WIRED_TRAINERS and base.__module__.split(".")[0] == "trl":
            return base.__name__
    return None


def validate_fp32_lm_head_config(
    config: Any,
    *,
    trainer: Any,
    path: str,
    model_dtype: Any = None,
    environ: Mapping[str, str] | None = None,
) -> TrlSettings:
    """Check a TRL trainer's config (its ``TrainingArguments`` subclass, or anything with the same
    attributes) for ``trainer`` (its class or an instance), whose release computes log-probs
    along ``path``. ``model_dtype``: the policy's weights' dtype (a ``torch.dtype`` or its name);
    ``environ`` stands for the trainer's environment (default ``os.environ``)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, not {path!r}")
    mode = requested_mode(getattr(config, KEY, None))
    cast = bool(getattr(config, "cast_lm_head_to_fp32", False))
    rollout = getattr(config, "vllm_mode", "colocate") if getattr(config, "use_vllm", False) else None
    switch = read_vllm_switch(None, "", os.environ if environ is None else environ)
    notes: list[str] = []

    if mode is None:
        if switch is not None and switch.on and rollout == "colocate":
            raise Fp32LmHeadConfigError(
                f'{switch.source} is "{switch.value}" but {KEY} is off: the colocated vLLM would compute fp32 '
                f"logits and the trainer bf16 ones ({ONE_SIDED_EVIDENCE}). Set {KEY} (e.g. fp32out), which "
                f"turns both on, and remove {switch.name}"
            )
        if cast and rollout is not None:
            notes.append(_one_sided_cast())
        return TrlSettings(mode=None, rollout=rollout, notes=tuple(notes))

    wired = wired_trainer(trainer)
    if wired is None:
        name = trainer.__name__ if isinstance(trainer, type) else type(trainer).__name__
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} but {name} is not a trainer fp32patch wires ({', '.join(WIRED_TRAINERS)} and "
            f"their subclasses): its log-probs would stay bf16 while a vLLM rollout's are fp32. Use one of "
            f"those trainers, or set {KEY} to false"
        )
    if cast:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} together with cast_lm_head_to_fp32: TRL's cast computes the head from the fp32 "
            f"master weights, which vLLM never sees, while {KEY} computes it, in the trainer and in vLLM, from "
            f"the bf16 weights vLLM receives. Set one: {KEY} for the same logits on both sides "
            "(cast_lm_head_to_fp32 alone leaves vLLM's bf16)"
        )
    _check_low_precision(config, mode, model_dtype)
    if path == "logits" and getattr(config, "use_liger_kernel", False) and wired == "GRPOTrainer":
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} together with use_liger_kernel: in this TRL release GRPO then computes the "
            "log-probs from lm_head.weight in bf16 tiles (Liger's GRPO loss up to TRL 1.13, TRL's chunked path "
            f"in 1.14), which fp32patch does not route, so they would stay bf16-rounded. Set use_liger_kernel "
            f"to false (TRL 1.15 and later route it through fp32patch's chunked log-probs), or {KEY} to false"
        )

    vllm = None
    if rollout is None:
        notes.append(
            f"{KEY}={mode!r} without vLLM (use_vllm is false): the trainer's log-probs are fp32, generation "
            "runs in transformers and no engine's log-probs are compared with them"
        )
    elif rollout == "colocate":
        if switch is not None and switch.value in VLLM_OFF_VALUES:
            raise Fp32LmHeadConfigError(
                f'{KEY} is {mode!r} but {switch.source} is "{switch.value}": the two disagree. Remove '
                f"{switch.name}; {KEY} sets it for the colocated vLLM"
            )
        vllm = switch.value if switch is not None and switch.value in VLLM_ON_VALUES else "1"
    elif switch is not None:
        notes.append(
            f"{switch.source} is set in the trainer's process, which vLLM's server does not read: the server "
            f"gets its switch from `trl vllm-serve --{KEY}`, and the trainer probes it at startup"
        )
    return TrlSettings(mode=mode, trainer=wired, path=path, rollout=rollout, vllm=vllm, notes=tuple(notes))


def _check_low_precision(config: Any, mode: str, model_dtype: Any) -> None:
    """Refuse a trainer that computes in fp32 throughout (no bf16/fp16 autocast, fp32 weights)."""
    if getattr(config, "bf16", False) or getattr(config, "fp16", False):
        return
    dtype = str(model_dtype).removeprefix("torch.") if model_dtype is not None else None
    if dtype is None or dtype in _LOW_PRECISION:
        return
    raise Fp32LmHeadConfigError(
        f"{KEY} is {mode!r} but the trainer computes in {dtype} throughout (bf16 and fp16 are off, the "
        f"weights are {dtype}): its logits are fp32 already, from other values than the bf16 ones vLLM "
        f"computes with, and fp32patch's head is for bf16/fp16 operands. Turn bf16 on (TRL's default), or "
        f"set {KEY} to false"
    )


def _one_sided_cast() -> str:
    return (
        "cast_lm_head_to_fp32 alone is one-sided: the trainer's head computes fp32 logits from the fp32 "
        "master weights while vLLM rounds its logits to bf16 from the bf16 weights it receives "
        f"({ONE_SIDED_EVIDENCE}). {KEY} (e.g. fp32out) gives both engines fp32 logits from the same bf16 "
        "operands"
    )


def check_config(
    config: Any,
    *,
    trainer: Any,
    path: str,
    where: str,
    model_dtype: Any = None,
    environ: Mapping[str, str] | None = None,
) -> TrlSettings:
    """What the patched trainer calls once its ``Trainer.__init__`` has run: refuses what cannot
    give both engines the same logits (``Fp32LmHeadConfigError``, naming ``where``), logs the
    notes and one line saying what runs."""
    settings = STACK.guard(
        validate_fp32_lm_head_config,
        config,
        where=where,
        trainer=trainer,
        path=path,
        model_dtype=model_dtype,
        environ=environ,
    )
    if settings.mode is not None:
        how = {"fused": "chunked log-probs", "logits": "LM head"}[settings.path or "logits"]
        rollout = {
            "colocate": f"the colocated vLLM (switch {settings.vllm})",
            "server": "the vLLM server, probed at startup",
            None: "no vLLM",
        }[settings.rollout]
        logger.info(
            "fp32patch (%s): fp32 %s %r for the policy and the reference model; %s", where, how, settings.mode, rollout
        )
    return settings
