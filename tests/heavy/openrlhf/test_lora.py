"""OpenRLHF 0.11.2's own ``Actor`` in one process without DeepSpeed: a LoRA policy whose head is
not adapted (PEFT's adapter on q_proj and v_proj), a plain reference model and an EMA model, wired
by the patched files' gate (``lora_run.py``): with ``--fp32_lm_head fp32out`` the three models'
log-probs and entropy equal float64's of the operands the head met (the EMA model's at its own
temperature, 1.0), the EMA model's parameters pair with stock's one for one, the adapter's matrices
get finite gradients through fp32patch's chunked log-probs, the frozen head gets none; off, stock
bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.heavy.openrlhf import harness
from tests.heavy.openrlhf.actor_run import TEMPERATURE
from tests.heavy.openrlhf.test_actor import _error, _float64


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, model_dir, patched_root) -> dict:
    runs = {}
    for way, root, switch in (("stock", None, None), ("off", patched_root, None), ("on", patched_root, "fp32out")):
        out = tmp_path_factory.mktemp(f"lora-{way}")
        harness.run("tests.heavy.openrlhf.lora_run", {"model": str(model_dir), "switch": switch}, out, root)
        runs[way] = torch.load(out / "run.pt")
    return runs


def _with(model: dict, run: dict) -> dict:
    return {**model, "sequences": run["sequences"], "attention_mask": run["attention_mask"]}


def test_on_both_models_fp32_and_the_adapter_trains(lora_runs):
    on = lora_runs["on"]
    assert on["fp32patch_imported"]
    for name, temperature in (("policy", TEMPERATURE), ("reference", TEMPERATURE), ("ema", 1.0)):
        rec = _with(on[name], on)
        want_lp, want_ent = _float64(rec, temperature)
        assert rec["dtype"] == "torch.float32" and rec["weight"].dtype == torch.bfloat16
        assert _error(rec["log_probs"], want_lp) < 3e-5, (name, _error(rec["log_probs"], want_lp))
        assert _error(rec["entropy"], want_ent) < 3e-5, (name, _error(rec["entropy"], want_ent))
    grads = on["lora_grads"]
    assert len(grads) == on["lora_params"] > 0  # every adapter matrix got a gradient
    assert all(g.isfinite().all() for g in grads.values())
    # B starts at zero (so A's gradient is zero at the first step): B's is what the log-probs reach
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    assert on["head_requires_grad"] is False and on["head_grad"] is None  # PEFT froze the head; it stays so
    assert torch.isfinite(on["loss"])


def test_the_wired_ema_model_pairs_with_stock(lora_runs):
    """``moving_average`` zips the policy's and the EMA model's ``parameters()``: the wiring adds,
    drops and reorders none (names and shapes as stock's EMA model has them)."""
    assert lora_runs["on"]["ema_params"] == lora_runs["stock"]["ema_params"]
    assert any(n.endswith("lm_head.weight") for n, _ in lora_runs["on"]["ema_params"])


def test_stock_carries_bf16_rounding(lora_runs):
    stock = lora_runs["stock"]
    want_lp, _ = _float64(_with(stock["policy"], stock))
    assert 1e-3 < _error(stock["policy"]["log_probs"], want_lp) < 0.5


def test_off_is_stock_bit_for_bit(lora_runs):
    stock, off = lora_runs["stock"], lora_runs["off"]
    assert not stock["fp32patch_imported"] and not off["fp32patch_imported"]
    for name in ("policy", "reference", "ema"):
        for key in ("log_probs", "entropy", "hidden"):
            assert torch.equal(stock[name][key], off[name][key]), (name, key)
    assert torch.equal(stock["loss"], off["loss"])
    assert stock["lora_grads"].keys() == off["lora_grads"].keys()
    assert all(torch.equal(stock["lora_grads"][n], off["lora_grads"][n]) for n in stock["lora_grads"])
