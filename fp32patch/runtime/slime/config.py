"""Refuse slime command lines that would give SGLang and Megatron different logits.

slime's switch is one flag, ``--fp32-lm-head MODE`` (the patch adds it to slime's own
arguments): ``fp32out`` (recommended), ``fp32out-hilo``, ``fp32out-bf16grad``, ``tf32``,
``fp32``, or ``true``/``false`` (``modes.py``). It turns on, together: fp32patch's Megatron
output layer on the model every provider builds (slime's own, ``--spec``'s, or
``--custom-model-provider-path``'s; the reference and teacher weights are swapped into the same
model), and SGLang's own ``enable_fp32_lm_head`` in every rollout server slime launches, each
probed at startup.

``validate_fp32_lm_head_config(args, argv=...)`` raises ``Fp32LmHeadConfigError`` unless

- the value is one of those (slime's command line drops a flag Megatron does not know without
  a word, so a misspelt flag, ``--fp32_lm_head`` or ``--fp32-lm-heads``, is refused here, read
  from ``argv``);
- nothing turns one side on alone: ``--sglang-enable-fp32-lm-head`` without ``--fp32-lm-head``
  (the rollout fp32, the trainer bf16), and, with the flag, an SGLang whose command line has no
  ``--enable-fp32-lm-head`` (before 0.5.3);
- the trainer is Megatron (slime's only backend since March 2026), and SGLang's own settings do
  not undo its flag (``kit.sglang``: a quantized or LoRA head, ``rl_on_policy_target``, a model
  config's own fp32 head).

Notes, not refusals: the debug modes that run one engine (``--debug-train-only``,
``--debug-rollout-only``), external engines (``--rollout-external-engine-addrs``: slime does not
start them, so the probe holds them to the flag), a critic (its value head stays as it is), a
provider fp32patch has not seen (wired after it returns; one without a Megatron output layer is
refused there, naming it).

``check_args(args, where=...)`` is what slime's patched ``parse_args`` calls. Pure Python: no
torch, no slime, no SGLang.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.config import ONE_SIDED_EVIDENCE, closest, near_miss, trainer_mode
from fp32patch.runtime.kit.stack import Stack

FLAG = "--fp32-lm-head"
DEST = "fp32_lm_head"
# SGLang's own flag as slime's command line spells it (every ServerArgs flag, prefixed)
SGLANG_FLAG = "--sglang-enable-fp32-lm-head"
SGLANG_DEST = "sglang_enable_fp32_lm_head"
WIRED_BACKENDS: tuple[str, ...] = ("megatron",)
# the command line's spellings of a boolean (``--fp32-lm-head true``)
_CLI_BOOLEANS = {**dict.fromkeys(("true", "yes", "1"), True), **dict.fromkeys(("false", "no", "0", ""), False)}

STACK = Stack("slime", "slime.fp32patch", key=FLAG)
logger = STACK.logger


@dataclass(frozen=True)
class SlimeSettings:
    """What a valid slime command line asks for.

    ``mode``: the Megatron model's head (None: off). ``trainer``: whether this run trains
    (False under ``--debug-rollout-only``). ``sglang``: whether slime's own SGLang servers get
    ``enable_fp32_lm_head`` (False: none runs, or only external ones). ``external``: the rollout
    servers are external (probed, not set). ``notes``: lines for the log (not part of equality).
    """

    mode: str | None
    trainer: bool = True
    sglang: bool = False
    external: bool = False
    notes: tuple[str, ...] = field(default=(), compare=False)


def requested_mode(raw: Any) -> str | None:
    """The trainer mode ``--fp32-lm-head`` asks for (None: off), ``true``/``false`` read as
    booleans; raises ``Fp32LmHeadConfigError`` naming the flag and the valid values."""
    if isinstance(raw, str) and raw.strip().lower() in _CLI_BOOLEANS:
        raw = _CLI_BOOLEANS[raw.strip().lower()]
    return trainer_mode(raw, FLAG)


def near_miss_flags(argv: Sequence[str], known: set[str]) -> list[str]:
    """The options on ``argv`` spelled like ``--fp32-lm-head`` that no parser took (``known``:
    the destinations on slime's namespace)."""
    missed = []
    for token in argv:
        if not isinstance(token, str) or not token.startswith("-"):
            continue
        name = token.split("=", 1)[0]
        dest = name.lstrip("-").replace("-", "_")
        if name in (FLAG, SGLANG_FLAG) or (dest in known and dest not in (DEST, SGLANG_DEST)):
            continue
        if near_miss(name.lstrip("-"), FLAG.lstrip("-")):
            missed.append(name)
    return missed


def validate_fp32_lm_head_config(args: Any, *, argv: Sequence[str] | None = None) -> SlimeSettings:
    """Check slime's parsed arguments (its ``argparse.Namespace``, every ``--sglang-*`` merged in)
    and the command line they came from (``argv``, default ``sys.argv``)."""
    namespace = vars(args) if hasattr(args, "__dict__") else dict(args)
    argv = list(sys.argv[1:] if argv is None else argv)
    missed = near_miss_flags(argv, set(namespace))
    if missed:
        hint = closest(missed[0], [FLAG, SGLANG_FLAG])
        raise Fp32LmHeadConfigError(
            f"{missed[0]} is not an option of slime or of this SGLang (slime's Megatron parser drops unknown "
            f"options without a word, so it would change nothing); did you mean {hint}?"
        )
    mode = requested_mode(namespace.get(DEST))
    sglang_asked = namespace.get(SGLANG_DEST)
    trains = not namespace.get("debug_rollout_only", False)
    rollout = not (namespace.get("debug_train_only", False) or namespace.get("load_debug_rollout_data"))
    external = bool(namespace.get("rollout_external") or namespace.get("rollout_external_engine_addrs"))

    if mode is None:
        if sglang_asked:
            raise Fp32LmHeadConfigError(
                f"{SGLANG_FLAG} is on but {FLAG} is off: SGLang would compute fp32 logits and Megatron bf16 ones "
                f"({ONE_SIDED_EVIDENCE}). Use {FLAG} fp32out, which turns both on, instead of {SGLANG_FLAG}"
            )
        if rollout:
            _sglang_hazards(namespace, on=False)  # a model config's or variable's fp32 head, SGLang alone
        return SlimeSettings(mode=None, trainer=trains)

    backend = namespace.get("train_backend", "megatron")
    if trains and backend not in WIRED_BACKENDS:
        raise Fp32LmHeadConfigError(
            f"{FLAG} is {mode!r} but --train-backend is {backend!r}: fp32patch wires slime's Megatron models only, "
            f"so the trainer's logits would stay bf16. Use --train-backend megatron, or drop {FLAG}"
        )
    notes: list[str] = []
    if rollout and not external and SGLANG_DEST not in namespace:
        raise Fp32LmHeadConfigError(
            f"{FLAG} is {mode!r} but this SGLang has no --enable-fp32-lm-head ({SGLANG_FLAG} is not among slime's "
            "options; SGLang 0.5.3 and later have it): the rollout's logits would stay bf16. Upgrade SGLang, or "
            f"drop {FLAG}"
        )
    if rollout:
        notes.extend(_sglang_hazards(namespace))
    if not rollout:
        notes.append(
            f"{FLAG}={mode!r} without a rollout in this run (--debug-train-only or --load-debug-rollout-data): the "
            "trainer's log-probs are fp32, and the rollout data's come from whatever engine produced them"
        )
    if not trains:
        notes.append(
            f"{FLAG}={mode!r} under --debug-rollout-only: SGLang's logits are fp32 and no trainer runs in this process"
        )
    if external and rollout:
        notes.append(
            f"{FLAG}={mode!r} with external SGLang engines (--rollout-external-engine-addrs): slime does not start "
            "them, so it cannot turn their flag on; each is probed at startup and refused unless it was started "
            "with --enable-fp32-lm-head"
        )
    if namespace.get("use_critic"):
        notes.append(f"the critic keeps its value head ({FLAG} applies to the actor's LM head)")
    provider = namespace.get("custom_model_provider_path")
    if provider:
        notes.append(
            f"--custom-model-provider-path {provider}: its model's Megatron output layer is wired once the provider "
            "returns; a model without one (or with another kind of head) is refused there"
        )
    return SlimeSettings(
        mode=mode, trainer=trains, sglang=rollout and not external, external=external and rollout, notes=tuple(notes)
    )


def server_args(namespace: dict[str, Any]) -> dict[str, Any]:
    """SGLang's server arguments as slime hands them on: every ``sglang_*`` attribute, unprefixed."""
    return {name.removeprefix("sglang_"): value for name, value in namespace.items() if name.startswith("sglang_")}


def _sglang_hazards(namespace: dict[str, Any], *, on: bool = True) -> list[str]:
    """SGLang's settings that make its flag do nothing or undo it, or (``on`` false) turn an fp32
    head on without it (``kit.sglang.check_server_args``): the ``--sglang-*`` arguments slime copies
    into every server's ``ServerArgs``, each ``--sglang-config`` server group's overrides on top, the
    flag as slime will set it; returns the kit's notes."""
    from fp32patch.runtime.kit import sglang

    base = {**server_args(namespace), sglang.SGLANG_SWITCH: on}
    notes: list[str] = []
    for label, overrides in [("", {}), *config_groups(namespace.get("sglang_config"))]:
        where = label or "--sglang-* options"
        try:
            notes += sglang.check_server_args({**base, **overrides}, on=on, where=where, key=FLAG)
        except Fp32LmHeadConfigError as exc:  # named again by the guard: keep the kit's lines, not its prefix
            text = str(exc).removeprefix(f"fp32patch ({where}): ")
            raise Fp32LmHeadConfigError(f"{label}: {text}" if label else text) from None
    return list(dict.fromkeys(notes))


def config_groups(path: Any) -> list[tuple[str, dict[str, Any]]]:
    """The server groups of slime's ``--sglang-config`` YAML (``sglang: [{name, server_groups:
    [{worker_type, overrides}]}]``) that override SGLang's arguments: (a label naming the file, the
    model and the group, the overrides with ``-`` read as ``_``, as slime reads them)."""
    if not path:
        return []
    import yaml  # slime's own dependency (its --sglang-config reader)

    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle) or {}
    groups = []
    for model in data.get("sglang") or []:
        for index, group in enumerate(model.get("server_groups") or model.get("engine_groups") or []):
            overrides = {str(k).replace("-", "_"): v for k, v in (group.get("overrides") or {}).items()}
            if overrides:
                kind = group.get("worker_type", "regular")
                label = f"--sglang-config {path}, model {model.get('name')!r}, server group {index} ({kind})"
                groups.append((label, overrides))
    return groups


def check_args(args: Any, *, where: str = "parse_args", argv: Sequence[str] | None = None) -> SlimeSettings:
    """What slime's patched ``parse_args`` calls once every argument is parsed and slime's own
    checks ran: refuses what cannot give both engines the same logits (``Fp32LmHeadConfigError``,
    naming ``where``), logs the notes and one line saying what runs."""
    settings = STACK.guard(validate_fp32_lm_head_config, args, where=where, argv=argv)
    if settings.mode is not None:
        rollout = (
            "SGLang's enable_fp32_lm_head in every rollout server, each probed at startup"
            if settings.sglang
            else "external SGLang servers probed at startup"
            if settings.external
            else "no rollout in this run"
        )
        trainer = "Megatron's output layer (the actor, its reference and teacher weights)" if settings.trainer else ""
        logger.info(
            "fp32patch (%s): %s=%r: %s; %s", where, FLAG, settings.mode, trainer or "no trainer in this run", rollout
        )
    return settings
