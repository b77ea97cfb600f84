"""The values the two fp32 LM-head switches accept, in one place.

The trainer's side is the ``mode`` of every trainer head's ``apply_fp32_lm_head`` (Megatron's,
the PyTorch/HF head's, the fused log-prob path's), which each stack's config key carries;
vLLM's side is an environment variable its EngineCore processes read, under two names:
``FP32PATCH_VLLM_LM_HEAD`` (any stack, or plain vLLM) and ``NRL_VLLM_FP32_LM_HEAD``
(NeMo-RL's, which upstream NeMo-RL reads and sets itself). The runtime and every guard check
against these tables, so a value one accepts is never refused by another. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping

# Trainer modes. Each gives fp32 logits; they differ in how the GEMMs run:
#   fp32              bf16 operands upcast to fp32 inside the graph, IEEE fp32 GEMMs
#   tf32              the same GEMMs with TF32 tensor cores allowed (operands that came from
#                     bf16 are exact in TF32, so only the fp32 grad_output is rounded)
#   fp32out           bf16 operands, fp32 output, no fp32 weight copy. The weight gradient
#                     carries the fp32 grad_output in fp16 with a power-of-two scale per
#                     vocabulary column (bf16 operands are exact in fp16 after scaling):
#                     grad_output rounded to nearest at 11 significant bits, exactly TF32's
#                     rounding of it, in a 16-bit GEMM at the bf16 rate. The input gradient,
#                     which comes back in bf16 anyway, is the stock head's: grad_output
#                     rounded once to bf16, one bf16 GEMM
#   fp32out-hilo      fp32out whose backward splits grad_output into two bf16 terms (hi + lo,
#                     ~16 bits): more precise than TF32, for one extra GEMM per gradient
#   fp32out-bf16grad  fp32out with grad_output rounded once to bf16 in the backward: the
#                     stock bf16 head's backward precision, less precise than tf32; opt-in
#
# Cost in bf16-GEMM equivalents for forward + backward (the stock bf16 head: 3):
# fp32out-bf16grad 3; fp32out 3 plus passes that convert grad_output (to bf16, and to scaled
# fp16) and the input, and that undo the scales on the weight gradient (fused Triton kernels
# on CUDA: fp16_scale_triton.py); fp32out-hilo 5; tf32 3 TF32 GEMMs at half the bf16
# tensor-core rate, ~6, plus fp32 copies of the weight shard; fp32 3 GEMMs without tensor
# cores, plus the copies.
# Measured on an H200 (bench/RESULTS.md) and against float64 on the CPU (tests/
# test_lm_head_gemm.py): fp32out's weight-gradient error equals TF32's and its input
# gradient is the stock head's; fp32out-hilo's weight-gradient error is ~100x smaller than
# TF32's; fp32out-bf16grad's ~7x larger.
TRAINER_MODES: tuple[str, ...] = ("fp32", "tf32", "fp32out", "fp32out-hilo", "fp32out-bf16grad")

# How the valid trainer values are spelled in errors: YAML booleans plus the mode names.
TRAINER_VALUES_TEXT = "false, true, " + ", ".join(f'"{m}"' for m in TRAINER_MODES)

# vLLM's switch, under its two names (both read; where both are set they must agree). The
# neutral one first: the one a message names when neither is set and no stack says otherwise.
VLLM_SWITCH = "FP32PATCH_VLLM_LM_HEAD"
NRL_VLLM_SWITCH = "NRL_VLLM_FP32_LM_HEAD"
VLLM_SWITCHES: tuple[str, ...] = (VLLM_SWITCH, NRL_VLLM_SWITCH)
# Stacks set vLLM's switch by NeMo-RL's name: every fp32patch release's patched vLLM files read it.
VLLM_ENV_VAR = NRL_VLLM_SWITCH
# Stacks hand config values to workers as str(value), so these are compared as strings.
VLLM_ON_VALUES: tuple[str, ...] = ("1", "fp32out", "copy")
VLLM_OFF_VALUES: tuple[str, ...] = ("0",)
VLLM_VALUES_TEXT = "unset, " + ", ".join(f'"{v}"' for v in (*VLLM_OFF_VALUES, *VLLM_ON_VALUES))


def vllm_switch(environ: Mapping[str, object], *, blank_is_unset: bool = True) -> tuple[str, str] | None:
    """vLLM's switch in ``environ`` (a process environment, or a config's ``env_vars``, whose
    values are read as ``str()``): ``(name, value)`` of the name that is set, None where neither
    is (an empty value is unset, as the patched files read it, unless ``blank_is_unset`` is
    false: a config that writes one is refused). Both set to different values raise
    ``ValueError`` naming both; the caller checks the value against ``VLLM_ON_VALUES`` and
    ``VLLM_OFF_VALUES``."""
    found = [(name, str(environ[name]).strip()) for name in VLLM_SWITCHES if name in environ]
    if blank_is_unset:
        found = [(name, value) for name, value in found if value]
    if len({value for _, value in found}) > 1:
        shown = " and ".join(f"{name}={value!r}" for name, value in found)
        raise ValueError(f"{shown} disagree: vLLM's switch has two names, set one (or both to the same value)")
    return found[0] if found else None


def trainer_mode(value: object) -> str | None:
    """The trainer mode that ``value`` asks for, or None for off.

    ``False`` and ``None`` are off, ``True`` is ``"fp32"``, a mode name is itself. Anything
    else (the string ``"false"``, ``"TF32"``, the integer 1) raises ``ValueError`` listing
    the valid values: a near-miss spelling must never silently mean "off".
    """
    if value is None or value is False:
        return None
    if value is True:
        return "fp32"
    if isinstance(value, str) and value in TRAINER_MODES:
        return value
    hint = ""
    if isinstance(value, str):
        import difflib

        close = difflib.get_close_matches(value.strip().lower(), TRAINER_MODES, n=1, cutoff=0.6)
        hint = f' (did you mean "{close[0]}"?)' if close else ""
    raise ValueError(f"fp32 LM-head mode {value!r} is not valid{hint}; use one of {TRAINER_VALUES_TEXT}")


# The names these had when Megatron was the only trainer (patched files and callers use them).
MEGATRON_MODES = TRAINER_MODES
MEGATRON_VALUES_TEXT = TRAINER_VALUES_TEXT
megatron_mode = trainer_mode
