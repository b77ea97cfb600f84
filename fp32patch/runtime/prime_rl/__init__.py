"""What Prime-RL's patched files call: Prime-RL's own switch, ``inference.enable_fp32_lm_head``
(default true), turns the trainer's LM head to fp32 grade too.

Prime-RL's glue, on the stack kit (``fp32patch.runtime.kit``, whose docstring is the contract):
``config``: its rules; ``wiring``: the rl launcher's config and the RL trainer's model;
``head``: fp32-grade forwards for the heads Prime-RL's ``inject_prime_lm_head`` installs (the
fused ones through ``kernels.chunked_logprobs``); ``probe``: every vLLM worker checked when the
inference server starts. The rollout's fp32 head is Prime-RL's own monkey-patch, kept and probed.

- ``check_rl_config(config, where=...)``: ``RLConfig``'s validator (the rl launcher).
- ``wire_trainer(model, config, where=...)``: the RL trainer's model after ``setup_model``.
- ``worker_report(worker)``: each vLLM worker's answer to the probe's RPC.
- ``probe_workers(engine_client, args, where=...)``: the server's probe, once the engine is up.

Importing this module imports neither torch, vLLM nor Prime-RL.
"""

from __future__ import annotations

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.prime_rl.config import (
    KEY,
    TRAINER_KEY,
    PrimeRlSettings,
    validate_rl_config,
    validate_trainer_config,
)
from fp32patch.runtime.prime_rl.probe import probe_workers, worker_report
from fp32patch.runtime.prime_rl.wiring import check_rl_config, wire_trainer

__all__ = [
    "KEY",
    "TRAINER_KEY",
    "Fp32LmHeadConfigError",
    "Fp32LmHeadMismatchError",
    "PrimeRlSettings",
    "check_rl_config",
    "probe_workers",
    "validate_rl_config",
    "validate_trainer_config",
    "wire_trainer",
    "worker_report",
]
