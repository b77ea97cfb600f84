"""OpenRLHF 0.11.2's own ``Actor`` under real DeepSpeed (0.19.6, CPU accelerator over gloo, two
ranks): a policy step with packed input and temperature 0.7 (``actor_run.py``), three ways:

- the environment's stock OpenRLHF (no patched root on the path);
- the patched root with ``--fp32_lm_head`` absent: stock, bit for bit (log-probs, entropy, loss,
  the head's gradient partition, the head's fp32 master and every parameter's master sum after the
  step), fp32patch never imported;
- the patched root with ``--fp32_lm_head fp32out``, wired as the patched ``PolicyModelActor``
  wires its actor: under ZeRO-3 and ZeRO-2 the log-probs and the entropy equal float64's of the
  very operands the head met (the final norm's bf16 hidden states and the gathered bf16 head)
  to 3e-5 (fp32's rounding of log-probs of ~-40), the update is finite and moves the head.

The stand-in for flash-attn (``stand_in/``) packs the batch as OpenRLHF's ``unpad_and_slice_tensor``
asks; that torch's SDPA keeps the packed sequences apart (transformers reads the packed position
ids) is checked against the second sequence run alone. What the stand-in leaves untested:
flash-attn's attention kernels, its Triton cross-entropy (``log_probs_from_logits`` takes its
chunked-logsumexp branch, stock and off), ring attention.

Not run here: the EMA actor (the same
``Actor`` class, wired by the same gate; one process without DeepSpeed, a LoRA policy and the
reference model run in test_lora.py), OpenRLHF's ``DeepspeedStrategy.setup_distributed`` and
``prepare`` (CUDA only; ``actor_run.py`` says what it takes from the strategy instead).
"""

from __future__ import annotations

import pytest
import torch

from tests.heavy.openrlhf import harness
from tests.heavy.openrlhf.actor_run import RESPONSE, TEMPERATURE
from tests.heavy.vllm_engine.harness import CAP

STAGES = {"stock": [3], "off": [3], "on": [3, 2], "on-capped": [3]}


@pytest.fixture(scope="session")  # one run per way, however xdist interleaves the modules
def actor_runs(tmp_path_factory, model_dir, capped_model_dir, patched_root):
    cache: dict[str, list[dict]] = {}

    def get(way: str) -> list[dict]:
        if way not in cache:
            model = capped_model_dir if way == "on-capped" else model_dir
            settings = {"model": str(model), "switch": "fp32out" if way.startswith("on") else None,
                        "stages": STAGES[way], "world": 2}  # fmt: skip
            out = tmp_path_factory.mktemp(f"actor-{way}")
            harness.run("tests.heavy.openrlhf.actor_run", settings, out, None if way == "stock" else patched_root)
            cache[way] = [torch.load(out / f"rank{rank}.pt") for rank in range(2)]
        return cache[way]

    return get


def _float64(
    rec: dict, temperature: float = TEMPERATURE, cap: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The action tokens' log-probs and entropies, in float64, from the hidden states and the head
    weight the forward met: each packed row's logits over the vocabulary (soft-capped at ``cap``),
    divided by the temperature."""
    seqs, mask = rec["sequences"], rec["attention_mask"]
    batch, seqlen = seqs.shape
    rows = torch.nonzero(mask.flatten()).flatten()  # the packed rows' places in [batch, seqlen]
    logits = rec["hidden"][0].double() @ rec["weight"].double().T
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    logits = logits / temperature
    logp = torch.log_softmax(logits, -1)
    full_lp = torch.zeros(batch * seqlen, dtype=torch.float64)
    full_ent = torch.zeros(batch * seqlen, dtype=torch.float64)
    targets = torch.roll(seqs, -1, dims=1).flatten()[rows]
    full_lp[rows] = logp.gather(-1, targets[:, None]).squeeze(-1)
    full_ent[rows] = -(logp.exp() * logp).sum(-1)
    window = slice(seqlen - 1 - RESPONSE, seqlen - 1)
    return full_lp.view(batch, seqlen)[:, window], full_ent.view(batch, seqlen)[:, window]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want).abs().max().item()


def test_switched_off_is_stock_bit_for_bit(actor_runs):
    stock, off = actor_runs("stock"), actor_runs("off")
    assert not any(r["fp32patch_imported"] for r in stock + off)
    assert "patched-roots" in off[0]["openrlhf_file"] and "patched-roots" not in stock[0]["openrlhf_file"]
    for s, o in zip(stock, off, strict=True):
        for key in ("log_probs", "old_log_probs", "entropy", "loss", "hidden", "grad", "master_after", "digest"):
            assert torch.equal(s["zero3"][key], o["zero3"][key]), key


def test_stock_log_probs_are_the_bf16_logits(actor_runs):
    """Stock OpenRLHF upcasts the HF model's bf16 logits: its log-probs carry bf16's rounding of
    them (logits of ~10 at this head), which the switch removes."""
    for rec in (r["zero3"] for r in actor_runs("stock")):
        want_lp, _ = _float64(rec)
        assert rec["log_probs_dtype"] == "torch.float32"
        assert 1e-3 < _error(rec["log_probs"], want_lp) < 0.5


@pytest.mark.parametrize("stage", [3, 2])
def test_switched_on_fp32_log_probs_entropy_and_a_finite_step(actor_runs, stage):
    ranks = actor_runs("on")
    assert all(r["fp32patch_imported"] for r in ranks)
    for rec in (r[f"zero{stage}"] for r in ranks):
        assert rec["weight_dtype"] == "torch.bfloat16" and rec["weight"].shape == (500, 128)
        want_lp, want_ent = _float64(rec)
        assert rec["log_probs"].dtype == torch.float32 and rec["entropy"].dtype == torch.float32
        assert _error(rec["log_probs"], want_lp) < 3e-5, _error(rec["log_probs"], want_lp)
        assert _error(rec["entropy"], want_ent) < 3e-5, _error(rec["entropy"], want_ent)
        assert rec["grad"] is not None and rec["grad"].dtype == torch.float32
        assert rec["grad"].isfinite().all() and rec["grad"].abs().max() > 0
        if stage == 3:  # this rank's partition of the flattened head
            assert rec["grad"].numel() == rec["partition"] < 500 * 128
        assert rec["master_after"].isfinite().all() and not torch.equal(rec["master_after"], rec["master_before"])
        assert rec["digest"].isfinite().all()


def test_a_soft_capped_model_under_zero3_gets_fp32_capped_log_probs_and_a_finite_step(actor_runs):
    """A tiny Gemma 2 (final_logit_softcapping 5.0): the chunked piece caps the fp32 logits, the
    model's own cap on the head's output is checked and set aside, and the backward reaches the
    head's partition through the tensor ZeRO-3's hooks made (its weight gathered again)."""
    for rec in (r["zero3"] for r in actor_runs("on-capped")):
        want_lp, want_ent = _float64(rec, cap=CAP)
        uncapped, _ = _float64(rec)
        assert _error(rec["log_probs"], uncapped) > 0.1  # the cap bites
        assert _error(rec["log_probs"], want_lp) < 3e-5, _error(rec["log_probs"], want_lp)
        assert _error(rec["entropy"], want_ent) < 3e-5, _error(rec["entropy"], want_ent)
        assert rec["grad"] is not None and rec["grad"].isfinite().all() and rec["grad"].abs().max() > 0
        assert rec["grad"].numel() == rec["partition"] < 500 * 128
        assert rec["master_after"].isfinite().all() and not torch.equal(rec["master_after"], rec["master_before"])


def test_switched_on_and_off_heads_get_the_same_gradient_up_to_bf16(actor_runs):
    """The head's gradient partition with the switch on is the stock one less bf16's rounding of
    the logits: close, not equal."""
    for on, off in zip(actor_runs("on"), actor_runs("off"), strict=True):
        a, b = on["zero3"]["grad"].double(), off["zero3"]["grad"].double()
        rel = ((a - b).abs().max() / b.abs().max()).item()
        assert 0 < rel < 0.1, rel


def test_packed_sequences_stay_apart(actor_runs, model_dir):
    """The packed batch (the stand-in's unpad, OpenRLHF's position ids, torch's SDPA): the second
    sequence's hidden states equal those of the same tokens run alone through the model."""
    from transformers import AutoModelForCausalLM

    rec = actor_runs("stock")[0]["zero3"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    seqs, mask = rec["sequences"], rec["attention_mask"]
    alone = seqs[1][mask[1].bool()][None]
    with torch.no_grad():
        hidden = model(alone, output_hidden_states=True).hidden_states[-1][0]
    packed = rec["hidden"][0][int(mask[0].sum()) :]
    assert packed.shape == hidden.shape
    assert (packed.float() - hidden.float()).abs().max() <= 0.02 * hidden.float().abs().max()
