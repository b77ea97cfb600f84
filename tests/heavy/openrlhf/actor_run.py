"""One policy step of OpenRLHF 0.11.2's own ``Actor`` under real DeepSpeed on gloo ranks, in a
process of its own (so that the stock tree and the patched one never meet in one interpreter):

    python -m tests.heavy.openrlhf.actor_run SETTINGS_JSON OUT_DIR

The settings name the model folder, the switch (None: off, or a trainer mode), the ZeRO stages
to run in turn (a fresh ``Actor`` and engine each) and the world size. Each rank, per stage:

- OpenRLHF's ``DeepspeedStrategy`` gives the DeepSpeed config (``get_ds_train_config``: its ZeRO,
  bf16 and clipping settings, its AdamW group) and the optimizer's parameter groups
  (``_get_model_parameters``). Its ``setup_distributed`` and ``prepare`` are not run: they
  hard-code CUDA (``torch.cuda.set_device``, a "cuda" device mesh) and DeepSpeed's FusedAdam,
  which the CPU accelerator would compile first (~90 s); here ``deepspeed.initialize`` gets that
  config with ``torch_adam`` added, and the engine goes into ``actor.model`` as ``prepare`` puts
  it. ZeRO-3's persistence threshold is 0, so the tiny head is partitioned as a real one is;
- ``Actor(model_dir, ...)``: loaded by OpenRLHF (under ZeRO-3 with ``HfDeepSpeedConfig`` alive,
  so transformers' ``zero.Init`` partitions it at load), torch's SDPA attention (flash-attn is
  the suite's stand-in, ``stand_in/``), ``packing_samples=True``, temperature 0.7;
- a batch of two sequences of different lengths (left-padded prompt, response of 5), packed by
  OpenRLHF (``unpad_and_slice_tensor``); the old log-probs under ``no_grad`` (as the experience
  maker computes them), then the log-probs and the entropy with gradients, OpenRLHF's
  ``PolicyLoss``, ``strategy.backward`` and ``strategy.optimizer_step``.

Recorded per stage: the action log-probs and entropy, the final norm's hidden states and the
gathered head weight (to recompute the log-probs in float64 from the very operands), the loss,
the head's gradient as DeepSpeed holds it (this rank's ZeRO-3 partition, or ZeRO-2's full fp32
gradient), the fp32 master of the head and a digest of every master after the step, and
whether fp32patch was imported.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

TEMPERATURE = 0.7
RESPONSE = 5


def batch(rank: int, vocab: int):
    """Two sequences (lengths 12 and 8 of 12: the second's prompt left-padded), token ids of
    ``rank``'s own draw, and the mask of their last ``RESPONSE`` tokens."""
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    sequences = torch.randint(1, vocab, (2, 12), generator=gen)
    attention_mask = torch.ones_like(sequences)
    attention_mask[1, :4] = 0
    sequences[1, :4] = 0
    action_mask = torch.ones((2, RESPONSE), dtype=torch.bool)
    return sequences, attention_mask, action_mask


def _strategy(stage: int, world: int):
    from openrlhf.utils.deepspeed import DeepspeedStrategy

    args = SimpleNamespace(
        ds=SimpleNamespace(param_dtype="bf16", adam_offload=False, zpg=1, tensor_parallel_size=1, ring_attn_size=1),
        train=SimpleNamespace(dynamic_batch_enable=False),
        local_rank=-1,
    )
    return DeepspeedStrategy(seed=0, max_norm=1.0, micro_train_batch_size=2, train_batch_size=2 * world,
                             zero_stage=stage, args=args)  # fmt: skip


def _ds_config(strategy, stage: int) -> dict:
    optim = {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}}
    config = strategy.get_ds_train_config(optim_dict=optim, max_norm=1.0)
    config["optimizer"]["params"]["torch_adam"] = True  # not FusedAdam: the CPU accelerator would compile it
    if stage == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return config


def _repair_zero3_load(model, model_dir: str) -> list[str]:
    """The parameters that transformers' ZeRO-3 load (under ``zero.Init``, through OpenRLHF's
    ``from_pretrained``) left unequal to the checkpoint, each written again from it; their names.

    On this CPU (transformers 5.15, DeepSpeed 0.19.6, gloo), that load now and then leaves one
    parameter uninitialized (values of 1e38, seen on a k_proj; a NaN forward follows), the
    stock tree and the patched one alike: an upstream fault outside what this suite checks, so
    the run repairs it and records it, rather than fail at random."""
    import deepspeed
    import torch
    from safetensors.torch import load_file

    checkpoint = load_file(str(Path(model_dir) / "model.safetensors"))
    repaired = []
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if not torch.equal(param.detach(), checkpoint[name].to(param.dtype)):
                repaired.append(name)
                with torch.no_grad():
                    param.copy_(checkpoint[name])
    return repaired


def run_stage(rank: int, world: int, settings: dict, stage: int) -> dict:
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_local_grad
    from openrlhf.models import Actor, PolicyLoss

    switch = settings["switch"]
    strategy = _strategy(stage, world)
    config = _ds_config(strategy, stage)
    torch.manual_seed(0)
    actor = Actor(settings["model"], attn_implementation="sdpa", param_dtype="bf16",
                  ds_config=config if stage == 3 else None, packing_samples=True, temperature=TEMPERATURE)  # fmt: skip
    if switch is not None:
        # what the patched PolicyModelActor does once its Actor is built: the gate fp32patch put in
        # OpenRLHF's files, with --fp32_lm_head in the namespace
        from openrlhf.models import actor as actor_module

        actor_module._fp32patch_wire(actor, SimpleNamespace(fp32_lm_head=switch), "actor")
    repaired = _repair_zero3_load(actor.model, settings["model"]) if stage == 3 else []
    raw, params = strategy._get_model_parameters(actor, optim="adam", weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=raw, model_parameters=params, config=config,
                                      args={"local_rank": rank}, dist_init_required=False)  # fmt: skip
    actor.model = engine
    module = engine.module
    head = module.lm_head.weight
    vocab = module.config.vocab_size
    captured: list = []
    hook = module.model.norm.register_forward_hook(lambda m, a, out: captured.append(out.detach().clone()))

    sequences, attention_mask, action_mask = batch(rank, vocab)
    with torch.no_grad():
        old = actor(sequences, action_mask, attention_mask)
    captured.clear()
    log_probs, output = actor(sequences, action_mask, attention_mask, return_output=True, return_entropy=True)
    entropy = output.entropy[:, -RESPONSE:]
    (hidden,) = captured
    hook.remove()
    with deepspeed.zero.GatheredParameters([head], enabled=stage == 3):
        weight = head.detach().clone()
    advantages = torch.tensor([[1.0], [-0.5]]).expand(2, RESPONSE)
    loss, *_ = PolicyLoss()(log_probs, old, advantages, action_mask=action_mask.float())
    loss = loss - 0.01 * (entropy * action_mask).sum() / action_mask.sum()
    strategy.backward(loss, actor, None)
    grad = safe_get_local_grad(head) if stage == 3 else safe_get_full_grad(head)
    grad = None if grad is None else grad.detach().clone()
    master_before = safe_get_full_fp32_param(head).clone()
    strategy.optimizer_step(None, actor, None)
    master_after = safe_get_full_fp32_param(head).clone()
    digest = torch.stack([safe_get_full_fp32_param(p).double().sum() for p in module.parameters()])
    record = {
        "log_probs": log_probs.detach(), "old_log_probs": old.detach(), "entropy": entropy.detach(),
        "loss": loss.detach(), "hidden": hidden, "weight": weight, "sequences": sequences,
        "attention_mask": attention_mask, "grad": grad, "partition": head.ds_tensor.numel() if stage == 3 else None,
        "master_before": master_before, "master_after": master_after, "digest": digest,
        "log_probs_dtype": str(log_probs.dtype), "weight_dtype": str(weight.dtype), "repaired": repaired,
    }  # fmt: skip
    del engine, actor
    return record


def _rank(rank: int, world: int, out_dir: str) -> None:
    import importlib

    import torch

    settings = json.loads((Path(out_dir) / "settings.json").read_text())
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import deepspeed

    # DeepSpeed's shared-memory all-reduce would be compiled with ninja at the first init (~90 s on
    # two cores); ZeRO's collectives are torch.distributed's gloo ones
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    records = {f"zero{stage}": run_stage(rank, world, settings, stage) for stage in settings["stages"]}
    records["fp32patch_imported"] = "fp32patch" in sys.modules
    import openrlhf

    records["openrlhf_file"] = openrlhf.__file__
    torch.save(records, Path(out_dir) / f"rank{rank}.pt")


def main(settings_path: str, out_dir: str) -> None:
    from tests.heavy.transformers.hf_harness import spawn

    settings = json.loads(Path(settings_path).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(settings))
    spawn(_rank, settings["world"], str(out))


if __name__ == "__main__":
    main(*sys.argv[1:])
