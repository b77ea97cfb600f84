"""Chunked log-probs on CUDA (skipped without a GPU): the tiles come from the out_dtype GEMM
(no fp32 weight copy), the Triton per-tile kernels give the torch steps' numbers, and the
backward is lm_head_gemm's in each mode on real tensor cores."""

from __future__ import annotations

import pytest
import torch

from bench import lm_head  # the benchmark's inputs
from fp32patch.runtime.kernels import fp32out, triton_tanh  # (triton_tanh: read by a test's kernel)
from fp32patch.runtime.kernels.chunked_logprobs import (
    STRIPS_ENV_VAR,
    RowStats,
    chunked_logprobs,
    fold_tile,
    grad_tile,
)
from fp32patch.runtime.kernels.fp32out import TRITON_ENV_VAR
from fp32patch.runtime.kernels.lm_head_gemm import lm_head_linear
from fp32patch.runtime.modes import MEGATRON_MODES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

T, H, V = 1000, 1024, 32768


def _problem(seed=0, t=T, h=H, v=V):
    """The benchmark's inputs (logits of real models' size), targets sampled from the model, and
    a per-token upstream gradient."""
    x, w = lm_head.inputs(t, h, v, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    log_p64 = torch.log_softmax(x.double() @ w.double().t(), -1)
    targets = torch.multinomial(log_p64.exp(), 1, generator=gen)[:, 0]
    return x, w, targets, torch.randn(t, device="cuda", generator=gen)


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _float64(x, w, targets, grad, temperature=1.0, softcap=None, entropy_weight=0.0):
    """Log-probs, entropy, and the input and weight gradients of ``sum(grad * (log p +
    entropy_weight * entropy))``, in float64; ``temperature`` a number or one per token."""
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    z = x64 @ w64.t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    t = temperature.double()[:, None] if torch.is_tensor(temperature) else temperature
    log_p = torch.log_softmax(z / t, -1)
    lp = log_p.gather(1, targets[:, None])[:, 0]
    ent = -(log_p.exp() * log_p).sum(-1)
    loss = (lp * grad.double()).sum()
    if entropy_weight:
        loss = loss + (ent * grad.double() * entropy_weight).sum()
    loss.backward()
    return lp.detach(), ent.detach(), x64.grad, w64.grad


def test_tiles_come_from_the_out_dtype_gemm_without_a_weight_copy():
    x, w, targets, _ = _problem()
    assert fp32out.out_dtype_supported(x.device, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp = chunked_logprobs(x, w, targets, chunk_rows=512, chunk_vocab=8192)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    tile = 512 * 8192 * 4
    assert extra < tile * 1.5  # one fp32 tile and [T] vectors: no [V, H] fp32, no [T, V]
    lp64, _, _, _ = _float64(x, w, targets, torch.zeros(T, device="cuda"))
    err = (lp.double() - lp64).abs()
    # bf16 logits would be off by ~2e-2 on average at this logit size
    assert err.mean() < 2e-5 and err.max() < 2e-4


@pytest.mark.parametrize(("temperature", "softcap"), [(1.0, None), (0.7, None), ("rows", None), ("rows", 10.0)])
@pytest.mark.parametrize("mode", ["fp32out", "fp32out-bf16grad", "fp32out-hilo"])
def test_triton_kernels_give_the_torch_steps_numbers(monkeypatch, mode, temperature, softcap):
    # the fp32out modes' fused path (16-bit copies written from the logits, products
    # accumulated in the GEMM) against the eager one (fp32 gradient tile, lm_head_gemm's GEMMs);
    # "rows": Prime-RL's per-sample temperatures, one per token; softcap: Gemma's, on logits
    # that reach past it
    x, w, targets, grad = _problem(1)
    if temperature == "rows":
        temperature = 0.5 + torch.rand(T, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    kw = dict(
        mode=mode, entropy=True, temperature=temperature, softcap=softcap, chunk_rows=300, chunk_vocab=5000,
        fuse_wgrad=True,
    )  # fmt: skip

    def run(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        xl = x.clone().requires_grad_()
        wl = torch.nn.Parameter(w.clone())
        wl.main_grad = torch.zeros(wl.shape, device="cuda")
        lp, ent = chunked_logprobs(xl, wl, targets, **kw)
        ((lp * grad).sum() + (ent * grad * 0.1).sum()).backward()
        return lp.detach(), ent.detach(), xl.grad, wl.main_grad

    default = run()
    triton = run(**{STRIPS_ENV_VAR: "0"})  # the Triton per-tile kernels in their two passes
    eager = run(**{TRITON_ENV_VAR: "0"})
    # the same formulas; only the exponentials' last bits differ (the GPU's exp2 against
    # torch's), which flips the 16-bit rounding of a few gradient entries
    assert (triton[0] - eager[0]).abs().max() < 1e-5
    assert (triton[1] - eager[1]).abs().max() < 5e-5  # log Z - E[z]: both ~20, the entropy ~2
    assert _rel(triton[2], eager[2]) < 1e-4 and (triton[2] == eager[2]).float().mean() > 0.95
    assert _rel(triton[3], eager[3]) < 5e-5
    # The default path: the strips for these recomputed 300-token tiles in fp32out. It computes
    # each tile again transposed (block @ x.T), a GEMM with its own fp32 summation order, so
    # its logits differ from the passes' in their last bits, which flips the 16-bit rounding of
    # a few percent of the copies (H100, 2026-12-06: input gradients 2.4-4.3e-4 apart, 90-99%
    # of entries equal; main_grad 9e-5 apart). Each is held to float64 instead: no further from
    # it than the eager path's own rounding puts that (there: the same to 0.1% and 0.5%).
    assert torch.equal(default[0], triton[0]) and torch.equal(default[1], triton[1])  # not the strips'
    if mode == "fp32out":
        _, _, dx64, dw64 = _float64(x, w, targets, grad, temperature, softcap, entropy_weight=0.1)
        assert _rel(default[2], dx64) < 1.02 * _rel(eager[2], dx64)
        assert _rel(default[3], dw64) < 1.02 * _rel(eager[3], dw64)
        assert _rel(default[2], triton[2]) < 1e-3 and _rel(default[3], triton[3]) < 3e-4
    else:  # the strips are fp32out's only: the default is the passes, held as they are
        assert _rel(default[2], eager[2]) < 1e-4 and _rel(default[3], eager[3]) < 5e-5
    if softcap is not None:  # and fp32 grade against float64 through the cap
        x64 = x.double()
        z = torch.tanh((x64 @ w.double().t()) / softcap) * softcap / temperature.double()[:, None]
        log_p = torch.log_softmax(z, -1)
        assert (z.abs().amax(1) > 0.5 * softcap / temperature.double()).any()  # the cap bites
        assert (triton[0].double() - log_p.gather(1, targets[:, None])[:, 0]).abs().max() < 2e-4


def test_bf16_tiles_fold_and_grad_as_on_the_cpu():
    # the per-tile steps on a 16-bit tile (the benchmark's TRL-shaped path uses them so)
    gen = torch.Generator(device="cuda").manual_seed(2)
    tile = (torch.randn(64, 3000, device="cuda", generator=gen) * 8).bfloat16()
    targets = torch.randint(-5, 3100, (64,), device="cuda", generator=gen)
    got, ref = RowStats(64, tile.device, True), RowStats(64, torch.device("cpu"), True)
    for c0, c1 in ((0, 1234), (1234, 3000)):
        fold_tile(tile[:, c0:c1].contiguous(), targets, c0, 0.8, got)
        fold_tile(tile[:, c0:c1].contiguous().cpu(), targets.cpu(), c0, 0.8, ref)
    for name in ("m", "s", "zs", "target"):
        assert torch.allclose(getattr(got, name).cpu(), getattr(ref, name), rtol=1e-5, atol=1e-6), name
    log_z = ref.m + ref.s.log()
    ent = log_z - ref.zs / ref.s
    g = torch.randn(64, generator=torch.Generator().manual_seed(3))
    a, b = tile.clone(), tile.cpu()
    grad_tile(a, targets, 0, 0.8, log_z.cuda(), ent.cuda(), g.cuda(), g.cuda() * 0.1)
    grad_tile(b, targets.cpu(), 0, 0.8, log_z, ent, g, g * 0.1)
    ulp = b.float().abs() * 2.0**-7 + 1e-30
    assert ((a.cpu().float() - b.float()).abs() <= ulp).all()


@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_backward_is_lm_head_gemms_in_each_mode(mode):
    x, w, targets, grad = _problem(4)
    _, _, dx64, dw64 = _float64(x, w, targets, grad, temperature=0.9)

    def grads(fn):
        xl = x.clone().requires_grad_()
        wl = torch.nn.Parameter(w.clone())
        wl.main_grad = torch.zeros(wl.shape, device="cuda")
        (fn(xl, wl) * grad).sum().backward()
        return xl.grad, wl.main_grad

    def unfused(xl, wl):
        logits = lm_head_linear(xl, wl, None, mode, fuse_wgrad=True).div_(0.9)
        return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]

    ref_dx, ref_dw = grads(unfused)
    dx, dw = grads(
        lambda xl, wl: chunked_logprobs(
            xl, wl, targets, mode=mode, temperature=0.9, fuse_wgrad=True, chunk_rows=384, chunk_vocab=10000
        )
    )
    mode_err = _rel(ref_dw, dw64)
    assert _rel(dw, dw64) <= mode_err * 1.05 + 1e-7
    assert _rel(dw, ref_dw) <= max(mode_err / 4, 2e-6)
    assert _rel(dx, dx64) <= _rel(ref_dx, dx64) * 1.05
    assert (dx == ref_dx).float().mean() > 0.9


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("mode", ["fp32out", "fp32out-bf16grad", "fp32"])
def test_kept_logits_on_cuda_give_what_recomputing_gives(mode, temperature):
    # the Triton grad kernel reads the kept logits through a strided view of [T, V]
    x, w, targets, grad = _problem(3)
    got = []
    for keep in (True, False):
        xl = x.clone().requires_grad_()
        wl = torch.nn.Parameter(w.clone())
        lp, ent = chunked_logprobs(
            xl, wl, targets, mode=mode, temperature=temperature, entropy=True, keep_logits=keep,
            chunk_rows=384, chunk_vocab=5000,
        )  # fmt: skip
        ((lp * grad).sum() + 0.1 * ent.sum()).backward()
        got.append((lp.detach(), ent.detach(), xl.grad, wl.grad))
    (lp1, ent1, dx1, dw1), (lp2, ent2, dx2, dw2) = got
    # the kept logits come from cuBLAS's fp32-output GEMM, the recomputing forward from the fused
    # Triton GEMM + logsumexp: two fp32 summation orders, a few 1e-5 apart at |log p| ~10 (bf16's: 1e-2)
    assert (lp1 - lp2).abs().max() < 1e-4 and (ent1 - ent2).abs().max() < 1e-4
    assert _rel(dw1, dw2) < 2e-3 and _rel(dx1, dx2) < 2e-3  # bf16 deliveries of equal fp32 sums
    lp64, ent64, _, _ = _float64(x, w, targets, grad, temperature)
    assert (lp1.double() - lp64).abs().max() < 2e-4


def test_kept_logits_hold_four_bytes_a_logit_until_the_backward():
    x, w, targets, grad = _problem(4)
    xl = x.clone().requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    lp = chunked_logprobs(xl, w, targets, keep_logits=True)
    held = torch.cuda.memory_allocated() - base
    assert T * V * 4 <= held < T * V * 4 * 1.05
    (lp * grad).sum().backward()
    del lp
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base < T * V * 0.5  # freed; x's gradient stays


def test_the_kernels_tanh_is_fp32_grade_on_the_gpu():
    # triton_tanh on the compiled path (the GPU's exp is not numpy's): the soft-cap's tanh
    import triton
    import triton.language as tl

    @triton.jit
    def apply(u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        tl.store(out_ptr + i, triton_tanh.tanh(tl.load(u_ptr + i, mask=ok, other=0.0)), mask=ok)

    u = torch.cat([torch.linspace(-20, 20, 400001), torch.logspace(-30, 0, 20001), torch.linspace(0.39, 0.41, 20001)])
    u = u.float().cuda()
    out = torch.empty_like(u)
    apply[(triton.cdiv(u.numel(), 1024),)](u, out, u.numel(), BLOCK=1024)
    ref = torch.tanh(u.double())
    ulp = (torch.nextafter(ref.float().abs(), torch.tensor(float("inf"), device="cuda")) - ref.float().abs()).double()
    err = ((out.double() - ref).abs() / ulp).max().item()
    assert err <= 8.0, f"{err:.1f} units in the last place off float64's tanh"


@pytest.mark.parametrize(
    ("rows", "layout"),
    [(700, "computed"), (6000, "computed"), (12000, "computed"), (12000, "light"), (700, "kept"), (6000, "kept")],
)  # computed: one block of tokens held (<= STRIP_ONE_BLOCK), or two reads of each strip (12,000
# tokens, both gradients); light: the log-prob's gradient alone, held up to STRIP_LIGHT_BLOCK
# with one temperature, read twice with one a row; kept: row-major
@pytest.mark.parametrize(("temperature", "softcap"), [(0.7, None), ("rows", 10.0)])
def test_the_strip_kernel_gives_the_two_passes_bits_compiled(rows, layout, temperature, softcap):
    # the strips (FP32PATCH_STRIPS=1) against the two passes, on the compiled kernels and a
    # bf16 plain copy: the same scales and copies, laid out as the tile the strips read
    from fp32patch.runtime.kernels import chunked_logprobs as cl

    gen = torch.Generator(device="cuda").manual_seed(21)
    cols, col0 = 5000, 300
    tile = torch.randn(rows, cols, device="cuda", generator=gen) * 6
    tile[:, :64] -= 14  # entries with gradients ~1e-6 of the others': their own scales
    targets = torch.randint(0, cols + 2 * col0, (rows,), device="cuda", generator=gen)
    if temperature == "rows":
        temperature = 0.5 + torch.rand(rows, device="cuda", generator=gen)
    z = tile.double() if softcap is None else torch.tanh(tile.double() / softcap) * softcap
    z = z / (temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else temperature)
    log_p = torch.log_softmax(z, -1)
    log_z = (z - log_p)[:, 0].float()
    ent = -(log_p.exp() * log_p).sum(-1).float()
    g_lp, g_ent = torch.randn(rows, device="cuda", generator=gen), torch.randn(rows, device="cuda", generator=gen)
    args = (targets, col0, temperature, log_z, ent, g_lp, g_ent * 0.1)
    if layout == "light":
        args = (targets, col0, temperature, log_z, None, g_lp, None)
    kernels = cl._TritonKernels.get()
    amax = torch.zeros(cols, device="cuda")
    kernels.grad(tile, *args, in_place=False, amax=amax, softcap=softcap)
    scale = fp32out.pow2_scales(amax)
    g16 = torch.empty(tile.shape, dtype=torch.float16, device="cuda")
    plain = torch.empty(tile.shape, dtype=torch.bfloat16, device="cuda")
    kernels.grad(tile, *args, in_place=False, scale=scale, out16=g16, plain=plain, softcap=softcap)
    if layout == "kept":
        tile_t = tile.t()
        g16_t = torch.empty((rows, cols), dtype=torch.float16, device="cuda").t()
        plain_t = torch.empty((rows, cols), dtype=torch.bfloat16, device="cuda").t()
    else:
        tile_t = tile.t().contiguous()
        g16_t = torch.empty((cols, rows), dtype=torch.float16, device="cuda")
        plain_t = torch.empty((cols, rows), dtype=torch.bfloat16, device="cuda")
        assert (kernels.strip_shape(rows)[1] >= rows) == (rows <= cl._TritonKernels.STRIP_ONE_BLOCK)
        assert (kernels.strip_shape(rows, light=True)[1] >= rows) == (rows <= cl._TritonKernels.STRIP_LIGHT_BLOCK)
    scale_t = torch.empty(cols, device="cuda")
    kernels.grad_strips(tile_t, *args, scale=scale_t, out16=g16_t, plain=plain_t, softcap=softcap)
    assert torch.equal(scale_t, scale)
    assert torch.equal(g16_t, g16.t())
    assert torch.equal(plain_t, plain.t())


@pytest.mark.parametrize("tiles", [(400, 6000), (4500, 6000), (4500, 6000, "blocks"), "kept"])
def test_a_call_through_the_strips_gives_the_two_passes_numbers(monkeypatch, tiles):
    from fp32patch.runtime.kernels import chunked_logprobs as cl

    if "blocks" in tiles:  # each strip read twice
        monkeypatch.setattr(cl._TritonKernels, "STRIP_ONE_BLOCK", 2048)

    x, w, targets, grad = _problem(5, t=5000, v=16384)
    kw = (
        dict(keep_logits=True)
        if tiles == "kept"
        else dict(keep_logits=False, chunk_rows=tiles[0], chunk_vocab=tiles[1])
    )
    got = []
    for strips in ("0", "1"):
        monkeypatch.setenv(cl.STRIPS_ENV_VAR, strips)
        xl = x.clone().requires_grad_()
        wl = torch.nn.Parameter(w.clone())
        wl.main_grad = torch.zeros(wl.shape, device="cuda")
        lp, ent = chunked_logprobs(xl, wl, targets, temperature=0.7, entropy=True, fuse_wgrad=True, **kw)
        ((lp * grad).sum() + 0.1 * ent.sum()).backward()
        got.append((lp.detach(), ent.detach(), xl.grad, wl.main_grad))
    (lp1, ent1, dx1, dw1), (lp2, ent2, dx2, dw2) = got
    assert torch.equal(lp1, lp2) and torch.equal(ent1, ent2)  # the forward is not the strips'
    # the same copies; the GEMMs take them transposed (their own summation orders, which may
    # flip the bf16 rounding of a few input-gradient entries; on an H100 the fp32 main_grad of
    # 4,500 tokens in two blocks of rows differed by 1.2e-6 of its largest)
    assert _rel(dw2, dw1) < 1e-5
    assert _rel(dx2, dx1) < 1e-3 and (dx1 == dx2).float().mean() > 0.95
