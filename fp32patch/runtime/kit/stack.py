"""What the kit does for one stack: run its guard, keep the guard's verdict, wire a model's head
with a role label, and stop startup on a disagreeing probe. A stack is a few declarative lines
(``STACK = Stack("verl", "verl.fp32patch", key=...)``); its own rules are the function it hands
``guard``."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit.fused import TRAINERS, remember

Settings = TypeVar("Settings")


@dataclass(frozen=True)
class Stack:
    """One RL stack as the kit's shared steps need it.

    ``name``: as messages say it ("NeMo-RL"). ``logger``: the name of a child of the stack's own
    logger (``"verl.fp32patch"``), so fp32patch's lines go where the stack's own go. ``key``:
    the trainer's switch as its users write it, for messages that have no config at hand.
    ``verdicts``: what the guard last found in this process, by caller: a driver's probe names
    the trainer's switch from it (a driver's rollout side may hold only the generation config).
    """

    name: str
    logger_name: str
    key: str
    verdicts: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    told: set[Any] = field(default_factory=set, compare=False, repr=False)

    @property
    def logger(self) -> logging.Logger:
        return logging.getLogger(self.logger_name)

    def guard(self, rules: Callable[..., Settings], config: Any, *, where: str, **kwargs: Any) -> Settings:
        """The stack's ``rules(config, **kwargs)``, as every patched guard runs them: a refusal
        names the caller (``fp32patch (where): ...``); the verdict's ``notes`` are logged as
        warnings and the verdict is kept for this process's probe (``verdict(where)``)."""
        try:
            settings = rules(config, **kwargs)
        except Fp32LmHeadConfigError as exc:
            raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
        for note in getattr(settings, "notes", ()):
            self.logger.warning("fp32patch (%s): %s", where, note)
        self.verdicts[where] = settings
        return settings

    def tell_once(self, key: Any, message: str, *args: Any) -> None:
        """Log ``message % args`` at INFO the first time this process tells ``key`` (a fused
        path's line, said on its first call rather than on every micro-batch)."""
        if key in self.told:
            return
        self.told.add(key)
        self.logger.info(message, *args)

    def verdict(self, where: str) -> Any:
        """What ``guard(..., where=where)`` last returned in this process, if it ran here."""
        return self.verdicts.get(where)

    def wire(self, model: Any, mode: str | None, *, trainer: str, role: str) -> Any:
        """Give ``role``'s model (``"actor"``, ``"DTensor policy"``) fp32 logits in ``mode`` (None:
        leave it as it is) through the trainer's head: ``"megatron"`` (the chunk list from
        ``get_model``, or one module; ``heads.megatron``) or ``"hf"`` (a PyTorch/HF model, FSDP-
        or TP-wrapped; ``heads.hf``). The wired heads are remembered for the stack's fused
        log-prob paths (``kit.fused.wired_mode``). Logs one line naming the role; returns ``model``."""
        if mode is None:
            return model
        if trainer == "megatron":
            from fp32patch.runtime.heads.megatron import apply_fp32_lm_head

            layers = apply_fp32_lm_head(model, mode)
            chunks = len(model) if isinstance(model, (list, tuple)) else 1
            what = f"Megatron output layer gives fp32 logits (mode {mode!r}): {len(layers)} of {chunks} chunk(s) hold the head"
        elif trainer == "hf":
            from fp32patch.runtime.heads.hf import apply_fp32_lm_head

            apply_fp32_lm_head(model, mode)
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            shown = type(head).__name__ if head is not None else "the head"
            what = f"LM head gives fp32 logits (mode {mode!r}): {shown} of {type(model).__name__}"
        else:
            raise ValueError(f"trainer must be one of {TRAINERS}, not {trainer!r}")
        remember(model, trainer)  # for the stack's fused log-prob paths, which never call the head
        self.logger.info("fp32patch: the %s's %s", role, what)
        return model
