"""Refuse SkyRL runs that would give vLLM and the trainer different logits.

SkyRL's switch is one field of its typed config, ``trainer.fp32_lm_head`` (the patch adds it to
``TrainerConfig``; SkyRL builds its dataclasses from Hydra-style overrides and refuses a key it
does not know, ``+key`` included, so the switch has to be a field): false, true ("fp32"), or a
trainer mode ("fp32out", recommended; ``modes.TRAINER_MODES``). It turns on, together:

- the trainer's head for the policy and the reference model: FSDP's ``HFModelWrapper`` gets its
  log-probs and entropy from fp32patch's chunked piece inside the head's own call (no [B, T, V]
  logits) and full fp32 logits where a caller needs them (sample-support replay); Megatron's output
  layer gives fp32 logits at fp32out's cost, which SkyRL's log-prob collection then reads, and its
  fused LM-head path computes the same in tiles (no [B, T, V] logits);
- vLLM's own ``head_dtype`` float32 in every server SkyRL starts (``engine_init_kwargs``'
  ``hf_overrides``, vLLM 0.26+), then every server's workers are probed before the first rollout.

``validate_fp32_lm_head_config(cfg, environ=..., vllm_version=...)`` raises
``Fp32LmHeadConfigError`` unless

- the trainer is one fp32patch wires (``trainer.strategy`` fsdp, fsdp2 or megatron), in bf16
  (``trainer.bf16``, FSDP's ``mixed_precision.param_dtype``), without a LoRA adapter on the head;
  SkyRL's fused Megatron LM-head path (``trainer.fused_lm_head_logprob``) is computed by
  fp32patch's chunked piece (``megatron``), but not beside sample-support replay, whose scores
  read the head's weight by their own bf16 route;
- vLLM serves the rollouts in bf16 (``generator.inference_engine.model_dtype``) and can be
  probed: SkyRL's own servers or ``external_server_urls`` (an ``external_proxy_url`` alone hides
  the servers' workers); a vLLM that has ``head_dtype`` (0.26+; SkyRL 0.4.0 pins 0.30.0);
- nothing else contradicts the key: ``hf_overrides.head_dtype`` in ``engine_init_kwargs`` (or
  the PD roles' kwargs, which replace it), vLLM's switch in the driver's environment (on with
  the key off: one side alone; "0" with it on).

``VLLM_BATCH_INVARIANT`` is explained, not refused: vLLM's fp32 head and the trainer's are
different kernels, so bitwise equality between the two engines, where the rest of a model has
it, stops at the head (the logits agree to fp32 rounding instead of bf16's).
``check_config`` is what the patched ``validate_cfg`` calls. Pure Python: no torch, no SkyRL.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.config import ONE_SIDED_EVIDENCE, plain, section, trainer_mode
from fp32patch.runtime.kit.rollout import HEAD_DTYPE_SINCE, driver_switch_notes, head_dtype_overrides, read_vllm_switch
from fp32patch.runtime.kit.stack import Stack

NAME = "fp32_lm_head"  # the field of SkyRL's TrainerConfig
KEY = f"trainer.{NAME}"  # as users write it on the command line
STACK = Stack("SkyRL", "skyrl.fp32patch", key=KEY)

STRATEGIES = ("fsdp", "fsdp2", "megatron")
_BF16 = ("bf16", "bfloat16", "torch.bfloat16")
_IE = "generator.inference_engine"
BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"
_UNKNOWN = object()


@dataclass(frozen=True)
class SkyRLSettings:
    """What a valid SkyRL config asks for. ``mode``: the trainer's head (None: off);
    ``strategy``: the trainer backend; ``notes``: lines for the log (not part of equality)."""

    mode: str | None
    strategy: str = "fsdp"
    notes: tuple[str, ...] = field(default=(), compare=False)


def requested_mode(cfg: Any) -> str | None:
    """The mode ``trainer.fp32_lm_head`` asks for (None: off), from the whole config or its
    trainer section (SkyRL's dataclasses or a plain mapping)."""
    trainer = getattr(cfg, "trainer", None)
    if trainer is None and isinstance(cfg, Mapping):
        trainer = cfg.get("trainer", cfg)
    trainer = cfg if trainer is None else trainer
    raw = trainer.get(NAME) if isinstance(trainer, Mapping) else getattr(trainer, NAME, None)
    return trainer_mode(raw, KEY)


def validate_fp32_lm_head_config(
    cfg: Any, *, environ: Mapping[str, str] | None = None, vllm_version: Any = _UNKNOWN
) -> SkyRLSettings:
    """Check a SkyRL config (``SkyRLTrainConfig`` or its plain form); ``environ`` stands for the
    driver's environment (default ``os.environ``), ``vllm_version`` for the vLLM installed here
    (default: read; None where there is none, then the probe decides)."""
    environ = os.environ if environ is None else environ
    whole = plain(cfg)
    trainer = section(whole, "trainer", "")
    generator = section(whole, "generator", "")
    engine = section(generator, "inference_engine", "generator.")
    mode = trainer_mode(trainer.get(NAME), KEY)
    strategy = str(trainer.get("strategy", "fsdp"))
    switch = read_vllm_switch(None, "", environ)
    kwargs = section(engine, "engine_init_kwargs", f"{_IE}.")

    if mode is None:
        if switch is not None and switch.on:
            raise Fp32LmHeadConfigError(
                f'{switch.source} is "{switch.value}" but {KEY} is off: vLLM would compute fp32 logits and the '
                f"trainer bf16 ones ({ONE_SIDED_EVIDENCE}). Set {KEY}=fp32out, which turns both on, and remove "
                f"{switch.name}"
            )
        head_dtype_overrides(kwargs.get("hf_overrides"), key=KEY, mode=None)
        return SkyRLSettings(mode=None, strategy=strategy)

    notes: list[str] = []
    _refuse_unwired_trainer(trainer, strategy, mode)
    _refuse_unprobed_rollout(engine, mode)
    for place, role_kwargs in _engine_kwargs(engine):
        _check_head_dtype(place, role_kwargs, mode)
    version = _installed_vllm() if vllm_version is _UNKNOWN else vllm_version
    if version is not None and tuple(version[:2]) < HEAD_DTYPE_SINCE:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} but the vLLM here is {'.'.join(map(str, version))}: SkyRL turns vLLM's fp32 head on "
            "by vLLM's own head_dtype, which vLLM has from 0.26 (SkyRL 0.4.0 pins 0.30.0, and its server path runs "
            "on no vLLM before 0.26). Install the vLLM SkyRL pins"
        )
    notes += driver_switch_notes(
        switch, key=KEY, mode=mode, unit="server", how="asks every vLLM server for head_dtype float32"
    )
    if str(environ.get(BATCH_INVARIANT, "")).strip() not in ("", "0"):
        notes.append(
            f"{BATCH_INVARIANT} is set: vLLM's fp32 head (head_dtype) and the trainer's ({mode}) are different "
            "kernels, so where the rest of the model is bitwise equal between rollout and trainer, the head is not: "
            "its logits agree to fp32 rounding (about 1e-6 relative) instead of being equal. Turn "
            f"{KEY} off to keep one bf16 head on both sides"
        )
    return SkyRLSettings(mode=mode, strategy=strategy, notes=tuple(notes))


def _refuse_unwired_trainer(trainer: Mapping[str, Any], strategy: str, mode: str) -> None:
    """Only the FSDP and Megatron trainers, in bf16, with a plain head and no fused bf16 path."""
    if strategy not in STRATEGIES:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} with trainer.strategy={strategy!r}: fp32patch wires SkyRL's FSDP and Megatron "
            f"trainers ({', '.join(STRATEGIES)}); turn {KEY} off for this backend"
        )
    if trainer.get("bf16", True) is False:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} with trainer.bf16=false: the fp32-output head is for bf16 weights, the dtype "
            f"SkyRL's vLLM servers compute in (an fp32 trainer computes other logits than vLLM's bf16 weights "
            f"give); set trainer.bf16=true or turn {KEY} off"
        )
    policy = section(trainer, "policy", "trainer.")
    precision = section(
        section(policy, "fsdp_config", "trainer.policy."), "mixed_precision", "trainer.policy.fsdp_config."
    )
    param_dtype = precision.get("param_dtype")
    if strategy != "megatron" and param_dtype is not None and str(param_dtype) not in _BF16:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} with trainer.policy.fsdp_config.mixed_precision.param_dtype={param_dtype!r}: the "
            f"fp32-output head computes from bf16 weights, as vLLM does; use bf16 or turn {KEY} off"
        )
    lora = section(section(policy, "model", "trainer.policy."), "lora", "trainer.policy.model.")
    targets = lora.get("target_modules") or ()
    targets = [targets] if isinstance(targets, str) else list(targets)
    if int(lora.get("rank") or 0) > 0 and any("lm_head" in str(name) for name in targets):
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} with a LoRA adapter on the head (trainer.policy.model.lora.target_modules="
            f"{targets!r}): the adapter adds a term fp32patch's head would drop. Keep lm_head out of the "
            f"targets, or turn {KEY} off"
        )
    algorithm = section(trainer, "algorithm", "trainer.")
    if (
        strategy == "megatron"
        and trainer.get("fused_lm_head_logprob")
        and algorithm.get("enable_sample_support_replay")
    ):
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} with trainer.fused_lm_head_logprob=true and "
            "trainer.algorithm.enable_sample_support_replay=true: SkyRL's sample-support scores then compute "
            "their own bf16 logits from the head's weight, beside fp32patch's fused log-probs. Set "
            "trainer.fused_lm_head_logprob=false (the output layer then gives the scores fp32 logits), or turn "
            f"{KEY} off"
        )


def _refuse_unprobed_rollout(engine: Mapping[str, Any], mode: str) -> None:
    """vLLM in bf16, and servers whose workers the probe can reach."""
    backend = str(engine.get("backend", "vllm"))
    if backend != "vllm":
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} but {_IE}.backend is {backend!r}: fp32patch turns the fp32 head on in SkyRL's vLLM "
            "servers only"
        )
    dtype = str(engine.get("model_dtype", "bfloat16"))
    if dtype not in _BF16:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} but {_IE}.model_dtype is {dtype!r}: the trainer's fp32 head computes from bf16 "
            f"weights; serve the model in bfloat16 or turn {KEY} off"
        )
    if engine.get("external_proxy_url") and not engine.get("external_server_urls"):
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} with {_IE}.external_proxy_url alone: fp32patch probes every vLLM server's workers "
            f"at startup and a proxy hides them. Give {_IE}.external_server_urls too (servers started with "
            "VLLM_SERVER_DEV_MODE=1, hf_overrides head_dtype float32, and SkyRL's worker extension), or turn "
            f"{KEY} off"
        )


def _engine_kwargs(engine: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """Where the servers' vLLM arguments come from: engine_init_kwargs, and under PD the role kwargs
    (each replaces what it names, hf_overrides included)."""
    places = [f"{_IE}.engine_init_kwargs"]
    if engine.get("enable_pd"):
        places += [f"{_IE}.prefill_init_kwargs", f"{_IE}.decode_init_kwargs"]
    return [(place, section(engine, place.rsplit(".", 1)[1], f"{_IE}.")) for place in places]


def _check_head_dtype(place: str, kwargs: Mapping[str, Any], mode: str) -> None:
    """No other head_dtype at ``place``; a PD role's own hf_overrides replace the ones fp32patch sets
    in the shared arguments, so they must ask for float32 themselves."""
    try:
        head_dtype_overrides(kwargs.get("hf_overrides"), key=KEY, mode=mode)
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"{exc} (at {place}.hf_overrides)") from None
    given = (kwargs.get("hf_overrides") or {}).get("head_dtype")
    if not place.endswith("engine_init_kwargs") and "hf_overrides" in kwargs and given is None:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} but {place}.hf_overrides replaces the servers' hf_overrides without head_dtype: add "
            f"{place}.hf_overrides.head_dtype=float32, or turn {KEY} off"
        )


def _installed_vllm() -> tuple[int, ...] | None:
    from fp32patch.runtime.kit.rollout import installed_vllm_version

    return installed_vllm_version()


def check_config(cfg: Any, *, where: str = "validate_cfg") -> SkyRLSettings:
    """The guard as SkyRL's patched files run it: a refusal names ``where``, notes are logged."""
    return STACK.guard(validate_fp32_lm_head_config, cfg, where=where)
