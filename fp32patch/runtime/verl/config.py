"""Refuse verl configs that would give the rollout and the trainer different logits.

verl's switch is one key, ``actor_rollout_ref.model.fp32_lm_head`` (false, true, "fp32", "tf32",
"fp32out", "fp32out-hilo", "fp32out-bf16grad"; ``modes.py``): the actor's and the reference
policy's head in that mode, and fp32 logits in every rollout server from the same key (vLLM:
``NRL_VLLM_FP32_LM_HEAD`` in the server's processes; SGLang: its own ``enable_fp32_lm_head``).
It is a field of ``HFModelConfig`` once the patch is applied, so verl itself refuses a
misspelt key; on the command line it needs Hydra's ``+`` (``+actor_rollout_ref.model.fp32_lm_head=fp32out``).

``validate_fp32_lm_head_config(config)`` raises ``Fp32LmHeadConfigError`` unless

- the trainer is one fp32patch wires: ``actor_rollout_ref.actor.strategy`` (and the ref's)
  fsdp, fsdp2, fsdp_turbo or megatron; VeOmni, TorchTitan and Automodel build their models
  elsewhere, and a head nobody wires would leave the trainer in bf16;
- ``use_fused_kernels`` (verl's fused log-prob paths, which read ``lm_head.weight`` and never
  call the head) is accepted, and what computes the log-probs is said in a note: on the FSDP
  strategies every backend (``torch``, ``liger``, ``triton``) is computed by fp32patch's chunked
  fp32 log-probs in the key's mode, entropy included (``verl.fused``); on Megatron verl's fused
  path is its triton kernel, kept as it is: fp32 logits never rounded to bf16 in the forward, and
  a backward that is not the key's mode (``TRITON_BACKWARD`` says what it is);
- the rollout can follow: vLLM (fp32patch's vLLM patches) or SGLang (0.5.3+'s own switch); TRT-LLM
  has no fp32 LM head. With vLLM, LoRA as an adapter (``lora_rank`` or ``lora.rank`` > 0, not
  ``lora.merge``) runs vLLM's LoRA logits processor, which keeps its bf16 head up to vLLM 0.25
  (every verl release pins vLLM below that);
- nothing else turns fp32 logits on for one side: ``NRL_VLLM_FP32_LM_HEAD`` (in
  ``ray_kwargs.ray_init.runtime_env.env_vars``, else the driver's environment) and
  ``engine_kwargs.sglang.enable_fp32_lm_head`` must agree with the key, or be left unset. The
  variable may name the way ("copy") where the key is on.

``check_config(config, where=...)`` is what verl's patched ``validate_config`` calls. Pure
Python: no torch, no verl.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit import sglang as sglang_kit
from fp32patch.runtime.kit.config import ONE_SIDED_EVIDENCE, plain, section, trainer_mode
from fp32patch.runtime.kit.rollout import installed_vllm_version, read_vllm_switch
from fp32patch.runtime.kit.stack import Stack
from fp32patch.runtime.modes import VLLM_ENV_VAR, VLLM_OFF_VALUES, VLLM_ON_VALUES

KEY = "actor_rollout_ref.model.fp32_lm_head"
# trainer strategies whose actor and ref models the patch wires (the FSDP engine and legacy
# workers, fsdp_turbo through the FSDP engine, the Megatron engine and legacy workers)
WIRED_STRATEGIES: tuple[str, ...] = ("fsdp", "fsdp2", "fsdp_turbo", "megatron")
ROLLOUTS: tuple[str, ...] = ("vllm", "sglang")
SGLANG_SECTION = "actor_rollout_ref.rollout.engine_kwargs.sglang"
SGLANG_KEY = f"{SGLANG_SECTION}.enable_fp32_lm_head"
RUNTIME_ENV_VARS = "ray_kwargs.ray_init.runtime_env.env_vars"
RUNTIME_ENV = f"{RUNTIME_ENV_VARS}.{VLLM_ENV_VAR}"
# verl's triton kernel (verl/utils/kernel/kernels.py, its default backward, read in 0.6.1-0.9.1),
# which its Megatron engine's fused path always runs
TRITON_BACKWARD = (
    "its forward accumulates the bf16 GEMM in fp32 and never rounds the logits to bf16 (fp32out's "
    "forward); its backward is not the key's mode: it rounds the gradient with respect to the logits to "
    "bf16 (the rounding fp32out-bf16grad has, 1.68e-3 relative weight-gradient error at the H200 "
    "benchmark's workload against fp32out's 2.09e-4, bench/RESULTS.md), returns the weight gradient of a "
    "bf16 GEMM rounded to bf16, and sums the input gradient in bf16 over vocabulary splits of 9504 entries "
    "(16 partial sums at a 152k vocabulary); the kernel itself is not measured by fp32patch"
)
# the last vLLM release whose LoRA logits processor keeps its own (bf16) head under fp32patch
LAST_BF16_LORA_VLLM = (0, 25)

STACK = Stack("verl", "verl.fp32patch", key=KEY)
logger = STACK.logger


@dataclass(frozen=True)
class VerlSettings:
    """What a valid verl config asks for.

    ``mode``: the actor's and the ref's head (None: off). ``rollout``: the rollout's name.
    ``vllm``: the ``NRL_VLLM_FP32_LM_HEAD`` value the vLLM servers' processes get (None: the
    rollout is not vLLM, or off). ``sglang``: SGLang's ``enable_fp32_lm_head``. ``fused``: the
    fused-kernel backend of ``use_fused_kernels`` ("torch", "liger", "triton"), if on.
    ``notes``: lines for the log (not part of equality).
    """

    mode: str | None
    rollout: str | None = None
    vllm: str | None = None
    sglang: bool | None = None
    fused: str | None = None
    notes: tuple[str, ...] = field(default=(), compare=False)


def validate_fp32_lm_head_config(
    config: Any, *, environ: Mapping[str, str] | None = None, vllm_version: tuple[int, ...] | None = None
) -> VerlSettings:
    """Check verl's whole config (a DictConfig, or a mapping of the same shape).

    ``environ`` stands for the driver's environment (default ``os.environ``); ``vllm_version``
    for the installed vLLM's (default: read from its distribution, if installed). Raises
    ``Fp32LmHeadConfigError`` naming the key, the value and what to do.
    """
    cfg = as_plain(config)
    if not isinstance(cfg, dict):
        raise Fp32LmHeadConfigError(f"expected verl's config as a mapping, got {type(config).__name__}")
    arr = section(cfg, "actor_rollout_ref", "")
    model = section(arr, "model", "actor_rollout_ref.")
    rollout_cfg = section(arr, "rollout", "actor_rollout_ref.")
    mode = model_mode(model)
    rollout = rollout_cfg.get("name")
    env_value, env_source, env_name = _env_value(cfg, os.environ if environ is None else environ)
    sglang_kwargs = section(section(rollout_cfg, "engine_kwargs", "actor_rollout_ref.rollout."), "sglang", "")
    sglang_asked = sglang_kwargs.get("enable_fp32_lm_head")

    if mode is None:
        if rollout == "vllm" and env_value in VLLM_ON_VALUES:
            raise Fp32LmHeadConfigError(
                f'{env_source} is "{env_value}" but {KEY} is off: vLLM would compute fp32 logits and the '
                f"trainer bf16 ones ({ONE_SIDED_EVIDENCE}). Set {KEY} (e.g. fp32out), which turns both on, "
                f"and remove {env_name}"
            )
        if rollout == "sglang" and sglang_asked is True:
            raise Fp32LmHeadConfigError(
                f"{SGLANG_KEY} is true but {KEY} is off: SGLang would compute fp32 logits and the trainer "
                f"bf16 ones ({ONE_SIDED_EVIDENCE}). Set {KEY} (e.g. fp32out), which turns both on, and "
                "remove enable_fp32_lm_head"
            )
        if rollout == "sglang":
            _check_sglang_kwargs(sglang_kwargs, None)
        return VerlSettings(mode=None, rollout=rollout)

    for role in ("actor", "ref"):
        strategy = section(arr, role, "actor_rollout_ref.").get("strategy")
        if strategy is not None and strategy not in WIRED_STRATEGIES:
            raise Fp32LmHeadConfigError(
                f"{KEY} is {mode!r} but actor_rollout_ref.{role}.strategy is {strategy!r}: fp32patch wires "
                f"the head of {', '.join(WIRED_STRATEGIES)} only, so the trainer's logits would stay bf16 "
                f"while the rollout's are fp32. Use one of those strategies, or set {KEY} to false"
            )
    notes: list[str] = []
    fused = _fused_backend(arr, model)
    if fused is not None:
        notes.append(_fused_note(fused, mode, section(arr, "actor", "actor_rollout_ref.").get("strategy")))

    vllm = sglang = None
    if rollout == "vllm":
        if env_value in VLLM_OFF_VALUES:
            raise Fp32LmHeadConfigError(
                f'{KEY} is {mode!r} but {env_source} is "{env_value}": the two disagree. Remove '
                f"{env_name}; the key sets it in every vLLM rollout process"
            )
        vllm = env_value if env_value in VLLM_ON_VALUES and env_value != "1" else "1"
        _check_lora(model, mode)
    elif rollout == "sglang":
        if sglang_asked is not None and sglang_asked is not True:
            raise Fp32LmHeadConfigError(
                f"{KEY} is {mode!r} but {SGLANG_KEY} is {sglang_asked!r}: the two disagree. Remove "
                "enable_fp32_lm_head; the key turns it on in every SGLang server"
            )
        notes.extend(_check_sglang_kwargs(sglang_kwargs, mode))
        sglang = True
    else:
        raise Fp32LmHeadConfigError(
            f"{KEY} is {mode!r} but actor_rollout_ref.rollout.name is {rollout!r}: fp32patch gives fp32 "
            f"logits to the vLLM and SGLang rollouts only, so the rollout's would stay bf16. Use "
            f"{' or '.join(ROLLOUTS)}, or set {KEY} to false"
        )
    return VerlSettings(mode=mode, rollout=rollout, vllm=vllm, sglang=sglang, fused=fused, notes=tuple(notes))


def _check_sglang_kwargs(kwargs: dict[str, Any], mode: str | None) -> list[str]:
    """The SGLang hazards (``kit.sglang.sglang_hazards``) of the arguments every SGLang server gets
    from ``engine_kwargs.sglang``, with the key's flag as the key sets it; returns the notes. The
    servers' own environment is checked again where each starts (``wiring.sglang_args``)."""
    args = {**kwargs, sglang_kit.SGLANG_SWITCH: True} if mode is not None else kwargs
    problems, notes = sglang_kit.sglang_hazards(args, on=mode is not None, key=KEY, environ={}, where=SGLANG_SECTION)
    if problems:
        raise Fp32LmHeadConfigError(f"{SGLANG_SECTION} does not follow {KEY}={mode!r}: " + "; ".join(problems))
    return [f"{SGLANG_SECTION}: {note}" for note in notes]


def model_mode(model: Any, key: str = KEY) -> str | None:
    """The trainer mode that ``actor_rollout_ref.model`` (a mapping, a DictConfig or verl's
    ``HFModelConfig``) asks for; None for off. Raises ``Fp32LmHeadConfigError``."""
    raw = model.get("fp32_lm_head") if hasattr(model, "get") else getattr(model, "fp32_lm_head", None)
    return trainer_mode(raw, key)


def as_plain(config: Any) -> Any:
    """verl's DictConfig (interpolations resolved, a missing ``???`` kept as is) or any mapping, as dicts."""
    try:
        from omegaconf import DictConfig, OmegaConf
    except ImportError:
        return plain(config)
    if isinstance(config, DictConfig):
        return OmegaConf.to_container(config, resolve=True, throw_on_missing=False)
    return plain(config)


def _env_value(cfg: Mapping[str, Any], environ: Mapping[str, str]) -> tuple[str | None, str, str]:
    """vLLM's switch as verl's Ray workers will see it: its value, where it was set, and its name."""
    env_vars = cfg
    for key in ("ray_kwargs", "ray_init", "runtime_env", "env_vars"):
        env_vars = env_vars.get(key) if isinstance(env_vars, Mapping) else None
    switch = read_vllm_switch(env_vars if isinstance(env_vars, Mapping) else None, RUNTIME_ENV_VARS, environ)
    if switch is None:
        return None, "", VLLM_ENV_VAR
    return switch.value, switch.source, switch.name


def _fused_backend(arr: Mapping[str, Any], model: Mapping[str, Any]) -> str | None:
    """The fused-kernel backend that computes the actor's log-probs (None: the head does)."""
    actor = section(arr, "actor", "actor_rollout_ref.")
    if not (model.get("use_fused_kernels") or actor.get("use_fused_kernels")):
        return None
    if actor.get("strategy") == "megatron":
        return "triton"  # Megatron's fused forward is triton's linear_cross_entropy, whatever the option says
    options = model.get("fused_kernel_options") or {}
    backend = options.get("impl_backend") if isinstance(options, Mapping) else None
    return str(backend or "torch")


# the fused-kernel backends verl's FSDP model forward takes (0.6-0.7: torch and triton; 0.9: liger too)
FUSED_BACKENDS = ("torch", "liger", "triton")


def _fused_note(backend: str, mode: str, strategy: Any) -> str:
    """What computes the actor's and the ref's log-probs where ``use_fused_kernels`` is on."""
    if strategy == "megatron":
        return (
            "use_fused_kernels on Megatron: verl computes the log-probs with its fused triton kernel "
            f"(linear_cross_entropy), not through the head, so {KEY}={mode!r} does not apply there: "
            f"{TRITON_BACKWARD}. Set actor_rollout_ref.model.use_fused_kernels to false for the key's mode"
        )
    if backend not in FUSED_BACKENDS:
        return (
            f"use_fused_kernels with impl_backend {backend!r}, which verl does not fuse: the fp32 head "
            "computes the logits"
        )
    replaced = "" if backend == "torch" else f" (verl's {backend} kernel does not run)"
    return (
        f"use_fused_kernels ({backend}): the log-probs and the entropy come from fp32patch's chunked fp32 "
        f"log-probs in mode {mode!r}, the temperature applied to the fp32 logits{replaced}"
    )


def _check_lora(model: Mapping[str, Any], mode: str) -> None:
    lora = model.get("lora") if isinstance(model.get("lora"), Mapping) else {}
    rank = lora.get("rank") or model.get("lora_rank") or 0
    if not rank or lora.get("merge"):
        return
    version = _installed_vllm()
    if version is not None and version[:2] > LAST_BF16_LORA_VLLM:
        return
    shown = ".".join(map(str, version)) if version is not None else "not installed here (verl pins <=0.24)"
    raise Fp32LmHeadConfigError(
        f"{KEY} is {mode!r} with a LoRA adapter on the vLLM rollout (rank {rank}): vLLM's LoRA logits "
        f"processor keeps its own bf16 head up to vLLM 0.25 (vLLM {shown}), so the rollout's logits would "
        f"stay bf16 while the trainer's are fp32. Merge the adapter into the weights for the rollout "
        f"(actor_rollout_ref.model.lora.merge: true), or set {KEY} to false"
    )


_installed_vllm = installed_vllm_version


def check_config(
    config: Any, *, where: str = "validate_config", environ: Mapping[str, str] | None = None
) -> VerlSettings:
    """verl's patched ``validate_config`` calls this with the whole config: refuses what cannot
    give both engines the same logits (``Fp32LmHeadConfigError``, naming ``where``), logs the
    notes and one line saying what runs."""
    settings = STACK.guard(validate_fp32_lm_head_config, config, where=where, environ=environ)
    if settings.mode is not None:
        rollout = (
            f"{VLLM_ENV_VAR}={settings.vllm} in every vLLM rollout process"
            if settings.vllm is not None
            else "SGLang's enable_fp32_lm_head in every rollout server"
        )
        logger.info("fp32patch (%s): fp32 LM head %r on the actor and the ref; %s", where, settings.mode, rollout)
    return settings
