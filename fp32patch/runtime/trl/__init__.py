"""What TRL's patched files call: one switch, ``fp32_lm_head`` (a field of every TRL config),
turns the fp32 LM head on in the trainer (policy and reference model) and in vLLM, colocated or
served by ``trl vllm-serve``.

TRL's glue, on the stack kit (``fp32patch.runtime.kit``, whose docstring is the contract):
``config``: its rules; ``wiring``: the trainer's models, the colocated vLLM's switch and the
server's command line; ``fused``: TRL 1.15+'s chunked log-probs at fp32 grade; ``probe``: vLLM's
workers checked at startup.

- ``check_trainer(trainer, path)``: the guard, in every TRL trainer once ``Trainer.__init__`` ran.
- ``wire_trainer(trainer, path)``: GRPO's and RLOO's policy and reference model, once built.
- ``fused_kernel(model)``: in TRL's ``add_fused_lm_head`` forward, for a model the switch marks
  (``MARK``), in place of TRL's ``ChunkedLogProbFunction``.
- ``set_vllm_env(model, where=...)`` before a colocated ``LLM(...)``; ``probe_colocated(llm,
  model)`` once it is built; ``probe_server(client, model)`` once TRL's ``VLLMClient`` is up.
- ``serve_command(script_args, command, env)``: ``trl vllm-serve``'s ``vllm serve`` command line.

Importing this module imports neither torch, vLLM nor TRL.
"""

from __future__ import annotations

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.trl.config import KEY, TrlSettings, check_config, validate_fp32_lm_head_config
from fp32patch.runtime.trl.fused import MARK, ChunkedLogProbs, fused_kernel
from fp32patch.runtime.trl.probe import check_reports, probe_colocated, probe_server
from fp32patch.runtime.trl.wiring import check_trainer, serve_command, set_vllm_env, wire_trainer

__all__ = [
    "KEY",
    "MARK",
    "ChunkedLogProbs",
    "Fp32LmHeadConfigError",
    "Fp32LmHeadMismatchError",
    "TrlSettings",
    "check_config",
    "check_reports",
    "check_trainer",
    "fused_kernel",
    "probe_colocated",
    "probe_server",
    "serve_command",
    "set_vllm_env",
    "validate_fp32_lm_head_config",
    "wire_trainer",
]
