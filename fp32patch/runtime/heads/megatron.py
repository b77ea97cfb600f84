"""fp32 logits from Megatron-Core's output layer: ``apply_fp32_lm_head(model, mode)``.

Megatron computes the LM head in ``ColumnParallelLinear.forward``: it sets up the tensor-
parallel region, calls ``self._forward_impl(input=..., weight=..., bias=..., ...)`` for
the local GEMM (with the sequence-parallel all-gather and the input-gradient all-reduce
fused into it), then gathers the vocabulary shards if ``gather_output`` asks. This module
replaces ``_forward_impl`` on the output layer *instance* and nothing else, so the
weight it is handed (its own, or the embedding's when embeddings and output weights are
tied), ``runtime_gather_output``, the output gather, MTP heads and the bias handling all
stay Megatron's. The replacement expresses the two fused collectives with Megatron's
own autograd mappings (``gather_from_sequence_parallel_region``: all-gather forward,
reduce-scatter backward; ``copy_to_tensor_model_parallel_region``: identity forward,
all-reduce backward) around the fp32-output GEMM of ``lm_head_gemm``. The difference
from Megatron's fused version: the collectives are not overlapped with the backward
GEMMs, and under sequence parallelism the gathered input (``[s, b, h]`` rather than the
local shard) is kept for the backward.

Supported: ``megatron.core.tensor_parallel.ColumnParallelLinear`` (the GPT, hybrid/Mamba
and multimodal output layer). Refused with a clear error: Transformer Engine's MXFP8 LM
head (it has no ``_forward_impl``), deferred embedding wgrad
(``defer_embedding_wgrad_compute``), GTP weight rematerialisation and Megatron-FSDP.

Nothing here imports torch or Megatron at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fp32patch.runtime.kernels.lm_head_gemm import lm_head_linear
from fp32patch.runtime.modes import trainer_mode

if TYPE_CHECKING:
    import torch

# Where a language model sits inside what Megatron (or a VL / Omni model) hands over:
# DDP and Float16Module keep it in ``.module``, Qwen-Omni-style models in ``.thinker``,
# Nemotron VL wrappers in ``.llava_model``, LLaVA-style models in ``.language_model``.
_NESTING_ATTRS = ("module", "thinker", "llava_model", "language_model")


class Fp32ForwardImpl:
    """Stands in for ``ColumnParallelLinear._forward_impl`` on one output layer.

    Its presence in the layer's ``__dict__`` is the marker that the layer was converted,
    and ``mode`` says how.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def __repr__(self) -> str:
        return f"Fp32ForwardImpl(mode={self.mode!r})"

    def __call__(
        self,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        gradient_accumulation_fusion: bool = False,
        allreduce_dgrad: bool = False,
        sequence_parallel: bool = False,
        grad_output_buffer: list[Any] | None = None,
        wgrad_deferral_limit: int | None = None,
        tp_group: Any = None,
        gtp_remat_size: int = 1,
        **unknown: Any,
    ) -> torch.Tensor:
        if unknown:
            # A newer Megatron passing something we do not know could change the meaning.
            raise TypeError(
                "fp32 LM head: ColumnParallelLinear._forward_impl was called with "
                f"{sorted(unknown)}, which this wrapper (written against megatron-core "
                "0.19) does not know; upgrade fp32patch or turn fp32_lm_head off"
            )
        if grad_output_buffer is not None:
            raise NotImplementedError(_DEFERRED_WGRAD)
        if gtp_remat_size > 1:
            raise NotImplementedError(_GTP_REMAT)
        if sequence_parallel or allreduce_dgrad:
            from megatron.core.tensor_parallel import mappings

            if sequence_parallel:
                input = mappings.gather_from_sequence_parallel_region(
                    input, tensor_parallel_output_grad=True, group=tp_group
                )
            else:
                input = mappings.copy_to_tensor_model_parallel_region(input, group=tp_group)
        return lm_head_linear(input, weight, bias, self.mode, gradient_accumulation_fusion)


_DEFERRED_WGRAD = (
    "fp32 LM head: defer_embedding_wgrad_compute is not supported (the deferred weight "
    "gradient would be computed from bf16 buffers outside the head); turn it off"
)
_GTP_REMAT = "fp32 LM head: GTP weight rematerialisation (gtp_remat_size > 1) is not supported"


def apply_fp32_lm_head(model: Any, mode: Any) -> list[Any]:
    """Make the output layer of each last-pipeline-stage chunk of ``model`` give fp32 logits.

    ``model`` is one module or the list of model chunks Megatron returns; each chunk is
    searched through ``.module``, ``.thinker``, ``.llava_model`` and ``.language_model``
    for the module that owns ``output_layer``. A chunk whose ``post_process`` is False (not
    the last pipeline stage) is skipped; one that claims the last stage but has no output
    layer is an error naming its type. ``mode`` is ``True``/``"fp32"``, ``"tf32"``,
    ``"fp32out"``, ``"fp32out-hilo"`` or ``"fp32out-bf16grad"`` (see ``modes.py``); ``False``/``None`` does
    nothing and returns ``[]`` (it does not undo an earlier call), so a trainer can pass
    its config value straight through. Anything else raises ``ValueError``.

    Applying the same mode again is a no-op. Applying a different mode to a converted
    layer raises ``ValueError``: two code paths that disagree on the mode are a config
    bug, and switching silently would hide it. All layers are checked before any is
    changed, so an error leaves the model as it was.

    Returns the output layers that now give fp32 logits (already converted ones included),
    in chunk order.
    """
    resolved = trainer_mode(mode)
    if resolved is None:
        return []
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    layers: list[Any] = []
    for chunk in chunks:
        layer = _output_layer(chunk)
        if layer is not None and all(layer is not seen for seen in layers):
            _check_convertible(layer, resolved)
            layers.append(layer)
    for layer in layers:
        if not isinstance(layer.__dict__.get("_forward_impl"), Fp32ForwardImpl):
            layer._forward_impl = Fp32ForwardImpl(resolved)
    return layers


def fp32_lm_head_mode(layer: Any) -> str | None:
    """The mode ``layer`` was converted with, or None if it was not."""
    impl = getattr(layer, "__dict__", {}).get("_forward_impl")
    return impl.mode if isinstance(impl, Fp32ForwardImpl) else None


def _output_layer(chunk: Any) -> Any | None:
    """The output layer of ``chunk``, or None when the chunk is not a last stage."""
    node, path = chunk, type(chunk).__name__
    post_process = getattr(node, "post_process", True)
    seen: set[int] = set()
    while getattr(node, "output_layer", None) is None and id(node) not in seen:
        seen.add(id(node))
        for attr in _NESTING_ATTRS:
            child = getattr(node, attr, None)
            if child is not None:
                node, path = child, f"{path}.{attr}"
                # The innermost model knows best which pipeline stage it is.
                post_process = getattr(node, "post_process", post_process)
                break
        else:
            break
    if not post_process:
        return None
    layer = getattr(node, "output_layer", None)
    if layer is None:
        where = path if node is chunk else f"{path} ({type(node).__name__})"
        raise ValueError(
            f"fp32 LM head: {where} is the last pipeline stage (post_process=True) but has "
            f"no output_layer; searched through .{', .'.join(_NESTING_ATTRS)}"
        )
    return layer


def _check_convertible(layer: Any, mode: str) -> None:
    current = fp32_lm_head_mode(layer)
    if current is not None:
        if current != mode:
            raise ValueError(
                f"fp32 LM head: {type(layer).__name__} already runs in mode {current!r}; "
                f"refusing to switch it to {mode!r} (two callers disagree on the mode)"
            )
        return
    kinds = type(layer).__mro__
    if not any(k.__name__ == "ColumnParallelLinear" for k in kinds) or not callable(
        getattr(type(layer), "_forward_impl", None)
    ):
        raise TypeError(
            f"fp32 LM head: output_layer is a {type(layer).__module__}.{type(layer).__name__}; "
            "only Megatron-Core's ColumnParallelLinear (with its _forward_impl) is supported"
        )
    if "_forward_impl" in layer.__dict__:
        raise TypeError(
            f"fp32 LM head: {type(layer).__name__}._forward_impl was already replaced by "
            f"{layer.__dict__['_forward_impl']!r}; refusing to stack on it"
        )
    config = getattr(layer, "config", None)
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise NotImplementedError(_DEFERRED_WGRAD)
    if getattr(layer, "gtp_remat_size", 1) > 1:
        raise NotImplementedError(_GTP_REMAT)
