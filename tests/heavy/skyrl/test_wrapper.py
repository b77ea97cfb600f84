"""SkyRL 0.4.0's own ``HFModelWrapper`` (its FSDP backend's model wrapper): a policy step with a
packed batch-1 input, the temperature divided in place, and backward (``wrapper_run.py``), three
ways:

- the environment's stock SkyRL (no patched root on the path);
- the patched root with ``trainer.fp32_lm_head`` off: stock, bit for bit (log-probs, entropy,
  loss, the head's gradient), fp32patch never imported;
- the patched root with ``trainer.fp32_lm_head=fp32out``, wired as the patched FSDP worker wires
  the wrapper: the log-probs and the entropy equal float64's of the very operands the head met
  (the final norm's bf16 hidden states and the bf16 head) within 1e-4, the head's gradient equals
  float64's within its bf16 rounding, while stock's log-probs are off by bf16 logits' rounding;
- the same two ways over a tiny Gemma 2 that soft-caps its final logits: switched on, the
  log-probs and the entropy of the capped fp32 logits (float64's within 1e-4, the cap biting),
  the head's gradient through the cap; stock's from the capped bf16 logits.

Not run here: SkyRL's FSDP worker itself (``FSDPPolicyWorkerBase.init_model`` needs Ray and CUDA;
the run calls the gate the worker calls), FSDP2's sharding, Ulysses sequence parallelism,
flash-attn's kernels (the stand-in packs; SDPA reads the packed position ids).
"""

from __future__ import annotations

import pytest
import torch

from tests.heavy.openrlhf import harness
from tests.heavy.skyrl.wrapper_run import RESPONSE, TEMPERATURE, loss_of
from tests.heavy.vllm_engine.harness import CAP


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir, capped_model_dir, patched_root):
    cache: dict[str, dict] = {}

    def get(way: str) -> dict:
        if way not in cache:
            model = capped_model_dir if way.endswith("-capped") else model_dir
            settings = {"model": str(model), "switch": "fp32out" if way.startswith("on") else None}
            out = tmp_path_factory.mktemp(f"skyrl-wrapper-{way}")
            harness.run("tests.heavy.skyrl.wrapper_run", settings, out, None if way == "stock" else patched_root)
            cache[way] = torch.load(out / "record.pt")
        return cache[way]

    return get


def _float64(rec: dict, cap: float | None = None) -> dict:
    """Log-probs, entropy and the head's gradient of the step, in float64 from the hidden states
    and the head weight the forward met (the packed rows' logits, soft-capped at ``cap`` where
    given, over the vocabulary / T)."""
    seqs, mask = rec["sequences"], rec["attention_mask"]
    batch, seqlen = seqs.shape
    rows = torch.nonzero(mask.flatten()).flatten()
    targets = torch.roll(seqs.flatten()[rows], -1)
    weight = rec["weight"].double().requires_grad_()
    logits = rec["hidden"][0].double() @ weight.T
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    logits = logits / TEMPERATURE
    logp = torch.log_softmax(logits, -1)
    token = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)

    def unpack(values):
        full = torch.zeros(batch * seqlen, dtype=torch.float64).index_put((rows,), values)
        return full.view(batch, seqlen)[:, -RESPONSE - 1 : -1]

    log_probs, entropy = unpack(token), unpack(ent)
    loss_of(log_probs, rec["old_log_probs"].double(), entropy).backward()
    return {"log_probs": log_probs.detach(), "entropy": entropy.detach(), "grad": weight.grad}


def test_off_is_stock_bit_for_bit(runs):
    stock, off = runs("stock"), runs("off")
    assert "patched-roots" in off["skyrl_file"] and "patched-roots" not in stock["skyrl_file"]
    assert not off["fp32patch_imported"]
    for name in ("log_probs", "old_log_probs", "entropy_full", "loss", "grad"):
        assert torch.equal(stock[name], off[name]), name


def test_on_is_float64_grade(runs):
    on = runs("on")
    ref = _float64(on)
    assert on["fp32patch_imported"] and on["log_probs_dtype"] == "torch.float32"
    assert (on["log_probs"].double() - ref["log_probs"]).abs().max() < 1e-4
    assert (on["entropy"].double() - ref["entropy"]).abs().max() < 1e-4
    assert torch.equal(on["old_log_probs"], on["log_probs"])  # no_grad and grad passes agree
    scale = ref["grad"].abs().max()
    assert (on["grad"].double() - ref["grad"]).abs().max() <= scale * 2**-7


def test_a_soft_capped_model_gets_the_capped_fp32_log_probs_and_gradient(runs):
    on, stock = runs("on-capped"), runs("stock-capped")
    ref, uncapped = _float64(on, cap=CAP), _float64(on)
    assert on["fp32patch_imported"] and on["log_probs_dtype"] == "torch.float32"
    assert (ref["log_probs"] - uncapped["log_probs"]).abs().max() > 0.1  # the cap bites
    assert (on["log_probs"].double() - ref["log_probs"]).abs().max() < 1e-4
    assert (on["entropy"].double() - ref["entropy"]).abs().max() < 1e-4
    assert torch.equal(on["old_log_probs"], on["log_probs"])
    scale = ref["grad"].abs().max()
    assert (on["grad"].double() - ref["grad"]).abs().max() <= scale * 2**-7
    # stock SkyRL over the same model: the model's cap on bf16 logits, bf16 grade
    stock_ref = _float64(stock, cap=CAP)
    assert 1e-3 < (stock["log_probs"].double() - stock_ref["log_probs"]).abs().max() < 0.5


def test_stock_is_bf16_grade(runs):
    """What the switch removes: stock's log-probs, from bf16 logits, miss float64's by far more."""
    stock = runs("stock")
    ref = _float64(stock)
    assert (stock["log_probs"].double() - ref["log_probs"]).abs().max() > 1e-3
