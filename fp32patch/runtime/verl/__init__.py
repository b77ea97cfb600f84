"""What verl's patched files call: one key, ``actor_rollout_ref.model.fp32_lm_head``, turns the
fp32 LM head on in the trainer (actor and ref) and in every rollout server.

verl's glue, on the stack kit (``fp32patch.runtime.kit``, whose docstring is the contract):
``config``: its rules; ``wiring``: the heads on the models verl builds and the switch in its
rollout servers; ``probe``: the servers' check of their vLLM workers. The heads are every
stack's (``fp32patch.runtime.heads``), as is the worker-side measurement (``heads.vllm_probe``).

- ``check_config(config, where=...)``: the guard, from ``verl.utils.config.validate_config``.
- ``wire_hf(module, model_config, role=...)``: the FSDP engine's and the legacy FSDP workers'
  actor and ref, once wrapped; ``wire_megatron(modules, model_config, role=...)``: the Megatron
  engine's and legacy workers'.
- ``set_vllm_env(model_config, where=...)``: in each vLLM rollout server before its engine starts.
- ``sglang_args(args, model_config, ServerArgs, where=...)``: before SGLang's ``ServerArgs(**args)``;
  ``probe_sglang(tokenizer_manager, model_config, where=...)`` once that server is up.
- ``probe_vllm_model(model)`` in each vLLM worker (``PROBE_RPC``), and ``probe_server`` in the server;
  ``probe_model`` where vLLM runs in the trainer's process (0.6.1, 0.7.0).
- ``fused_logprobs(hidden, weight, targets, temperature, backend=...)``: verl's fused kernels
  (``use_fused_kernels``: torch, liger, triton) at fp32 grade on a wired head (``verl.fused``);
  None for any other weight.

Importing this module imports neither torch, vLLM nor verl.
"""

from __future__ import annotations

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.heads.vllm_probe import probe_vllm_model
from fp32patch.runtime.kit.probe import PROBE_RPC
from fp32patch.runtime.modes import VLLM_ENV_VAR
from fp32patch.runtime.verl.config import KEY, VerlSettings, check_config, validate_fp32_lm_head_config
from fp32patch.runtime.verl.fused import fused_logprobs
from fp32patch.runtime.verl.probe import check_reports, probe_model, probe_server, probe_sglang
from fp32patch.runtime.verl.wiring import set_vllm_env, sglang_args, wire_hf, wire_megatron

__all__ = [
    "KEY",
    "PROBE_RPC",
    "VLLM_ENV_VAR",
    "Fp32LmHeadConfigError",
    "Fp32LmHeadMismatchError",
    "VerlSettings",
    "check_config",
    "check_reports",
    "fused_logprobs",
    "probe_model",
    "probe_server",
    "probe_sglang",
    "probe_vllm_model",
    "set_vllm_env",
    "sglang_args",
    "validate_fp32_lm_head_config",
    "wire_hf",
    "wire_megatron",
]
