"""The errors every RL stack's glue raises: a config that cannot give both engines the same
logits, and a startup probe that found them different. Pure Python."""

from __future__ import annotations

from typing import Any


class Fp32LmHeadConfigError(ValueError):
    """A config that would give fp32 logits to one engine only, or a bad value."""


class Fp32LmHeadMismatchError(RuntimeError):
    """A vLLM worker's logits disagree with the trainer's fp32 LM-head setting.

    ``disagreements`` holds ``(index, report, reason)`` for each worker that disagrees.
    """

    def __init__(self, message: str, disagreements: list[tuple[int, Any, str]]) -> None:
        super().__init__(message)
        self.disagreements = disagreements
