"""SkyRL 0.4.0's Megatron backend on a real megatron-core GPTModel (CPU, gloo): what each rank runs.

A job names an import root (none: the environment's stock SkyRL; or a copy patched by
``fp32patch apply``) and runs, each in turn: SkyRL's own ``MegatronModelWrapper`` built over a
GPTModel in megatron-core's Float16Module, as SkyRL's Megatron worker builds it (its trainer config,
its policy loss from ``PolicyLossRegistry``), then

- ``forward`` (the old log-probs, forward-only through Megatron's schedule), and
- ``forward_backward_mini_batch`` (one training step's forward and backward through Megatron's
  schedule and SkyRL's ``loss_func``: the PPO loss with an entropy term),

over one micro-batch of three samples in SkyRL's layout (each a left-padded block, prompt then
response; the response-level tensors right-aligned) that SkyRL packs into one row (``remove_microbatch_padding``, its default: ``preprocess_packed_seqs``, thd
``PackedSeqParams``), its logits divided by the temperature in place, log-probs and entropy from
SkyRL's own vocab-parallel code. Under tensor parallelism each rank holds its vocabulary shard.

Stand-ins, named: Megatron Bridge's two PEFT helpers the wrapper imports
(``megatron.bridge.peft.utils``: no expert-parallel adapters here, and the deferred grad sync is
the worker's optimizer step, not run); Transformer Engine's packed (thd) attention, which
megatron-core's own DotProductAttention refuses (``PackedAttention``: causal attention within each
``cu_seqlens`` segment); Megatron's optimizer as far as the schedule calls it (``scale_loss``);
Megatron's DDP as ``emulate_ddp`` gives it, with gradient-accumulation fusion into ``main_grad``
turned on for a wired output layer only (the stock layer's fused kernel is CUDA's).
Megatron's RNG tracker forks nothing (no dropout) and its collectives' buffers are CPU ones
(megatron_harness.py), and so is the token counter Megatron's no-pipelining schedule
allocates on CUDA by name (``cpu_schedule``).

Recorded per run: the log-probs of both calls, the entropy, the loss, the decoder's output (the
head's input) and the output weight with its gradient (gathered over the tensor-parallel ranks),
the wiring's mode, and whether fp32patch was imported.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

import torch
from megatron_harness import V, close_parallel, config, emulate_ddp, gpt_model, init_parallel, run_phases
from nemo_rl_fused import _gather

TEMPERATURE = 0.7
# SkyRL's layout (convert_prompts_responses_to_batch_tensors): each sample one left-padded block,
# prompt then response, so every row ends with its response's last token; the response-level
# tensors ([B, RESPONSE]) are right-aligned the same way
PROMPTS = (3, 2, 5)  # each sample's prompt tokens
RESPONSES = (3, 4, 2)  # each sample's response tokens
LENGTH = max(p + r for p, r in zip(PROMPTS, RESPONSES, strict=True))
RESPONSE = max(RESPONSES)
ENTROPY_COEF = 0.01
MAX_LEN = 32


def run(name: str, switch: str | None = None, *, chunk: int | None = None, fused: bool = False) -> dict:
    """One run: ``switch`` is trainer.fp32_lm_head (None: not set), ``chunk`` SkyRL's
    ``logprobs_chunk_size`` (None: its default), ``fused`` its ``fused_lm_head_logprob`` (whose
    entropy is a metric only: SkyRL refuses an entropy loss there, so the run has none)."""
    return {"name": name, "switch": switch, "chunk": chunk, "fused": fused}


def worker(rank: int, world: int, init_method: str, job: dict) -> None:
    init_parallel(rank, world, init_method)
    if job["root"]:
        sys.path.insert(0, job["root"])
    sys.path.insert(0, job["repo"])
    from tests.heavy.skyrl.py311 import allow_skyrl

    allow_skyrl()
    install_megatron_bridge()
    cpu_schedule()
    try:
        results = run_phases(job["phases"], lambda spec: one_run(rank, world, spec))
        import skyrl

        results["skyrl"] = skyrl.__file__
        torch.save(results, os.path.join(job["out"], f"rank{rank}.pt"))
    finally:
        close_parallel()


def install_megatron_bridge() -> None:
    """``megatron.bridge.peft.utils``'s two helpers the wrapper imports (module docstring)."""

    def enable_expert_parallel_grad_sync_in_finalize(model_chunks) -> None:
        assert not any("experts" in name for chunk in model_chunks for name, _ in chunk.named_parameters())

    def finalize_model_grads_with_expert_adapter_sync(model_chunks, num_tokens=None) -> None:
        raise AssertionError("the deferred grad sync is the worker's optimizer step, which this run does not take")

    utils = ModuleType("megatron.bridge.peft.utils")
    utils.enable_expert_parallel_grad_sync_in_finalize = enable_expert_parallel_grad_sync_in_finalize
    utils.finalize_model_grads_with_expert_adapter_sync = finalize_model_grads_with_expert_adapter_sync
    for name in ("megatron.bridge", "megatron.bridge.peft"):
        sys.modules.setdefault(name, ModuleType(name))
    sys.modules["megatron.bridge.peft.utils"] = utils


class PackedAttention(torch.nn.Module):
    """Transformer Engine's packed attention where megatron-core's local spec has none: causal
    softmax attention within each segment of ``packed_seq_params.cu_seqlens_q_padded`` (query
    [t, heads, d], key and value [t, groups, d], as megatron-core's attention hands thd input)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **_: object) -> None:
        super().__init__()
        self.config = config

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):  # fmt: skip
        assert packed_seq_params is not None and packed_seq_params.qkv_format == "thd", "SkyRL packs: thd only"
        bounds = packed_seq_params.cu_seqlens_q_padded.tolist()
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        out = torch.empty_like(query)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [heads, n, d]
            out[start:end] = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1)
        return out


class _CpuCounters(ModuleType):
    """torch as Megatron's no-pipelining schedule sees it here: its token counter, which it
    allocates on CUDA by name, on the CPU; everything else torch's own."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, device=None, **kwargs):
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kwargs)


def cpu_schedule() -> None:
    from megatron.core.pipeline_parallel import schedules

    schedules.torch = _CpuCounters("torch")


class LossScaler:
    """Megatron's optimizer as far as its schedule and SkyRL's wrapper call it: ``scale_loss``
    (no loss scaling in bf16)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


def gpt(cfg):
    """A GPTModel with rotary positions (SkyRL's packed input has none of its own) and the packed
    attention above, its parameters given Megatron DDP's ``main_grad``."""
    model = gpt_model(cfg, core_attention=PackedAttention, max_sequence_length=MAX_LEN, position_embedding_type="rope")
    for param in model.parameters():
        emulate_ddp(param)
    return model


def micro_batch() -> dict:
    """SkyRL's micro-batch of three samples: the keys its Megatron worker puts in each."""
    gen = torch.Generator().manual_seed(11)
    rows, masks, loss_masks = [], [], []
    for prompt, response in zip(PROMPTS, RESPONSES, strict=True):
        ids = torch.randint(1, V, (prompt + response,), generator=gen)
        row = torch.zeros(LENGTH, dtype=torch.long)
        mask = torch.zeros(LENGTH, dtype=torch.long)
        row[LENGTH - prompt - response :] = ids
        mask[LENGTH - prompt - response :] = 1
        rows.append(row)
        masks.append(mask)
        loss_masks.append((torch.arange(RESPONSE) >= RESPONSE - response).float())
    sequences, attention_mask = torch.stack(rows), torch.stack(masks)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    loss_mask = torch.stack(loss_masks)
    old = torch.full((len(PROMPTS), RESPONSE), -4.0)
    return {
        "sequences": sequences,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "num_actions": RESPONSE,
        "old_action_log_probs": old,
        "base_action_log_probs": old.clone(),
        "advantages": torch.linspace(-1.0, 1.0, len(PROMPTS))[:, None].expand(-1, RESPONSE).contiguous(),
        "loss_mask": loss_mask,
        "rollout_action_logprobs": None,
        "response_mask": loss_mask.clone(),
        "rollout_expert_indices": None,
        "router_padding_mask": None,
        "sample_support": None,
        "sub_seq_lengths": None,
        "is_padding_batch": False,
        "num_microbatches": 1,
        "num_real_microbatches": 1,
    }


def trainer_config(spec: dict):
    from skyrl.train.config import TrainerConfig

    cfg = TrainerConfig()
    cfg.strategy = "megatron"
    cfg.remove_microbatch_padding = True
    cfg.fused_lm_head_logprob = spec["fused"]
    cfg.algorithm.use_entropy_loss = not spec["fused"]
    cfg.algorithm.entropy_loss_coef = ENTROPY_COEF
    cfg.algorithm.use_kl_loss = False
    if spec["chunk"] is not None:
        cfg.logprobs_chunk_size = spec["chunk"]
    if spec["switch"] is not None:
        cfg.fp32_lm_head = spec["switch"]  # the field the patched TrainerConfig has
    return cfg


def one_run(rank: int, world: int, spec: dict) -> dict:
    from megatron.core.transformer.module import Float16Module
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry
    from skyrl.backends.skyrl_train.workers.megatron.megatron_model_wrapper import MegatronModelWrapper

    cfg = trainer_config(spec)
    mcfg = config(hidden_dropout=0.0, attention_dropout=0.0, num_query_groups=2)
    model = gpt(mcfg)
    chunk = Float16Module(mcfg, model)
    wrapper = MegatronModelWrapper(
        config=cfg,
        actor_module=[chunk],
        actor_optimizer=LossScaler(),
        policy_loss_fn=PolicyLossRegistry.get(cfg.algorithm.policy_loss_type),
    )
    if _mode(model.output_layer) is not None:
        # Megatron's DDP config would on a GPU: the wired head accumulates its weight gradient
        # into main_grad in fp32 (the stock layer's fused kernel is CUDA's, so only a wired one)
        model.output_layer.gradient_accumulation_fusion = True
    seen: list = []
    model.decoder.register_forward_hook(lambda module, args, out: seen.append(out.detach().clone()))
    batch = micro_batch()
    seq_len = batch["sequences"].shape[1]
    wrapper.eval()
    with torch.no_grad():
        old = wrapper.forward([dict(batch)], seq_len, micro_batch_size=3, temperature=TEMPERATURE)
    wrapper.train()
    captured: dict = {}
    wrapper.policy_loss_fn = spy(wrapper.policy_loss_fn, captured)
    metrics = wrapper.forward_backward_mini_batch([dict(batch)], seq_len, micro_batch_size=3, temperature=TEMPERATURE)
    weight = model.output_layer.weight
    return {
        "old_log_probs": old.detach().float().clone(),
        "log_probs": captured["log_probs"],
        "log_probs_dtype": str(captured["dtype"]),
        "metrics": metrics,
        "hidden": seen[-1],  # [t, 1, h]: every rank's whole (no sequence parallelism)
        "weight": _gather(weight.detach().float(), dim=0),
        "weight_grad": _gather(weight.main_grad.clone(), dim=0),
        "grads": {n: p.main_grad.clone() for n, p in model.named_parameters()},
        "sequences": batch["sequences"],
        "attention_mask": batch["attention_mask"],
        "loss_mask": batch["loss_mask"],
        "mode": _mode(model.output_layer),
    }


def _mode(layer) -> str | None:
    heads = sys.modules.get("fp32patch.runtime.heads.megatron")  # off, never imported: the run must not need it
    return heads.fp32_lm_head_mode(layer) if heads is not None else None


def spy(fn, captured: dict):
    """The policy loss SkyRL's ``loss_func`` calls, recording the action log-probs it is handed."""

    def wrapped(log_probs, *args, **kwargs):
        captured["log_probs"] = log_probs.detach().float().clone()
        captured["dtype"] = log_probs.dtype
        return fn(log_probs, *args, **kwargs)

    return wrapped


def reference(record: dict, world: int, cfg) -> dict[str, torch.Tensor]:
    """float64 from the very operands the head met (the decoder's output and the output weight):
    the action log-probs, their masked entropy, and the output weight's gradient of the step's
    loss, SkyRL's own policy loss (``cfg.algorithm``'s) less the entropy bonus where the run has
    one, as its ``loss_func`` composes them for one micro-batch on one data-parallel rank."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    hidden = record["hidden"][:, 0].double()  # [t, h]
    weight = record["weight"].double().requires_grad_()  # [v, h]
    logp_all = torch.log_softmax(hidden @ weight.t() / TEMPERATURE, dim=-1)
    entropy_all = -(logp_all.exp() * logp_all).sum(-1)
    lengths = record["attention_mask"].sum(-1)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (lengths + (-lengths % world)).cumsum(0)[:-1]])
    logp = torch.zeros(len(PROMPTS), RESPONSE, dtype=torch.float64)
    entropy = torch.zeros_like(logp)
    for i, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        # every action column (those before a short response hold prompt tokens: computed by
        # SkyRL too, and masked out of the loss)
        for j in range(RESPONSE):
            column = LENGTH - RESPONSE + j
            token = column - (LENGTH - prompt - response)  # its index in the sample
            position = int(starts[i]) + token - 1  # the packed position that predicts it
            logp[i, j] = logp_all[position, record["sequences"][i, column]]
            entropy[i, j] = entropy_all[position]
    mask = record["loss_mask"].double()
    entropy_mean = (entropy * mask).sum() / mask.sum()
    batch = micro_batch()
    policy_loss, _ = PolicyLossRegistry.get(cfg.algorithm.policy_loss_type)(
        logp, batch["old_action_log_probs"].double(), batch["advantages"].double(), config=cfg.algorithm,
        loss_mask=mask, rollout_logprobs=None,
    )  # fmt: skip
    loss = policy_loss - ENTROPY_COEF * entropy_mean if cfg.algorithm.use_entropy_loss else policy_loss
    (weight_grad,) = torch.autograd.grad(loss, weight)
    return {"log_probs": logp.detach(), "entropy": entropy_mean.detach(), "weight_grad": weight_grad}
