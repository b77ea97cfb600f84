"""slime's Megatron model and SGLang servers get the fp32 LM head where ``--fp32-lm-head`` asks.

``wire_model``: the model chunks ``get_model`` returns in ``setup_model_and_optimizer``, the one
place every provider's model passes (slime's own, ``--spec``'s, ``--custom-model-provider-path``'s),
before the optimizer and the checkpoint; the actor's reference and teacher weights are loaded into
that same model, and a critic keeps its value head. ``server_args``: SGLang's own
``enable_fp32_lm_head`` in the server arguments slime computes for each server (after a
``--sglang-config`` group's overrides), and what undoes it refused. The work is the kit's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit import sglang
from fp32patch.runtime.slime.config import FLAG, STACK, requested_mode

ROLES = ("actor", "critic")


def wire_model(model: Any, args: Any, *, role: str) -> Any:
    """Give ``role``'s Megatron chunks (as ``get_model`` returns them) fp32 logits in the flag's
    mode; a critic is left as it is. A model whose last stage has no Megatron output layer (a
    custom provider's own head) is refused, naming the provider. Returns ``model``."""
    mode = _mode(args, f"slime {role}")
    if mode is None:
        return model
    if role == "critic":
        STACK.logger.info("fp32patch: the critic keeps its value head (%s=%r applies to LM heads)", FLAG, mode)
        return model
    try:
        return STACK.wire(model, mode, trainer="megatron", role=role)
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise Fp32LmHeadConfigError(
            f"fp32patch (slime {role}): {FLAG} is {mode!r} but fp32patch cannot give the model {_provider(args)} "
            f"built fp32 logits: {exc}. Give the model a Megatron-Core ColumnParallelLinear output_layer, or drop "
            f"{FLAG}"
        ) from None


def server_args(
    kwargs: dict[str, Any], args: Any, server_args_cls: Any, *, where: str, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """SGLang's server arguments (``ServerArgs(**kwargs)``, changed in place) with its own fp32
    LM head on where the flag asks; refuses an SGLang without it, a server whose arguments turn
    it off (a ``--sglang-config`` group's ``overrides``) or on alone, and what makes it do nothing.

    slime copies every ``--sglang-*`` option's value into ``kwargs``, so ``enable_fp32_lm_head`` is
    there False (the store_true flag's default) whenever the command line leaves it out: only a
    group's ``overrides`` can say False on purpose, and only those are held against the flag."""
    mode = _mode(args, where)
    chosen = {str(name).replace("-", "_") for name in (overrides or {})}
    if kwargs.get(sglang.SGLANG_SWITCH) is False and sglang.SGLANG_SWITCH not in chosen:
        del kwargs[sglang.SGLANG_SWITCH]  # the command line's default: not a choice
        if mode is None:
            kwargs[sglang.SGLANG_SWITCH] = False
    return sglang.sglang_args(kwargs, mode, server_args_cls, key=FLAG, where=where, logger=STACK.logger)


def _provider(args: Any) -> str:
    custom = getattr(args, "custom_model_provider_path", None)
    if custom:
        return f"--custom-model-provider-path {custom}"
    spec = getattr(args, "spec", None)
    return f"slime's model provider with --spec {spec}" if spec else "slime's model provider"


def _mode(args: Any, where: str) -> str | None:
    try:
        return requested_mode(getattr(args, "fp32_lm_head", None))
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
