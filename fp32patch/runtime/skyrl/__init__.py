"""What SkyRL's patched files call: one field of its config, ``trainer.fp32_lm_head``, turns the
fp32 LM head on in the trainer (FSDP's ``HFModelWrapper`` and Megatron's model chunks, policy and
reference) and in every vLLM server, and checks the servers at startup.

SkyRL's glue, on the stack kit (``fp32patch.runtime.kit``, whose docstring is the contract):
``config``: its rules; ``wiring``: the trainers' heads and the servers' arguments; ``fused``: the
FSDP wrapper's log-probs and entropy from fp32patch's chunked piece, inside the head's call,
without the [B, T, V] logits; ``megatron``: the Megatron wrapper's fused LM-head path, the same; ``probe``: every server's workers checked over HTTP
(``/collective_rpc``) through SkyRL's worker extension.

The API the patched files call (stable: images patched by this release import these names):

- ``check_config(cfg, where="validate_cfg")``: the guard, on SkyRL's config, in ``validate_cfg``.
- ``engine_args(args, cfg)``: in ``build_vllm_cli_args`` before it returns the servers' arguments.
- ``probe_servers(cfg, server_urls)``: in ``build_new_inference_client`` once the servers are up;
  each answers ``PROBE_RPC`` by ``collective_rpc`` into ``worker_report(worker)``.
- ``wire_hf(wrapper, cfg, role=...)``: in the FSDP workers after ``strategy.prepare``; ``role`` is
  "policy" or "reference model".
- ``model_call(wrapper, targets, temperature, log_probs, entropy)``, ``log_probs_fn(stock)``,
  ``entropy_fn(stock)``: in ``HFModelWrapper.forward`` for a marked wrapper (``MARK``).
- ``wire_megatron(wrapper)``: at the end of ``MegatronModelWrapper.__init__``'s set-up.
- ``fused_mode(weight)``, ``scaled_weight(weight, temperature)``, ``fused_logprobs(hidden, weight,
  target, vocab_start, tp_group, inference_only)``, ``fused_entropy(hidden, weight, tp_group,
  temperature)``: in the fused LM-head path's functions of ``model_utils.py``, where the weight is
  a head ``wire_megatron`` wired (``megatron``).

Importing this module imports neither torch, vLLM, Ray nor SkyRL.
"""

from __future__ import annotations

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.kit.probe import PROBE_RPC
from fp32patch.runtime.skyrl.config import KEY, SkyRLSettings, check_config, validate_fp32_lm_head_config
from fp32patch.runtime.skyrl.fused import MARK, HeldLogProbs, entropy_fn, log_probs_fn, model_call
from fp32patch.runtime.skyrl.megatron import fused_entropy, fused_logprobs, fused_mode, scaled_weight
from fp32patch.runtime.skyrl.probe import check_servers, probe_servers, worker_report
from fp32patch.runtime.skyrl.wiring import engine_args, wire_hf, wire_megatron

__all__ = [
    "KEY",
    "MARK",
    "PROBE_RPC",
    "Fp32LmHeadConfigError",
    "Fp32LmHeadMismatchError",
    "HeldLogProbs",
    "SkyRLSettings",
    "check_config",
    "check_servers",
    "engine_args",
    "entropy_fn",
    "fused_entropy",
    "fused_logprobs",
    "fused_mode",
    "log_probs_fn",
    "model_call",
    "probe_servers",
    "scaled_weight",
    "validate_fp32_lm_head_config",
    "wire_hf",
    "wire_megatron",
    "worker_report",
]
