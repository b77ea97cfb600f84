"""Reading a stack's config, as every guard does: configs as plain dicts and their sections, the
trainer key's value with its hints, the hint for a boolean written as a string, near-miss keys,
and the measured case against one side alone. Pure Python: no torch."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

# What bench/agreement.py measured (bench/RESULTS.md: "Train/generation agreement of two
# engines", H200, 2026-12-01; its real-engine mode, vLLM's CPU engine against transformers,
# 2026-12-03), quoted by the refusal and the opt-in's warning.
ONE_SIDED_EVIDENCE = (
    "measured (bench/RESULTS.md, NeMo-RL's token_mult_prob_error): fp32 on both sides is best "
    "everywhere (trained 135M model on an H200: 1.01202 against 1.01444 for neither; whole vLLM "
    "CPU engines against transformers: 1.0236-1.0248 against 1.0265-1.0279); one side alone is "
    "at most ~2e-3 better than neither where the engines' own divergence exceeds the head's "
    "rounding (1.01391 on the H200, 1.0253-1.0271 on the CPU engines), and worse, by up to one "
    "head's whole rounding, where the rounding dominates: NeMo-RL's fleet (#3936) read 1.035 "
    "one-sided against 1.029 for neither and 1.015 for both"
)


def plain(value: Any) -> Any:
    """Mappings, dataclass instances (SkyRL's typed configs) and pydantic models as plain dicts
    (pydantic keeps extra keys in its dump)."""
    if isinstance(value, Mapping):
        return {key: plain(item) for key, item in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)  # pydantic 2
    if callable(dump) and not isinstance(value, type):
        return plain(dump())
    legacy = getattr(value, "dict", None)  # pydantic 1
    if callable(legacy) and hasattr(value, "__fields__") and not isinstance(value, type):
        return plain(legacy())
    return value


def section(parent: Mapping[str, Any], key: str, prefix: str) -> Mapping[str, Any]:
    """``parent[key]`` as a mapping ({} where it is absent or null); anything else is refused
    with ``Fp32LmHeadConfigError`` naming the key (``prefix`` leads to ``parent``)."""
    from fp32patch.runtime.errors import Fp32LmHeadConfigError

    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise Fp32LmHeadConfigError(f"{prefix}{key} must be a mapping, not {type(value).__name__} ({value!r})")
    return value


def quoted_boolean(raw: object) -> str:
    """The hint for a boolean written as a string ("false", "yes"), else ""."""
    if isinstance(raw, str) and raw.strip().lower() in ("false", "true", "no", "yes"):
        return " (a quoted string is not a boolean: write false or true without quotes)"
    return ""


# How close (difflib ratio of the normalised spellings) a key must come to count as a near miss.
_CLOSENESS = 0.85


def trainer_mode(raw: object, key: str) -> str | None:
    """The trainer mode ``raw`` (a config's value at ``key``) names, None for off; raises
    ``Fp32LmHeadConfigError`` naming the key, a hint for a quoted boolean or a capitalised
    name, and the valid values."""
    from fp32patch.runtime import modes
    from fp32patch.runtime.errors import Fp32LmHeadConfigError

    try:
        return modes.trainer_mode(raw)
    except ValueError:
        hint = quoted_boolean(raw)
        if not hint and isinstance(raw, str) and raw.strip().lower() in modes.TRAINER_MODES:
            hint = f' (did you mean "{raw.strip().lower()}"? the names are lower case)'
        elif not hint and isinstance(raw, str):
            close = difflib.get_close_matches(raw.strip().lower(), modes.TRAINER_MODES, n=1, cutoff=0.6)
            hint = f' (did you mean "{close[0]}"?)' if close else ""
        raise Fp32LmHeadConfigError(
            f"{key} = {raw!r} is not valid{hint}; valid values: {modes.TRAINER_VALUES_TEXT}"
        ) from None


def _normalised(key: str) -> str:
    return key.lower().replace("_", "").replace("-", "").replace(" ", "")


def closest(key: str, candidates: list[str]) -> str | None:
    """The candidate spelled most like ``key`` (None where there is none)."""
    if not candidates:
        return None
    return max(
        candidates, key=lambda right: difflib.SequenceMatcher(None, _normalised(key), _normalised(right)).ratio()
    )


def near_miss(key: object, right: str) -> bool:
    """``key`` looks like ``right`` but is not it: another case or separator, a letter more or
    less, or any spelling with "fp32", "lm" and "head" in it (patched files take a key starting
    "fp32" with "lm" and "head" in it as asking for fp32patch)."""
    if not isinstance(key, str) or key == right:
        return False
    got, want = _normalised(key), _normalised(right)
    if got == want:
        return True
    if "fp32" in got and "lm" in got and "head" in got:
        return True
    return difflib.SequenceMatcher(None, got, want).ratio() >= _CLOSENESS
