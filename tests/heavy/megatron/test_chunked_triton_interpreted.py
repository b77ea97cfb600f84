"""chunked_logprobs' CUDA paths on the CPU, through Triton's interpreter: the per-tile kernels
(fold, gradient), the fused GEMM + logsumexp forward, and the whole call as CUDA runs it (kept
logits read in one tile, recomputed tiles, the 16-bit copies written straight from the logits,
products accumulated into Megatron's ``main_grad``), each against the torch steps that the CPU
runs, and the whole call against float64.

The compiled kernels' speed and their bits on tensor cores are tests/gpu's; what this file
checks is the logic of the CUDA-only branches (which copies are written, which accumulator
takes which product, what the kept logits look like after a backward), which no CPU test
reached before and which changed after the last GPU run. ``fp32out.TRITON_DEVICE_TYPES`` is
the one seam: with "cpu" in it, every choice between a Triton path and the eager one takes the
Triton path for CPU tensors.

The interpreter computes with numpy: bf16 loaded through a tensor descriptor reads as garbage
and a bf16 store truncates, so these tests take fp16 operands (every kernel here is generic
over the 16-bit dtype; tests/gpu checks bf16). Without TRITON_INTERPRET this file runs itself
in a child pytest that has it (tests/support/interpreter.py)."""

from __future__ import annotations

import pytest
import torch

from fp32patch.runtime.kernels import chunked_logprobs as cl
from fp32patch.runtime.kernels import fp32out, gemm_lse_triton, triton_tanh
from tests.support.interpreter import INTERPRETED, only_interpreted, run_under_interpreter

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu covers the compiled kernels")

T, H, V = 96, 64, 700  # V: neither the fold's block nor the gradient's and GEMM's column blocks divide it
RARE = 64


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_this_file_under_the_interpreter():
    run_under_interpreter(__file__)


@pytest.fixture
def calls(monkeypatch):
    """CPU tensors take the Triton paths; returns the count of each kernel's launches, so that a
    test knows the path it meant to check is the one that ran."""
    monkeypatch.setattr(fp32out, "TRITON_DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.delenv(fp32out.TRITON_ENV_VAR, raising=False)
    monkeypatch.delenv(cl.STRIPS_ENV_VAR, raising=False)
    kernels = cl._TritonKernels.get()
    assert kernels is not None
    counts = {"fold": 0, "grad": 0, "strips": 0, "gemm_lse": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(kernels, "fold", counted("fold", kernels.fold))
    monkeypatch.setattr(kernels, "grad", counted("grad", kernels.grad))
    monkeypatch.setattr(kernels, "grad_strips", counted("strips", kernels.grad_strips))
    monkeypatch.setattr(gemm_lse_triton, "block_stats", counted("gemm_lse", gemm_lse_triton.block_stats))
    return counts


def _eager(monkeypatch):
    """From here on the torch steps (the CPU's path), in the same test."""
    monkeypatch.setenv(fp32out.TRITON_ENV_VAR, "0")


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, what: str) -> None:
    scale = b.double().abs().max().clamp_min(1e-30)
    err = ((a.double() - b.double()).abs().max() / scale).item()
    assert err <= rtol, f"{what}: {err:.2e} of the largest entry, more than {rtol:.0e}"


def _problem(seed: int, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    w = torch.randn(V, H, generator=gen) * 0.3
    # rare tokens: one feature every token has pushes the first 64 entries' logits ~12 down, so
    # their probabilities and gradients are ~1e-5 of the others' (fp16 without its per-column
    # scale would keep few of their bits)
    x[:, 0], w[:RARE, 0] = 3.0, -4.0
    x, w = x.to(dtype), w.to(dtype)
    targets = torch.randint(0, V, (T,), generator=gen)
    grad = torch.randn(T, generator=gen)
    return x, w, targets, grad


def _temperature(kind, rows: int, gen):
    """A temperature argument: a number, or one per row (Prime-RL's per-sample temperatures)."""
    if kind == "rows":
        return 0.4 + torch.rand(rows, generator=gen)
    return kind


def _tanh_kernel():
    """A kernel applying triton_tanh.tanh elementwise (defined here: the interpreter reads a
    kernel's helpers from its module's globals)."""
    import triton
    import triton.language as tl

    @triton.jit
    def apply(u_ptr, out_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < n
        tl.store(out_ptr + i, triton_tanh.tanh(tl.load(u_ptr + i, mask=ok, other=0.0)), mask=ok)

    return apply


@only_interpreted
def test_the_kernels_tanh_is_fp32_grade_everywhere():
    # the soft-cap's tanh (triton_tanh): both of its branches, their seam, the tails, zeros,
    # infinities and NaN, within a few units in the last place of float64's
    import triton

    apply = _tanh_kernel()
    u = torch.cat([
        torch.linspace(-20, 20, 40001), torch.logspace(-30, 0, 2001), -torch.logspace(-30, 0, 2001),
        torch.linspace(0.39, 0.41, 2001), torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 88.0, 1e30]),
    ]).float()  # fmt: skip
    out = torch.empty_like(u)
    apply[(triton.cdiv(u.numel(), 1024),)](u, out, u.numel(), BLOCK=1024)
    ref = torch.tanh(u.double())
    ulp = (torch.nextafter(ref.float().abs(), torch.tensor(float("inf"))) - ref.float().abs()).double()
    err = ((out.double() - ref).abs() / ulp).max().item()
    assert err <= 4.0, f"{err:.1f} units in the last place off float64's tanh"
    assert torch.equal(out[-6:-2], torch.tensor([0.0, -0.0, 1.0, -1.0]))
    nan = torch.empty(1)
    apply[(1,)](torch.tensor([float("nan")]), nan, 1, BLOCK=16)
    assert nan.isnan().all()
    # the kernel's literals are triton_tanh.TAYLOR and SERIES_BELOW
    import inspect

    source = inspect.getsource(triton_tanh.tanh_fn)
    for c in (*triton_tanh.TAYLOR[1:], triton_tanh.SERIES_BELOW):
        assert repr(c) in source, c


@only_interpreted
@pytest.mark.parametrize("temperature", [1.0, 0.7, "rows"])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_fold_kernel_gives_the_torch_steps_statistics(calls, monkeypatch, temperature, softcap):
    gen = torch.Generator().manual_seed(1)
    tile = torch.randn(40, 2500, generator=gen) * 6  # two of the fold's 2048-column blocks
    targets = torch.randint(0, 2500, (40,), generator=gen)
    targets[:2] = torch.tensor([-1, 2507])  # outside the vocabulary: no logit taken
    temperature = _temperature(temperature, 40, gen)

    def fold():
        stats = cl.RowStats(40, tile.device, entropy=True)
        for c0, c1 in ((0, 900), (900, 2500)):  # two tiles into one row's statistics
            cl.fold_tile(tile[:, c0:c1].contiguous(), targets, c0, temperature, stats, softcap)
        return stats

    kernel = fold()
    assert calls["fold"] == 2
    _eager(monkeypatch)
    eager = fold()
    assert calls["fold"] == 2
    if softcap is None:  # the same divisions: the same bits
        assert torch.equal(kernel.m, eager.m)
        assert torch.equal(kernel.target, eager.target)
    else:  # the kernel's tanh against torch's: a few units in the last place
        _close(kernel.m, eager.m, 1e-6, "maximum")
        _close(kernel.target, eager.target, 1e-6, "target logit")
        assert eager.m.abs().max() <= softcap / 0.4  # the cap did cap
    assert (eager.target[:2] == 0).all()  # the targets outside the vocabulary kept their 0
    rtol = 1e-6 if softcap is None else 3e-6  # (capped: the tanh's last bits, through exp)
    _close(kernel.s, eager.s, rtol, "sum of exponentials")
    _close(kernel.zs, eager.zs, rtol, "exp-weighted sum of logits")


@only_interpreted
def test_grad_kernel_writes_each_copy_the_backward_asks_for(calls, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    tile = torch.randn(70, V, generator=gen) * 4
    targets = torch.randint(0, V, (70,), generator=gen)
    log_z = torch.logsumexp(tile / 0.8, dim=1)
    log_p = tile / 0.8 - log_z[:, None]
    ent = -(log_p.exp() * log_p).sum(1)
    g_lp, g_ent = torch.randn(70, generator=gen), torch.randn(70, generator=gen) * 0.1
    args = (targets, 0, 0.8, log_z, ent, g_lp, g_ent)

    in_place = tile.clone()
    cl.grad_tile(in_place, *args)
    assert calls["grad"] == 1  # the seam is on: that was the kernel
    monkeypatch.setenv(fp32out.TRITON_ENV_VAR, "0")
    eager = tile.clone()
    cl.grad_tile(eager, *args)
    monkeypatch.delenv(fp32out.TRITON_ENV_VAR)
    assert calls["grad"] == 1
    _close(in_place, eager, 1e-6, "gradient in place")
    z = tile / 0.8
    p = (z - log_z[:, None]).exp()
    hit = torch.zeros_like(z).scatter_(1, targets[:, None], 1.0)
    by_hand = (g_lp[:, None] * (hit - p) - g_ent[:, None] * p * (z - log_z[:, None] + ent[:, None])) / 0.8
    _close(in_place, by_hand, 1e-5, "gradient against its formula")

    kernels = cl._TritonKernels.get()
    amax = torch.zeros(V)
    kept = tile.clone()
    kernels.grad(kept, *args, in_place=False, amax=amax)
    assert torch.equal(kept, tile)  # not written: a kept tile stays the forward's logits
    assert torch.equal(amax, in_place.abs().amax(dim=0))

    scale = fp32out._pow2_scale(amax)
    g16, plain = torch.empty(tile.shape, dtype=torch.float16), torch.empty(tile.shape, dtype=torch.float16)
    kernels.grad(kept, *args, in_place=False, scale=scale, out16=g16, plain=plain)
    assert torch.equal(kept, tile)
    assert torch.equal(g16, (in_place * scale).half())
    assert torch.equal(plain, in_place.half())
    # every column's largest entry lands in [2**13, 2**14] (its fp16 rounding may reach 2**14):
    # fp16's 11 bits for rare tokens too
    top = g16.float().abs().amax(dim=0)
    assert (((top >= 2**13) & (top <= 2**14)) | (amax == 0)).all()


@only_interpreted
def test_grad_kernel_with_per_row_temperatures_and_a_cap(calls, monkeypatch):
    # Prime-RL's per-sample temperatures and Gemma's soft-cap in the kernel, against the torch
    # steps and against the formula: d/dz of the capped, per-row scaled log-probs and entropy
    gen = torch.Generator().manual_seed(6)
    cap = 20.0
    tile = torch.randn(70, V, generator=gen) * 12  # many logits past the cap's linear range
    targets = torch.randint(0, V, (70,), generator=gen)
    temps = 0.4 + torch.rand(70, generator=gen)
    capped = torch.tanh(tile.double() / cap)
    z = capped * cap / temps.double()[:, None]
    log_z = torch.logsumexp(z, dim=1)
    log_p = z - log_z[:, None]
    ent = -(log_p.exp() * log_p).sum(1)
    g_lp, g_ent = torch.randn(70, generator=gen), torch.randn(70, generator=gen) * 0.1
    args = (targets, 0, temps, log_z.float(), ent.float(), g_lp, g_ent)

    in_place = tile.clone()
    cl.grad_tile(in_place, *args, softcap=cap)
    assert calls["grad"] == 1
    _eager(monkeypatch)
    eager = tile.clone()
    cl.grad_tile(eager, *args, softcap=cap)
    assert calls["grad"] == 1
    _close(in_place, eager, 1e-6, "gradient in place")
    p = log_p.exp()
    hit = torch.zeros_like(z).scatter_(1, targets[:, None], 1.0)
    dz = g_lp.double()[:, None] * (hit - p) - g_ent.double()[:, None] * p * (log_p + ent[:, None])
    by_hand = dz / temps.double()[:, None] * (1 - capped * capped)
    _close(in_place, by_hand, 1e-5, "gradient against its formula")


@only_interpreted
@pytest.mark.parametrize("layout", ["one block", "blocks", "kept"])
@pytest.mark.parametrize(("temperature", "softcap"), [(0.8, None), ("rows", 20.0)])
@pytest.mark.parametrize(("grads", "plain"), [("both", True), ("logp", False), ("entropy", True)])
def test_strip_kernel_gives_the_two_passes_bits(calls, monkeypatch, layout, temperature, softcap, grads, plain):
    # the strips against the two passes over the tile: the same scales and the same 16-bit
    # copies, bit for bit. A tile computed transposed (contiguous strips) in one held block of
    # tokens, or in blocks of 32 tokens read twice (70 tokens: ragged); a kept row-major tile
    # read through its transposed view, its copies laid out as it is
    gen = torch.Generator().manual_seed(9)
    rows, col0 = 70, 100
    tile = torch.randn(rows, V, generator=gen) * 4
    tile[:, :RARE] -= 12  # entries whose gradients are ~1e-5 of the others': their own scales
    # targets in this block and past it, none among the rare entries (a target's gradient is not small)
    targets = torch.randint(col0 + RARE, V + 2 * col0, (rows,), generator=gen)
    temps = _temperature(temperature, rows, gen)
    z = tile.double()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z / (temps.double()[:, None] if isinstance(temps, torch.Tensor) else temps)
    log_z = torch.logsumexp(z, dim=1)
    log_p = z - log_z[:, None]
    ent = -(log_p.exp() * log_p).sum(1)
    g_lp = torch.randn(rows, generator=gen) if grads != "entropy" else None
    g_ent = torch.randn(rows, generator=gen) * 0.1 if grads != "logp" else None
    args = (targets, col0, temps, log_z.float(), ent.float() if g_ent is not None else None, g_lp, g_ent)

    kernels = cl._TritonKernels.get()
    amax = torch.zeros(V)
    kernels.grad(tile, *args, in_place=False, amax=amax, softcap=softcap)
    scale = fp32out._pow2_scale(amax)
    g16, pl = torch.empty(tile.shape, dtype=torch.float16), torch.empty(tile.shape, dtype=torch.float16)
    kernels.grad(tile, *args, in_place=False, scale=scale, out16=g16, plain=pl, softcap=softcap)
    assert calls["grad"] == 2

    if layout == "blocks":
        monkeypatch.setattr(cl._TritonKernels, "STRIP_ONE_BLOCK", 16)
        monkeypatch.setattr(cl._TritonKernels, "STRIP_BT", 32)
        monkeypatch.setattr(cl._TritonKernels, "STRIP_BV", 32)  # (fewer programs: the interpreter's time)
    monkeypatch.setattr(cl._TritonKernels, "STRIP_HELD", 32 * 128)
    monkeypatch.setattr(cl._TritonKernels, "STRIP_ROW_BT", 32)
    bv, bt, _ = kernels.strip_shape(rows, tokens_contiguous=layout != "kept")
    assert (bt >= rows) == (layout == "one block") and (bv, bt) == (32, 128 if layout == "one block" else 32)
    if layout == "kept":
        tile_t = tile.t()  # a view: entries contiguous
        g16_t = torch.empty((rows, V), dtype=torch.float16).t()
        pl_t = torch.empty((rows, V), dtype=torch.float16).t() if plain else None
    else:
        tile_t = tile.t().contiguous()
        g16_t = torch.empty((V, rows), dtype=torch.float16)
        pl_t = torch.empty((V, rows), dtype=torch.float16) if plain else None
    before = tile.clone()
    scale_t = torch.full((V,), float("nan"))
    kernels.grad_strips(tile_t, *args, scale=scale_t, out16=g16_t, plain=pl_t, softcap=softcap)
    assert calls["strips"] == 1
    assert torch.equal(tile_t, before.t())  # read, not written
    assert torch.equal(scale_t.view(torch.int32), scale.view(torch.int32))
    assert torch.equal(g16_t, g16.t())
    if plain:
        assert torch.equal(pl_t, pl.t())
    # the rare entries kept fp16's 11 bits: every entry's largest lands in [2**13, 2**14]
    top = g16_t.float().abs().amax(dim=1)
    assert (((top >= 2**13) & (top <= 2**14)) | (amax == 0)).all()
    assert amax[:RARE].median() < amax[RARE:].median() * 1e-2  # (so they do need their own)


@only_interpreted
@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize(("tiles", "temperature"), [("recomputed", 0.7), ("recomputed", "rows"), ("kept", 0.7)])
def test_whole_call_through_the_strips_gives_the_two_passes_numbers(calls, monkeypatch, main_grad, tiles, temperature):
    x, w, targets, grad = _problem(10)
    temps = _temperature(temperature, T, torch.Generator().manual_seed(11))
    kw = dict(mode="fp32out", temperature=temps)
    kw.update(keep_logits=True) if tiles == "kept" else kw.update(keep_logits=False, chunk_rows=40, chunk_vocab=256)
    n = 1 if tiles == "kept" else 9  # tiles a backward
    monkeypatch.setenv(cl.STRIPS_ENV_VAR, "0")
    passes = _step(x, w, targets, grad, main_grad=main_grad, **kw)
    steps = 2 if main_grad else 1
    assert (calls["grad"], calls["strips"]) == (steps * 2 * n, 0)
    monkeypatch.setenv(cl.STRIPS_ENV_VAR, "1")
    strip = _step(x, w, targets, grad, main_grad=main_grad, **kw)
    assert (calls["grad"], calls["strips"]) == (steps * 2 * n, steps * n)  # every tile, and nothing else
    names = ("log-probs", "entropy", "input gradient", "weight gradient")
    for name, a, b in zip(names, strip, passes, strict=True):
        if name in names[:2]:
            assert torch.equal(a, b), name  # the forward is not the strips'
        else:
            # the same copies; the GEMMs take them transposed, which may order their sums otherwise
            _close(a, b, 1e-6, name)
    if main_grad:  # row by row of the fp32 weight gradient (fp16's rounds the rare rows to 0)
        rows = (strip[3].double() - passes[3].double()).abs().amax(1) / passes[3].double().abs().amax(1)
        assert rows.max() <= 1e-5, f"a row of the weight gradient {rows.max().item():.2e} off, row by row"
    ref = _float64(x, w, targets, grad, temps)
    for name, a, r in zip(names, strip, ref, strict=True):
        _close(a, r, {"log-probs": 1e-6, "entropy": 3e-6}.get(name, 1e-3), f"{name} against float64")


@only_interpreted
@pytest.mark.parametrize(
    ("env", "tiles", "grads", "strips"),
    [
        (None, "40 rows", "logp", True),  # held: at most STRIP_ONE_BLOCK tokens
        (None, "48 rows", "logp", True),  # held: a light launch, at most STRIP_LIGHT_BLOCK
        (None, "48 rows", "both", False),  # not light: a strip would be read twice
        (None, "kept", "logp", False),  # a kept row-major tile: the passes
        ("1", "48 rows", "both", True),
        ("1", "kept", "logp", True),
        ("0", "40 rows", "logp", False),
    ],
)
def test_by_default_the_strips_take_the_recomputed_tiles_they_hold(calls, monkeypatch, env, tiles, grads, strips):
    x, w, targets, grad = _problem(13)
    monkeypatch.setattr(cl._TritonKernels, "STRIP_ONE_BLOCK", 40)
    monkeypatch.setattr(cl._TritonKernels, "STRIP_LIGHT_BLOCK", 48)
    if env is not None:
        monkeypatch.setenv(cl.STRIPS_ENV_VAR, env)
    kw = dict(mode="fp32out", temperature=0.7, entropy=grads == "both")
    if tiles == "kept":
        kw.update(keep_logits=True)
    else:
        kw.update(keep_logits=False, chunk_rows=int(tiles.split()[0]), chunk_vocab=256)
    xl = x.clone().requires_grad_()
    wl = torch.nn.Parameter(w.clone())
    out = cl.chunked_logprobs(xl, wl, targets, **kw)
    lp, ent = out if grads == "both" else (out, None)
    loss = (lp * grad).sum() + (0.0 if ent is None else 0.1 * ent.sum())
    loss.backward()
    assert (calls["strips"] > 0, calls["grad"] > 0) == (strips, not strips)


@only_interpreted
@pytest.mark.parametrize("tiles", ["bf16grad", "no weight gradient"])
def test_the_strips_take_only_fp32out_tiles_with_a_weight_gradient(calls, monkeypatch, tiles):
    # (fp32out-bf16grad's one pass has no maxima to take; without a weight gradient no scales)
    x, w, targets, grad = _problem(12)
    monkeypatch.setenv(cl.STRIPS_ENV_VAR, "1")
    kw = dict(mode="fp32out-bf16grad" if tiles == "bf16grad" else "fp32out", temperature=0.7)
    kw.update(keep_logits=False, chunk_rows=40, chunk_vocab=256)
    xl = x.clone().requires_grad_()
    wl = torch.nn.Parameter(w.clone(), requires_grad=tiles != "no weight gradient")
    cl.chunked_logprobs(xl, wl, targets, **kw).mul(grad).sum().backward()
    assert calls["strips"] == 0 and calls["grad"] > 0


@only_interpreted
@pytest.mark.parametrize("entropy", [False, True])
@pytest.mark.parametrize(("temperature", "softcap"), [(0.7, None), ("rows", None), ("rows", 3.0)])
def test_fused_gemm_logsumexp_forward_gives_the_folded_statistics(calls, monkeypatch, entropy, temperature, softcap):
    gen = torch.Generator().manual_seed(3)
    rows, hdim, cols = 200, 72, 700  # ragged against its 128 x 256 blocks and its 64-wide K steps
    x = torch.randn(rows, hdim, generator=gen).half()
    w = (torch.randn(cols, hdim, generator=gen) * 0.3).half()
    targets = torch.randint(-2, cols + 2, (rows,), generator=gen)
    temperature = _temperature(temperature, rows, gen)
    assert gemm_lse_triton.usable(x, w)
    m, s, zs, tz = gemm_lse_triton.block_stats(x, w, targets, temperature, entropy, softcap=softcap)
    assert calls["gemm_lse"] == 1
    _eager(monkeypatch)
    assert not gemm_lse_triton.usable(x, w)
    stats = cl.RowStats(rows, x.device, entropy)
    cl.fold_tile(fp32out.mm(x, w.t()), targets, 0, temperature, stats, softcap)
    # the same exact products summed in another order: fp32 rounding apart
    _close(m, stats.m, 1e-6, "maximum")
    _close(tz, stats.target, 1e-6, "target logit")
    _close(s, stats.s, 1e-5, "sum of exponentials")
    assert (zs is None) == (not entropy)
    if entropy:
        _close(zs, stats.zs, 1e-5, "exp-weighted sum")


def _float64(x, w, targets, grad, temperature, softcap=None):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    z = x64 @ w64.t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    if isinstance(temperature, torch.Tensor):
        temperature = temperature.double()[:, None]
    log_p = torch.log_softmax(z / temperature, -1)
    lp = log_p.gather(1, targets[:, None])[:, 0]
    ent = -(log_p.exp() * log_p).sum(-1)
    (lp * grad.double() + ent * grad.double() * 0.1).sum().backward()
    return lp.detach(), ent.detach(), x64.grad, w64.grad


def _step(x, w, targets, grad, *, main_grad: bool, **kw):
    """A forward and backward of the log-probs and entropy; the weight's gradient from
    ``main_grad`` (Megatron's accumulation fusion; a second step then adds as much into it) or
    ``.grad``."""
    xl = x.clone().requires_grad_()
    wl = torch.nn.Parameter(w.clone())
    if main_grad:
        wl.main_grad = torch.zeros(wl.shape)

    def once():
        lp, ent = cl.chunked_logprobs(xl, wl, targets, entropy=True, fuse_wgrad=main_grad, **kw)
        (lp * grad + ent * grad * 0.1).sum().backward()
        return lp.detach(), ent.detach()

    lp, ent = once()
    if not main_grad:
        return lp, ent, xl.grad, wl.grad
    first = wl.main_grad.clone()
    once()
    assert wl.grad is None
    _close(wl.main_grad, first * 2, 1e-6, "main_grad after two steps")  # added into, not written over
    return lp, ent, xl.grad / 2, first


@only_interpreted
@pytest.mark.parametrize("mode", ["fp32out", "fp32out-bf16grad"])
@pytest.mark.parametrize("tiles", ["kept", "recomputed"])
@pytest.mark.parametrize("main_grad", [False, True])
def test_whole_call_on_the_cuda_path_gives_the_cpu_paths_numbers(calls, monkeypatch, mode, tiles, main_grad):
    x, w, targets, grad = _problem(4)
    kw = dict(mode=mode, temperature=0.7)
    if tiles == "kept":
        kw["keep_logits"] = True  # the default tile then: one tile, the whole vocabulary
    else:
        kw.update(keep_logits=False, chunk_rows=40, chunk_vocab=256)  # 3 x 3 tiles, ragged
    cuda_path = _step(x, w, targets, grad, main_grad=main_grad, **kw)
    recompute_fwd = tiles == "recomputed"  # both modes' forward is fp32out's GEMM: the fused kernel's
    steps = 2 if main_grad else 1
    assert calls["gemm_lse"] == steps * (3 if recompute_fwd else 0)  # one launch per block of rows
    assert calls["fold"] == steps * (0 if recompute_fwd else 1)  # kept: one whole-vocabulary tile
    # fp32out: a recomputed tile through the strip kernel (one launch: it holds these tiles), a
    # kept one through the two passes (the column maxima, then the copies)
    strip = mode == "fp32out" and recompute_fwd
    passes = 0 if strip else 2 if mode == "fp32out" else 1
    assert calls["grad"] == steps * passes * (1 if tiles == "kept" else 9)
    assert calls["strips"] == steps * (9 if strip else 0)
    _eager(monkeypatch)
    cpu_path = _step(x, w, targets, grad, main_grad=main_grad, **kw)
    lp64, ent64, dx64, dw64 = _float64(x, w, targets, grad, 0.7)
    names = ("log-probs", "entropy", "input gradient", "weight gradient")
    for name, a, b in zip(names, cuda_path, cpu_path, strict=True):
        # the same formulas and roundings; the exponentials' last bits differ (numpy's
        # against torch's), which may flip the 16-bit rounding of a few gradient entries
        _close(a, b, 2e-6 if name in names[:2] else 1e-4, name)
    if main_grad and mode == "fp32out":
        # and row by row of the fp32 weight gradient: the rare tokens' rows (down to ~1e-11 of
        # the largest) keep fp16's 11 bits through the per-column scales, as on the CPU path
        # (fp32out-bf16grad's unscaled copies are bf16 on real weights, fp16 here: they underflow)
        row_top = cpu_path[3].double().abs().amax(1)
        assert (row_top / row_top.max()).min() < 1e-8 and row_top.min() > 0
        rows = (cuda_path[3].double() - cpu_path[3].double()).abs().amax(1) / row_top
        assert rows.max() <= 1e-3, f"a row of the weight gradient {rows.max().item():.2e} off, row by row"
    for name, a, ref in zip(names, cuda_path, (lp64, ent64, dx64, dw64), strict=True):
        # fp32 grade against float64 (the gradients: through 16-bit copies of the logits' gradient)
        _close(a, ref, {"log-probs": 1e-6, "entropy": 3e-6}.get(name, 1e-3), f"{name} against float64")


@only_interpreted
@pytest.mark.parametrize("tiles", ["kept", "recomputed"])
def test_whole_call_with_per_token_temperatures_and_a_cap_stays_on_the_kernels(calls, monkeypatch, tiles):
    # Prime-RL's per-sample temperatures and Gemma's soft-cap: every step on the Triton path
    # (the fused forward included), the CPU path's numbers, fp32 grade against float64
    x, w, targets, grad = _problem(7)
    temps = 0.4 + torch.rand(T, generator=torch.Generator().manual_seed(8))
    kw = dict(mode="fp32out", temperature=temps, softcap=5.0)
    if tiles == "kept":
        kw["keep_logits"] = True
    else:
        kw.update(keep_logits=False, chunk_rows=40, chunk_vocab=256)
    cuda_path = _step(x, w, targets, grad, main_grad=False, **kw)
    assert calls["gemm_lse"] == (3 if tiles == "recomputed" else 0)
    assert calls["fold"] == (0 if tiles == "recomputed" else 1)
    # (recomputed: the strip kernel holds these tiles, cap and all)
    assert (calls["grad"], calls["strips"]) == ((0, 9) if tiles == "recomputed" else (2, 0))
    _eager(monkeypatch)
    cpu_path = _step(x, w, targets, grad, main_grad=False, **kw)
    ref = _float64(x, w, targets, grad, temps, softcap=5.0)
    names = ("log-probs", "entropy", "input gradient", "weight gradient")
    for name, a, b, r in zip(names, cuda_path, cpu_path, ref, strict=True):
        # the tanh's last bits differ too (the kernel's against torch's): a few more of the
        # gradients' 16-bit roundings flip than without a cap
        _close(a, b, 2e-6 if name in names[:2] else 3e-4, name)
        _close(a, r, {"log-probs": 1e-6, "entropy": 3e-6}.get(name, 1e-3), f"{name} against float64")


@only_interpreted
def test_kept_logits_are_read_not_written_by_the_backward(calls):
    # a graph kept for a second backward reads the same logits again: the same gradients
    x, w, targets, grad = _problem(5)
    xl = x.clone().requires_grad_()
    wl = torch.nn.Parameter(w.clone())
    lp, ent = cl.chunked_logprobs(xl, wl, targets, temperature=0.7, entropy=True, keep_logits=True)
    loss = (lp * grad + ent * grad * 0.1).sum()
    loss.backward(retain_graph=True)
    first = (xl.grad.clone(), wl.grad.clone())
    xl.grad, wl.grad = None, None
    loss.backward()
    assert calls["grad"] == 4  # two passes per backward, on the kept tile
    assert torch.equal(xl.grad, first[0]) and torch.equal(wl.grad, first[1])


@only_interpreted
def test_the_scales_kernel_gives_the_torch_formulas_bits(monkeypatch):
    # the backward takes a tile's scales from its column maxima in one launch (pow2_scales):
    # every binade, the clamps at both ends, subnormals, and 0, inf, NaN (which get 1)
    from fp32patch.runtime.kernels import fp16_scale_triton

    monkeypatch.setattr(fp32out, "TRITON_DEVICE_TYPES", {"cuda", "cpu"})
    monkeypatch.delenv(fp32out.TRITON_ENV_VAR, raising=False)
    assert fp16_scale_triton.load()
    powers = torch.tensor([2.0**e for e in range(-149, 128)])
    amax = torch.cat(
        [powers, powers * 1.7, powers * 0.75, torch.tensor([0.0, float("inf"), float("nan"), 65504.0, 3.4e38])]
    ).float()
    seen = []
    real = fp16_scale_triton.scales
    monkeypatch.setattr(fp16_scale_triton, "scales", lambda a: seen.append(1) or real(a))
    got = fp32out.pow2_scales(amax)
    assert seen == [1]  # the kernel ran, not the torch formula
    assert torch.equal(got.view(torch.int32), fp32out._pow2_scale(amax).view(torch.int32))


@only_interpreted
def test_the_strips_benchmark_runs_and_checks_its_copies(calls):
    # bench/strips.py's CPU smoke run: a tiny tile each way, the strips' copies checked bit for
    # bit against the passes' inside it (a difference ends it with SystemExit)
    from bench import strips

    results = strips.main(["--smoke"])
    (shape,) = results["shapes"]
    assert shape["shape"] == [40, 32, 300]
    computed, kept = shape["computed"], shape["kept"]
    table = {"passes", "bf16grad", "strips (shape table)", "default"}
    assert set(computed["tile"]) == table | {"strips 8,64,4", "strips 16,16,4"}
    assert set(kept["tile"]) == table | {"strips 64,16,4"}
    # the runtime's own choice: the strips for a computed tile they hold, the passes for a kept one
    assert computed["tile"]["default"]["strips"] and not kept["tile"]["default"]["strips"]
    assert computed["convert"]["strips 8,64,4"]["one_block"] and not computed["convert"]["strips 16,16,4"]["one_block"]
    assert all(r["ms"] > 0 for part in (computed, kept) for r in part["tile"].values())
    assert calls["strips"] >= 6 and calls["grad"] >= 8
