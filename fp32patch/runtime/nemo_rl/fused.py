"""NeMo-RL's fused log-prob path (``policy.megatron_cfg.use_fused_linear_logprobs``) at fp32 grade.

Stock NeMo-RL's fused path replaces ``GPTModel.forward``: it runs the decoder and hands the
hidden states and the output weight to ``ChunkedDistributedHiddenStatesToLogprobs``, which
computes each chunk's logits in bf16 (then ``.float()``), so the output layer, and fp32patch's
head on it, never runs. The patched ``nemo_rl/distributed/model_utils.py`` calls
``fused_logprobs`` there instead, and gets None back (the stock path runs, bit for bit) unless
the model's output layer gives fp32 logits: fp32patch's wiring converted it (its mode), or, on
NeMo-RL after its September 2026 rework, NeMo-RL's own head does (the provider's
``logit_dtype`` float32, whose backward rounds grad_output to bf16: ``fp32out-bf16grad``).

The temperature: stock NeMo-RL divides whatever the model returned by the training temperature
(``apply_temperature_scaling`` in ``nemo_rl/models/megatron/train.py``), which on the fused
path are the log-probs: it trains on ``log p / T``, not on ``log softmax(z / T)``. Here the
patched ``forward_with_post_processing_fn`` hands the temperature over first
(``fused_temperature``), the logits are divided by it in fp32 inside
``kernels.chunked_logprobs``, and the log-probs come back marked with it, so the patched
``apply_temperature_scaling`` leaves them alone (``check_fused_temperature``).

Layout, as NeMo-RL's: the hidden states [s, b, h] (this rank's [s / tp, b, h] under sequence
parallelism), the labels [b, s] (the input ids; the target of each position is the next one),
the log-probs [b, s - 1] in fp32. Vocabulary-parallel output layers (tensor parallelism, with or
without sequence parallelism) are computed on the rank's shard with the statistics all-reduced;
a tied head reads the shared embedding (``shared_embedding_or_output_weight``); Megatron's
``gradient_accumulation_fusion`` adds the weight gradient into ``main_grad``.
"""

from __future__ import annotations

import threading
from typing import Any

from fp32patch.runtime.nemo_rl.config import STACK

# NeMo-RL's own fp32 head (after its rework) computes the logits with an fp32-output GEMM and
# its backward from grad_output rounded to bf16: the fused path computes what it would.
UPSTREAM_HEAD_MODE = "fp32out-bf16grad"
# Where the log-probs say which temperature their logits were divided by.
TEMPERATURE_MARK = "_fp32patch_temperature"

_pending = threading.local()


def fused_temperature(sampling_params: Any) -> None:
    """Called by the patched ``forward_with_post_processing_fn`` before the model runs: the
    temperature (``sampling_params.temperature``, 1 without sampling parameters) that this
    thread's next fused forward applies to its fp32 logits."""
    temperature = getattr(sampling_params, "temperature", None) if sampling_params is not None else None
    _pending.temperature = 1.0 if temperature is None else float(temperature)


def _take_temperature() -> float:
    """The temperature handed over for this forward (1 where none was: the mark then tells the
    patched ``apply_temperature_scaling`` that a temperature did not reach the fused path)."""
    temperature = getattr(_pending, "temperature", None)
    _pending.temperature = None
    return 1.0 if temperature is None else temperature


def fused_mode(model: Any) -> str | None:
    """The mode in which ``model``'s (a GPTModel's) output layer gives fp32 logits, or None."""
    from fp32patch.runtime.heads.megatron import fp32_lm_head_mode

    layer = getattr(model, "output_layer", None)
    mode = fp32_lm_head_mode(layer) if layer is not None else None
    if mode is not None:
        return mode
    import torch

    if getattr(getattr(model, "config", None), "logit_dtype", None) is torch.float32:
        return UPSTREAM_HEAD_MODE
    return None


def fused_logprobs(model: Any, hidden_states: Any, labels: Any) -> Any:
    """NeMo-RL's fused log-probs of ``model`` (the GPTModel whose forward this is, on the last
    pipeline stage) from the decoder's ``hidden_states`` and the ``labels``; None where its
    output layer gives no fp32 logits (the stock fused path then runs)."""
    mode = fused_mode(model)
    if mode is None:
        return None
    from fp32patch.runtime.kernels.chunked_logprobs import chunked_logprobs

    group, world = _tensor_parallel_group(model)
    config = getattr(model, "config", None)
    if getattr(config, "context_parallel_size", 1) > 1:
        raise NotImplementedError(
            "fp32patch: NeMo-RL's fused log-prob path does not take context parallelism (nor does NeMo-RL's "
            "own); set policy.megatron_cfg.use_fused_linear_logprobs to false"
        )
    if getattr(model, "share_embeddings_and_output_weights", False):
        weight = model.shared_embedding_or_output_weight()
    else:
        weight = model.output_layer.weight
    temperature = _take_temperature()
    sequence_parallel = bool(getattr(config, "sequence_parallel", False)) and world > 1
    targets = labels.roll(shifts=-1, dims=-1).t()  # [s, b]: each position's next token
    log_probs = chunked_logprobs(
        hidden_states,
        weight,
        targets,
        mode=mode,
        temperature=temperature,
        tp_group=group if world > 1 else None,
        sequence_parallel=sequence_parallel,
        fuse_wgrad=bool(getattr(model.output_layer, "gradient_accumulation_fusion", False)),
        keep_logits=False,  # NeMo-RL's own fused path holds no [T, V] tensor at its peak, nor does this
    )
    STACK.tell_once(
        ("fused", mode, world, sequence_parallel),
        "fp32patch: NeMo-RL's fused log-prob path (use_fused_linear_logprobs) computes fp32 logits per tile "
        "in mode %r (tensor parallel size %d%s), the temperature applied to them in fp32; "
        "fused_linear_logprobs_chunk_size does not apply (the tile is chunked_logprobs' measured default)",
        mode,
        world,
        ", sequence parallel" if sequence_parallel else "",
    )
    out = log_probs.t().contiguous()[:, :-1]  # [b, s - 1], as NeMo-RL's fused path returns them
    setattr(out, TEMPERATURE_MARK, temperature)
    return out


def check_fused_temperature(log_probs: Any, sampling_params: Any) -> None:
    """Called by the patched ``apply_temperature_scaling`` on log-probs ``fused_logprobs``
    returned: their logits were divided by the training temperature already, so they must not
    be divided again; refuses log-probs computed at another temperature than the one asked."""
    expected = getattr(sampling_params, "temperature", None) if sampling_params is not None else None
    expected = 1.0 if expected is None else float(expected)
    applied = getattr(log_probs, TEMPERATURE_MARK)
    if applied != expected:
        raise RuntimeError(
            f"fp32patch: NeMo-RL's fused log-probs were computed at temperature {applied} but the training "
            f"temperature is {expected}: the temperature did not reach the fused forward (a NeMo-RL whose "
            "forward_with_post_processing_fn fp32patch did not patch; run fp32patch apply on this checkout)"
        )


def _tensor_parallel_group(model: Any) -> tuple[Any, int]:
    """The output layer's tensor-parallel group (Megatron's, where the layer names none) and its size."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None, 1
    group = getattr(model.output_layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
    return group, dist.get_world_size(group)
