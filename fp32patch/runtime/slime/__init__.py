"""What slime's patched files call: one flag, ``--fp32-lm-head MODE``, turns the fp32 LM head on in
slime's Megatron model and in every SGLang rollout server.

slime's glue, on the stack kit (``fp32patch.runtime.kit``, whose docstring is the contract):
``config``: its rules; ``wiring``: the Megatron model every provider builds and each server's
arguments; ``probe``: each server checked at startup. The Megatron head is every stack's
(``heads.megatron``), SGLang's switch, hazards and probe the kit's (``kit.sglang``).

- ``check_args(args, where=...)``: the guard, in slime's ``parse_args``.
- ``wire_model(model, args, role=...)``: the chunks ``get_model`` returns in
  ``setup_model_and_optimizer``.
- ``server_args(kwargs, args, ServerArgs, where=...)``: each server's arguments, before
  ``ServerArgs(**kwargs)``.
- ``probe_engine(engine)``: each ``SGLangEngine`` once its server is up (or reached).

slime has no fused log-prob path: its log-prob code (full and chunked) reads the logits the
output layer returns, which the wired head computes in fp32.

Importing this module imports neither torch, Megatron, SGLang nor slime.
"""

from __future__ import annotations

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.slime.config import FLAG, SlimeSettings, check_args, validate_fp32_lm_head_config
from fp32patch.runtime.slime.probe import probe_engine
from fp32patch.runtime.slime.wiring import server_args, wire_model

__all__ = [
    "FLAG",
    "Fp32LmHeadConfigError",
    "Fp32LmHeadMismatchError",
    "SlimeSettings",
    "check_args",
    "probe_engine",
    "server_args",
    "validate_fp32_lm_head_config",
    "wire_model",
]
