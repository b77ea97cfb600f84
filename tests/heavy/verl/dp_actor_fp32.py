"""A pytest plugin for verl's own dp_actor test (``tests/workers/actor/test_special_dp_actor.py``
of a verl checkout) with the switch on: each Hugging Face model handed to verl's
``DataParallelPPOActor`` first gets fp32patch's head through ``fp32patch.runtime.verl.wiring.wire_hf``,
as the patched legacy FSDP worker does before it builds the actor, and every batch runs at
temperature 0.7 (the test's own data say 1.0, where verl skips the in-place division).

What the head returned is recorded (``FP32PATCH_DP_ACTOR_REPORT``, one JSON line per rank):
how many models were wired, which were not (the test's mock has no ``get_output_embeddings``,
as no verl model lacks), and the dtype of every logits tensor the wired heads returned.
Loaded with ``-p dp_actor_fp32`` (this folder on ``PYTHONPATH``); nothing of verl's changes.
"""

from __future__ import annotations

import atexit
import json
import os

import torch

TEMPERATURE = 0.7
_record: dict = {"wired": 0, "not_wired": [], "dtypes": [], "temperatures": []}


def pytest_configure(config) -> None:
    from verl.workers.actor import dp_actor

    from fp32patch.runtime.verl.wiring import wire_hf

    actor_cls = dp_actor.DataParallelPPOActor
    init, compute_log_prob, update_policy = actor_cls.__init__, actor_cls.compute_log_prob, actor_cls.update_policy

    def __init__(self, config, actor_module, actor_optimizer=None):
        if hasattr(actor_module, "get_output_embeddings"):
            wire_hf(actor_module, {"fp32_lm_head": "fp32out"}, role="actor")
            head = actor_module.get_output_embeddings()
            head.register_forward_hook(lambda module, args, out: _record["dtypes"].append(str(out.dtype)))
            _record["wired"] += 1
        else:
            _record["not_wired"].append(type(actor_module).__name__)
        init(self, config, actor_module, actor_optimizer)

    def at_temperature(method):
        def wrapper(self, data, *args, **kwargs):
            data.meta_info["temperature"] = TEMPERATURE
            _record["temperatures"].append(TEMPERATURE)
            return method(self, data, *args, **kwargs)

        return wrapper

    actor_cls.__init__ = __init__
    actor_cls.compute_log_prob = at_temperature(compute_log_prob)
    actor_cls.update_policy = at_temperature(update_policy)
    atexit.register(_write)


def _write() -> None:
    path = os.environ.get("FP32PATCH_DP_ACTOR_REPORT")
    if path:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else int(os.environ.get("RANK", 0))
        with open(f"{path}.rank{rank}", "w") as handle:
            json.dump(_record, handle)
