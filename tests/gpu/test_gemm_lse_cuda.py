"""The fused GEMM + logsumexp forward of chunked_logprobs on CUDA (skipped without a GPU, and
without sm_90 for the kernel's own tests): no tile is written, the statistics are fp32-grade
against float64 on ragged shapes, at T != 1, with the entropy, on a vocabulary shard, and
operands the kernel cannot take keep the tiles."""

from __future__ import annotations

import pytest
import torch

from bench import lm_head  # the benchmark's inputs
from fp32patch.runtime.kernels import chunked_logprobs as cl
from fp32patch.runtime.kernels import gemm_lse_triton

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0), reason="needs sm_90 (TMA)"
)


def _problem(t, h, v, seed=0):
    x, w = lm_head.inputs(t, h, v, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    targets = torch.randint(0, v, (t,), device="cuda", generator=gen)
    return x, w, targets


def _float64(x, w, targets, temperature=1.0):
    z = (x.double() @ w.double().t()) / temperature
    log_p = torch.log_softmax(z, -1)
    inside = (targets >= 0) & (targets < w.shape[0])
    picked = z.gather(1, targets.clamp(0, w.shape[0] - 1)[:, None])[:, 0]
    lp = torch.where(inside, picked, torch.zeros_like(picked)) - torch.logsumexp(z, -1)
    return lp, -(log_p.exp() * log_p).sum(-1)


def _no_tiles(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the forward wrote a logits tile")

    monkeypatch.setattr(cl, "_fwd_mm", refuse)


@hopper
@pytest.mark.parametrize(
    ("t", "h", "v"),
    [(1000, 1024, 32768), (777, 1000, 5003), (300, 4096, 151936), (129, 64, 257)],
    ids=["even", "ragged", "qwen-vocab", "tiny"],
)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_forward_writes_no_tile_and_is_fp32_grade(monkeypatch, t, h, v, temperature):
    x, w, targets = _problem(t, h, v)
    assert gemm_lse_triton.usable(x, w)
    lp64, ent64 = _float64(x, w, targets, temperature)
    with torch.no_grad():
        monkeypatch.setenv(cl.GEMM_LSE_ENV_VAR, "0")
        tiles, tiles_ent = cl.chunked_logprobs(x, w, targets, temperature=temperature, entropy=True, chunk_rows=512)
        monkeypatch.delenv(cl.GEMM_LSE_ENV_VAR)
        _no_tiles(monkeypatch)
        lp, ent = cl.chunked_logprobs(x, w, targets, temperature=temperature, entropy=True, chunk_rows=512)
    z16 = (x @ w.t()).float() / temperature
    bf16 = z16.gather(1, targets[:, None])[:, 0] - torch.logsumexp(z16, -1)
    err, tiles_err = (lp.double() - lp64).abs(), (tiles.double() - lp64).abs()
    bf16_err = (bf16.double() - lp64).abs()
    ent_err, tiles_ent_err = (ent.double() - ent64).abs(), (tiles_ent.double() - ent64).abs()
    numbers = (
        f"T={t} H={h} V={v}: fused {err.mean():.2e}/{err.max():.2e}, tiles {tiles_err.mean():.2e}/"
        f"{tiles_err.max():.2e}, bf16 {bf16_err.mean():.2e}; entropy {ent_err.max():.2e}/{tiles_ent_err.max():.2e}"
    )
    print(numbers)
    # fp32 grade (issue 32's goal: at most 1/100 of bf16's error; targets drawn uniformly, as
    # here, are far in the tail, where both fp32 paths' error grows alike)
    assert err.mean() < bf16_err.mean() / 100, numbers
    # one fp32 summation of the exact products over H, where cuBLAS may split the sum at a
    # few rows (halving its rounding); at the benchmark's shape both errors are equal
    assert err.mean() < 3 * tiles_err.mean() + 1e-7 and err.max() < 3 * tiles_err.max() + 1e-6, numbers
    assert ent_err.max() < 3 * tiles_ent_err.max() + 1e-6, numbers


@hopper
def test_it_agrees_with_the_tiles_it_replaces(monkeypatch):
    x, w, targets = _problem(1000, 1024, 32768)
    with torch.no_grad():
        # keep_logits=False: the recomputing path, whose forward this kernel is (a short call would keep its logits)
        fused, fused_ent = cl.chunked_logprobs(x, w, targets, entropy=True, temperature=0.7, keep_logits=False)
        monkeypatch.setenv(cl.GEMM_LSE_ENV_VAR, "0")
        tiles, tiles_ent = cl.chunked_logprobs(x, w, targets, entropy=True, temperature=0.7, keep_logits=False)
    # two fp32 summations of the same exact products: they differ in the order only
    assert (fused - tiles).abs().max() < 5e-5
    assert (fused_ent - tiles_ent).abs().max() < 5e-5


@hopper
def test_it_holds_no_tile_and_no_weight_copy():
    x, w, targets = _problem(4096, 1024, 32768)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        cl.chunked_logprobs(x, w, targets, chunk_rows=4096)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    blocks = 32768 // gemm_lse_triton.CONFIG["BN"]
    # [T] vectors and the blocks' statistics (max, sum, their rescale) only
    assert extra <= 4 * blocks * 4096 * 4 + 16 * 4096 * 4
    assert extra < 4096 * 32768 * 2 / 8  # an eighth of a bf16 tile


@hopper
def test_a_shard_takes_only_the_targets_it_holds(monkeypatch):
    x, w, targets = _problem(700, 512, 10000)
    shard, start = w[4000:7000], 4000
    _no_tiles(monkeypatch)
    with torch.no_grad():
        lp = cl.chunked_logprobs(x, shard, targets, vocab_start=start, keep_logits=False)
    lp64, _ = _float64(x, shard, targets - start)
    assert (lp.double() - lp64).abs().max() < 2e-4
    held = (targets >= start) & (targets < start + 3000)
    assert held.any() and (~held).any()


@hopper
def test_the_training_forward_uses_it_and_the_gradient_is_right(monkeypatch):
    x, w, targets = _problem(600, 1024, 8192)
    calls = []
    real = gemm_lse_triton.block_stats
    monkeypatch.setattr(gemm_lse_triton, "block_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    lp = cl.chunked_logprobs(xg, wg, targets, temperature=0.7, keep_logits=False)
    grad = torch.randn(600, device="cuda")
    (lp * grad).sum().backward()
    assert calls
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    lp64 = torch.log_softmax((x64 @ w64.t()) / 0.7, -1).gather(1, targets[:, None])[:, 0]
    (lp64 * grad.double()).sum().backward()
    rel = ((wg.grad.double() - w64.grad).norm() / w64.grad.norm()).item()
    assert rel < 1e-2  # weight.grad is delivered in bf16: its rounding, ~2e-3
    assert (lp.double() - lp64.detach()).abs().max() < 2e-4


def test_operands_it_cannot_take_keep_the_tiles():
    x, w, targets = _problem(300, 250, 5003)  # rows of 500 bytes: TMA needs 16-byte multiples
    assert not gemm_lse_triton.usable(x, w)
    assert not gemm_lse_triton.usable(x.float(), w.float())
    with torch.no_grad():
        lp = cl.chunked_logprobs(x, w, targets, keep_logits=False)
    lp64, _ = _float64(x, w, targets)
    assert (lp.double() - lp64).abs().max() < 2e-4
