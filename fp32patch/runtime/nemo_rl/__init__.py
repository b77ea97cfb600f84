"""What NeMo-RL's patched files call: one config turns the fp32 LM head on in both engines.

NeMo-RL's glue, on the stack kit (``fp32patch.runtime.kit``, whose docstring is the contract):
``config``: its rules; ``wiring``: the trainer's head on the models NeMo-RL builds; ``probe``:
the driver's verdict on the vLLM workers' reports. The heads are every stack's
(``fp32patch.runtime.heads``), as is the worker-side measurement (``heads.vllm_probe``).

- ``check_config(cfg, where=...)``: the config guard, run in the driver before any worker
  starts and again in each Megatron and DTensor worker.
- ``wire_megatron(model, megatron_cfg)``: the fp32 output layer on every model chunk that
  ``get_model`` returned.
- ``wire_dtensor(model, dtensor_cfg)``: the fp32 LM head on the DTensor workers' (v1, v2)
  Hugging Face model, once it is parallelized, loaded and re-tied.
- ``probe_vllm_model(model)``: run inside each vLLM worker once the model is loaded.
- ``check_probe_reports(reports, settings, where=...)``: in the driver, refuses to go on when
  a vLLM worker's logits disagree with the trainer's.
- ``fused_logprobs(model, hidden_states, labels)``: NeMo-RL's fused log-prob path
  (``use_fused_linear_logprobs``) at fp32 grade where the model's output layer gives fp32
  logits (None: the stock path runs); ``fused_temperature(sampling_params)`` hands it the
  training temperature before the forward, and ``check_fused_temperature(log_probs,
  sampling_params)`` keeps NeMo-RL from dividing its log-probs by it again (``nemo_rl.fused``).

Patched files import this module by this name (``fp32patch.runtime.nemo_rl``) and call the
names below; they stay as they are for every file that an older fp32patch patched. Importing
it imports neither torch, vLLM nor Megatron.
"""

from __future__ import annotations

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.heads.vllm_probe import probe_vllm_model
from fp32patch.runtime.kit.probe import PROBE_RPC
from fp32patch.runtime.modes import VLLM_ENV_VAR
from fp32patch.runtime.nemo_rl.config import Fp32LmHeadSettings, check_config, validate_fp32_lm_head_config
from fp32patch.runtime.nemo_rl.fused import check_fused_temperature, fused_logprobs, fused_temperature
from fp32patch.runtime.nemo_rl.probe import check_probe_reports
from fp32patch.runtime.nemo_rl.wiring import wire_dtensor, wire_megatron

__all__ = [
    "PROBE_RPC",
    "VLLM_ENV_VAR",
    "Fp32LmHeadConfigError",
    "Fp32LmHeadMismatchError",
    "Fp32LmHeadSettings",
    "check_config",
    "check_fused_temperature",
    "check_probe_reports",
    "fused_logprobs",
    "fused_temperature",
    "probe_vllm_model",
    "validate_fp32_lm_head_config",
    "wire_dtensor",
    "wire_megatron",
]
