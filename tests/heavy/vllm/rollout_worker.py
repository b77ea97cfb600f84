"""A vLLM worker process as verl's rollout server spawns them: it sets nothing of ours.

Its own module, apart from the suite's conftest (which clears the variable when a spawned
process imports it): what the worker sees is what it inherited from the process that spawned it.
"""

from __future__ import annotations

import os
import sys

import torch

from fp32patch.runtime.vllm_probe import probe_vllm_model
from tests.heavy.vllm import tiny

VAR = "NRL_VLLM_FP32_LM_HEAD"


def worker(rank: int, world: int, init_method: str, root: str, drop_var: bool, results) -> None:
    """Load the tiny model from the patched import root ``root`` and record the probe's report;
    ``drop_var``: the worker's environment loses the variable (workers the switch did not reach,
    as when it is set after the engine started)."""
    sys.path.insert(0, root)
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    if drop_var:
        os.environ.pop(VAR, None)
    with tiny.session(init_method, world=world, rank=rank) as builder:
        model = builder.model()
        gen = torch.Generator().manual_seed(7)
        weight = (torch.randn(tiny.VOCAB, tiny.HIDDEN, generator=gen) * 0.5).to(torch.bfloat16)
        model.load_weights([("lm_head.weight", weight)])
        results[rank] = probe_vllm_model(model)
