"""What AReaL's patched files call: one key, ``enable_fp32_lm_head`` in the actor's backend section
(``actor.megatron.`` or ``actor.fsdp.``), turns the fp32 LM head on in AReaL's trainer and in every
SGLang or vLLM rollout server.

AReaL's glue, on the stack kit (``fp32patch.runtime.kit``, whose docstring is the contract):
``config``: its rules; ``wiring``: the train engines' models, the servers' arguments and the vLLM
workers' environment; ``probe``: each server checked once the controller started it. The heads
are every stack's (``heads.megatron``, ``heads.hf``), SGLang's and vLLM's switches and probes the
kit's.

- ``check_config(config, where=...)``: the guard, in ``load_expr_config``.
- ``wire_engine(engine, trainer=...)``: ``FSDPEngine.initialize`` (after FSDP2) and
  ``MegatronEngine.initialize`` (after ``make_mcore_model``).
- ``server_args(args, config, backend)``: each rollout server's arguments, in
  ``PPOTrainer._init_rollout``.
- ``probe_rollout(controller, config, backend, role=...)``: once the controller started them.
- ``worker_report(worker)``: in each vLLM worker (AReaL's worker extension).

AReaL has no fused log-prob path: its FSDP and Megatron engines compute log-probs and entropy (in
chunks, with the temperature) from the logits the head returns, which the wired head computes in
fp32.

Importing this module imports neither torch, SGLang, vLLM nor AReaL.
"""

from __future__ import annotations

from fp32patch.runtime.areal.config import KEY_NAME, MODE, ArealSettings, validate_fp32_lm_head_config
from fp32patch.runtime.areal.probe import probe_rollout, worker_report
from fp32patch.runtime.areal.wiring import check_config, server_args, wire_engine
from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError

__all__ = [
    "KEY_NAME",
    "MODE",
    "ArealSettings",
    "Fp32LmHeadConfigError",
    "Fp32LmHeadMismatchError",
    "check_config",
    "probe_rollout",
    "server_args",
    "validate_fp32_lm_head_config",
    "wire_engine",
    "worker_report",
]
