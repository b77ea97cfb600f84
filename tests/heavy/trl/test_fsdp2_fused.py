"""TRL 1.16's fused forward under FSDP2, on two gloo ranks: what TRL hands fp32patch's chunked
log-probs, and the gradient that comes back to the sharded head.

A tiny Qwen2 in fp32 (the master weights), TRL's own ``add_fused_lm_head`` (from the patched
tree), then FSDP2 as accelerate lays it out (each decoder layer a unit; ``param_dtype`` bf16,
``reduce_dtype`` fp32) under TRL's bf16 autocast, the model marked by fp32patch's wiring:

- ``root``: the head in the root unit. During the forward FSDP2 has unsharded it, so TRL
  passes the bf16 unsharded weight;
- ``own-unit``: the head a unit of its own, which its own forward would unshard but TRL's fused
  forward never calls. TRL then gathers the sharded fp32 DTensor with ``full_tensor()``.

On each rank the log-probs are float64's for the operands TRL passed, after their bf16 cast, to
1e-5. The head's gradient reaches the sharded fp32 master weight as FSDP2 delivers it:

- ``root``: reduce-scattered, the average over both ranks' batches, to the bf16 rounding of the
  unsharded gradient (FSDP2's own precision, the stock head's too);
- ``own-unit``: ``full_tensor()``'s backward takes each rank's slice of its own gradient, with
  no reduction, so a rank's shard holds its own batch's gradient alone. That is TRL's layout, not
  fp32patch's: TRL's own kernel gets the same (checked by hand, 2026-12-03: the same error
  against the average, 0.99973). Keep the head in the root unit (accelerate's transformer-layer
  wrapping does).
"""

from __future__ import annotations

import pytest
import torch

from tests.heavy.trl.grpo_run import TEMPERATURE, tiny_untied_qwen2

pytestmark = pytest.mark.xdist_group("trainers")

VOCAB, HIDDEN, TOKENS = 384, 64, 12


def _model():
    return tiny_untied_qwen2(VOCAB, HIDDEN)


def _rank(rank: int, world: int, out_dir: str) -> None:
    from pathlib import Path

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from trl.trainer.utils import add_fused_lm_head

    from fp32patch.runtime.trl import fused

    layout = Path(out_dir).name.split("-", 1)[1]
    model = _model()
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    fused.mark(model, "fp32out", role="policy")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    if layout == "own-unit":
        fully_shard(model.lm_head, mp_policy=policy)
    fully_shard(model, mp_policy=policy)

    seen = []
    original = fused.ChunkedLogProbs.apply

    def spy(self, hidden, weight, *rest, **kwargs):
        seen.append((hidden.detach().clone(), weight.detach().clone(), type(weight).__name__))
        return original(self, hidden, weight, *rest, **kwargs)

    fused.ChunkedLogProbs.apply = spy
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own batch, as data parallelism has it
    ids = torch.randint(0, VOCAB, (2, TOKENS), generator=gen)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, fused_lm_head=True)
    (-out.log_probs.sum()).backward()
    grad = model.lm_head.weight.grad.full_tensor()
    ((hidden, weight, kind),) = seen
    torch.save(
        {"log_probs": out.log_probs.detach(), "hidden": hidden, "weight": weight, "kind": kind, "targets": ids[:, 1:],
         "grad": grad, "master": str(model.lm_head.weight.dtype)},
        Path(out_dir) / f"rank{rank}.pt",
    )  # fmt: skip


def _float64(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, grad: bool = False):
    """log-probs of the bf16-cast operands in float64, and (``grad``) the head weight's gradient of -sum."""
    w = weight.to(torch.bfloat16).double().requires_grad_(grad)
    h = hidden.to(torch.bfloat16).double().reshape(*targets.shape, -1)
    logp = torch.log_softmax((h @ w.T) / TEMPERATURE, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if grad:
        (-logp.sum()).backward()
        return logp, w.grad
    return logp


@pytest.mark.parametrize("layout", ["root", "own-unit"])
def test_fsdp2_hands_the_chunked_log_probs_trls_operands_and_gets_the_gradient_back(layout, tmp_path):
    from tests.heavy.transformers.hf_harness import spawn

    out = tmp_path / f"fsdp2-{layout}"
    out.mkdir()
    spawn(_rank, 2, str(out))
    ranks = [torch.load(out / f"rank{r}.pt") for r in range(2)]
    grads = []
    for got in ranks:
        # what TRL passed: the unsharded bf16 parameter (root), or the gathered fp32 master (own unit)
        assert (got["kind"], str(got["weight"].dtype)) == (
            ("Parameter", "torch.bfloat16") if layout == "root" else ("Tensor", "torch.float32")
        )
        assert got["master"] == "torch.float32"
        logp, grad = _float64(got["hidden"], got["weight"], got["targets"], grad=True)
        assert got["log_probs"].dtype == torch.float32
        assert (got["log_probs"].double() - logp).abs().max() < 1e-5
        grads.append(grad)
    if layout == "root":
        want_grad = (grads[0] + grads[1]) / 2  # FSDP2 averages over the ranks
    else:
        want_grad = torch.cat([grads[0][: VOCAB // 2], grads[1][VOCAB // 2 :]])  # each shard its own rank's
    for got in ranks:
        error = (got["grad"].double() - want_grad).abs().max() / want_grad.abs().max()
        assert error < 2**-7, error  # the unsharded bf16 gradient's rounding, at most
