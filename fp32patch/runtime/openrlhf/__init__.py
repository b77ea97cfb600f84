"""What OpenRLHF's patched files call: one flag, ``--fp32_lm_head MODE`` of ``train_ppo_ray``, turns
the fp32 LM head on in the trainer (the policy, the reference and the EMA ``Actor``) and in every
vLLM rollout engine, and checks the engines at startup.

OpenRLHF's glue, on the stack kit (``fp32patch.runtime.kit``, whose docstring is the contract):
``config``: its rules; ``wiring``: the actors' heads and the engines' Ray actors; ``fused``: the
actor's log-probs and entropy from fp32patch's chunked piece, inside the head's call, without the
[B, T, V] logits; ``probe``: every engine's workers checked through ``WorkerWrap`` and vLLM's
``collective_rpc``.

The API the patched files call (stable: images patched by this release import these names):

- ``check_config(args, where="train_ppo_ray")``: the guard, on ``train_ppo_ray``'s parsed
  arguments (flat or nested namespace), before ``train(args)``.
- ``wire_actor(actor, args, role=...)``: after an ``Actor(...)`` is built and before DeepSpeed
  wraps it; ``role`` is "actor", "reference model" or "EMA model".
- ``model_call(actor, targets, log_probs, entropy, entropy_after_temperature=...)``: in
  ``Actor.forward`` in place of ``self.model`` for a marked actor (``MARK``).
- ``log_probs_fn(stock)`` / ``entropy_fn(stock)``: in ``Actor.forward`` in place of
  ``log_probs_from_logits`` / ``compute_entropy`` for a marked actor.
- ``engine_options(actor_cls, actor_kwargs)``: in ``create_vllm_engines``, in place of
  ``RolloutRayActor.options`` (``LLMRayActor.options``); may change ``actor_kwargs`` in place.
- ``probe_engines(engines)``: in ``create_vllm_engines`` once the engines are built, before
  sleep mode; each engine answers ``PROBE_RPC`` by ``collective_rpc`` into ``worker_report(worker)``
  in its ``WorkerWrap``.

Importing this module imports neither torch, vLLM, Ray nor OpenRLHF.
"""

from __future__ import annotations

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.kit.probe import PROBE_RPC
from fp32patch.runtime.openrlhf.config import KEY, OpenRLHFSettings, check_config, validate_fp32_lm_head_config
from fp32patch.runtime.openrlhf.fused import MARK, Fp32LogProbs, entropy_fn, log_probs_fn, model_call
from fp32patch.runtime.openrlhf.probe import check_engines, probe_engines, worker_report
from fp32patch.runtime.openrlhf.wiring import engine_options, wire_actor

__all__ = [
    "KEY",
    "MARK",
    "PROBE_RPC",
    "Fp32LmHeadConfigError",
    "Fp32LmHeadMismatchError",
    "Fp32LogProbs",
    "OpenRLHFSettings",
    "check_config",
    "check_engines",
    "engine_options",
    "entropy_fn",
    "log_probs_fn",
    "model_call",
    "probe_engines",
    "validate_fp32_lm_head_config",
    "wire_actor",
    "worker_report",
]
