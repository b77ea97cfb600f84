"""slime's Megatron side on a real megatron-core GPTModel (CPU, gloo): what each spawned process runs.

A job names a tree of the stand-in slime checkout (tests/fixtures/slime_src, stock or patched by
``fp32patch apply``) and runs, in order, each with its command line: slime's ``parse_args`` (the
guard, where patched), ``setup_model_and_optimizer`` (the provider, Megatron's ``get_model``, the
wiring where patched), then one training step through the tree's ``train_step``: a packed batch-1
micro-batch (three samples in one row, attention block-diagonal, positions restarting), the logits
divided by the rollout temperature, log-probs and entropy by slime's chunked code, a policy-gradient
loss with an entropy bonus, backward into Megatron DDP's ``main_grad``. Under tensor parallelism
(two ranks) each rank holds its vocabulary shard of the logits (``parallel_output``) and slime's
log-prob code reduces over the group. Where the flag is on, the
server arguments of one SGLang server are computed too (SGLang's ServerArgs stood in).

Stand-ins, named: ``megatron.training`` (Megatron-LM's, which needs Python 3.12's typing here):
``get_model`` calls the provider and wraps the model in megatron-core's own Float16Module, and gives
every parameter DDP's ``main_grad`` (``emulate_ddp``); gradient-accumulation fusion into it is turned
on for a wired output layer only (the stock layer's fused kernel is CUDA's). Megatron's RNG tracker
forks nothing and the causal mask is passed (nemo_rl_fused.py). Recorded per run: the log-probs, the
entropy, the decoder's output and the output weight, every parameter's gradient, the head's mode,
what the guard said; per phase, which fp32patch modules the process had imported.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import torch
from megatron_harness import S, V, close_parallel, config, emulate_ddp, init_parallel, run_phases
from nemo_rl_fused import PACKED_LENGTHS, _gather, packed_microbatch

TEMPERATURE = 0.7
RESPONSES = (2, 1, 2)  # each packed sample's response tokens (the rest is its prompt)
ENTROPY_COEF = 0.01
BASE_ARGV = [
    "train.py",
    "--hf-checkpoint",
    "/models/tiny",
    "--rollout-temperature",
    str(TEMPERATURE),
    "--entropy-coef",
    str(ENTROPY_COEF),
    "--untie-embeddings-and-output-weights",
    "--bf16",
]


def run(name: str, *argv: str, role: str = "actor") -> dict:
    return {"name": name, "argv": [*BASE_ARGV, *argv], "role": role}


def worker(rank: int, world: int, init_method: str, job: dict) -> None:
    init_parallel(rank, world, init_method)
    sys.path[:0] = [job["root"], job["providers"], job["repo"]]
    from tests.fixtures.slime_shapes import install_sglang

    install_sglang()
    install_megatron_training()
    try:
        results = run_phases(job["phases"], one_run)
        torch.save(results, os.path.join(job["out"], f"rank{rank}.pt"))
    finally:
        close_parallel()


def install_megatron_training() -> None:
    """``megatron.training``'s two entry points slime's files import (module docstring)."""
    from megatron.core.transformer.module import Float16Module

    def core_transformer_config_from_args(args):
        return config(hidden_dropout=0.0, attention_dropout=0.0)

    def get_model(provider, model_type, wrap_with_ddp=True):
        torch.manual_seed(0)
        chunk = provider(pre_process=True, post_process=True)
        model = Float16Module(chunk.config, chunk)
        for param in model.parameters():
            emulate_ddp(param)
        return [model]

    training = ModuleType("megatron.training")
    training.training = ModuleType("megatron.training.training")
    training.training.get_model = get_model
    training.arguments = ModuleType("megatron.training.arguments")
    training.arguments.core_transformer_config_from_args = core_transformer_config_from_args
    sys.modules.update(
        {
            "megatron.training": training,
            "megatron.training.training": training.training,
            "megatron.training.arguments": training.arguments,
        }
    )


def slime_batch() -> dict:
    """slime's packed micro-batch: one row of samples, each a prompt then its response."""
    packed = packed_microbatch()
    ids = packed["input_ids"][0]
    samples = list(ids.split(list(PACKED_LENGTHS)))
    advantages = [torch.linspace(-1.0, 1.0, n) * (i + 1) for i, n in enumerate(RESPONSES)]
    return {
        "tokens": packed["input_ids"],
        "position_ids": packed["position_ids"],
        "attention_mask": packed["attention_mask"],
        "unconcat_tokens": samples,
        "total_lengths": list(PACKED_LENGTHS),
        "response_lengths": list(RESPONSES),
        "advantages": advantages,
    }


def one_run(spec: dict) -> dict:
    import importlib

    sys.argv = spec["argv"]
    arguments = importlib.import_module("slime.utils.arguments")
    model_module = importlib.import_module("slime.backends.megatron_utils.model")
    args = arguments.parse_args()
    model, _, _ = model_module.setup_model_and_optimizer(args, spec["role"])
    gpt = model[0].module
    layer = gpt.output_layer
    heads = sys.modules.get("fp32patch.runtime.heads.megatron")  # never imported here: the run must not need it
    mode = heads.fp32_lm_head_mode(layer) if heads is not None else None
    record: dict = {"mode": mode, "layer": type(layer).__name__}
    if spec["role"] == "critic":
        return record
    if mode is not None:
        layer.gradient_accumulation_fusion = True  # Megatron's DDP config would on a GPU (module docstring)
    seen: dict = {}
    gpt.decoder.register_forward_hook(lambda module, inputs, out: seen.__setitem__("hidden", out.detach()))

    batch = slime_batch()
    reported = model_module.train_step(args, model, batch)
    if getattr(args, "fp32_lm_head", None):
        engine = importlib.import_module("slime.backends.sglang_utils.sglang_engine")
        kwargs, _ = engine._compute_server_args(args, 0, "127.0.0.1:5000", 5001, "127.0.0.1", 30001)
        record["sglang_flag"] = kwargs.get("enable_fp32_lm_head")
    record.update(
        log_probs=torch.cat(reported["log_probs"]).detach().clone(),
        entropy=torch.cat(reported["entropy"]).detach().clone(),
        hidden=seen["hidden"][:, 0].float().clone(),  # [s, h]
        weight=_gather(layer.weight.detach().float(), dim=0),  # [v, h], this rank's rows gathered
        weight_grad=_gather(layer.weight.main_grad, dim=0),
        grads={n: p.main_grad.clone() for n, p in gpt.named_parameters()},
        ids=batch["tokens"][0].clone(),
    )
    return record


def reference(record: dict, temperature: float = TEMPERATURE) -> dict[str, torch.Tensor]:
    """float64 log-probs and entropy at ``temperature`` of the run's own hidden states and output
    weight, and the weight gradient of the run's loss through them."""
    hidden = record["hidden"].double()
    weight = record["weight"].double().requires_grad_()
    logits = hidden @ weight.t() / temperature  # [s, v]
    logp_all = torch.log_softmax(logits, dim=-1)
    ids = record["ids"]
    rows, targets = [], []
    end = 0
    for length, response in zip(PACKED_LENGTHS, RESPONSES, strict=True):
        end += length
        for position in range(end - response, end):
            rows.append(position - 1)
            targets.append(int(ids[position]))
    rows_t, targets_t = torch.tensor(rows), torch.tensor(targets)
    logp = logp_all[rows_t, targets_t]
    entropy = -(logp_all.exp() * logp_all).sum(-1)[rows_t]
    advantages = slime_batch()["advantages"]
    loss = -(torch.cat(advantages).double() * logp).mean() - ENTROPY_COEF * entropy.mean()
    (weight_grad,) = torch.autograd.grad(loss, weight)
    return {"log_probs": logp.detach(), "entropy": entropy.detach(), "weight_grad": weight_grad}


assert S == sum(PACKED_LENGTHS) and V > 0
