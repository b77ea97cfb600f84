"""fp32out's fused Triton backward on a CUDA GPU (skipped without one, or without Triton):
the same bits as the eager path, the same bits run after run, and the same bits replayed
from a CUDA graph, with main_grad accumulation."""

from __future__ import annotations

import pytest
import torch

from fp32patch.runtime import fp16_scale_triton, fp32out
from fp32patch.runtime.lm_head_gemm import lm_head_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
triton = pytest.importorskip("triton")

# Sizes off every tile boundary, so masked edges are exercised.
T, H, V = 1000, 520, 8200


def _problem(seed: int, kind: str, t: int = T, h: int = H, v: int = V):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(v, h, device="cuda", generator=gen) * (6.0 / h**0.5)).bfloat16()
    if kind == "cross-entropy":
        g = torch.softmax(torch.randn(t, v, device="cuda", generator=gen) * 4, dim=-1)
        g[torch.arange(t, device="cuda"), torch.randint(0, v, (t,), device="cuda", generator=gen)] -= 1
        g /= t
    else:  # rows and columns over ~2**90 of dynamic range, one row and one column all zero
        g = torch.randn(t, v, device="cuda", generator=gen)
        g *= torch.exp2(torch.randint(-60, 30, (t, 1), device="cuda", generator=gen).float())
        g *= torch.exp2(torch.randint(-30, 0, (1, v), device="cuda", generator=gen).float())
        g[7] = 0
        g[:, 11] = 0
    return x, w, g


def _backward(x, w, g, fuse: bool):
    """One forward + backward of the head in fp32out: (dx, weight gradient)."""
    xr = x.clone().requires_grad_(True)
    wr = torch.nn.Parameter(w.clone())
    if fuse:  # main_grad already holds an earlier micro-batch's gradient
        wr.main_grad = torch.full(w.shape, 0.25, dtype=torch.float32, device="cuda")
    lm_head_linear(xr, wr, None, "fp32out", fuse_wgrad=fuse).backward(g)
    return xr.grad, (wr.main_grad if fuse else wr.grad)


@pytest.mark.parametrize("fuse", [True, False], ids=["main_grad", "weight.grad"])
@pytest.mark.parametrize("kind", ["cross-entropy", "wide-range"])
def test_triton_backward_gives_the_eager_bits(kind, fuse, monkeypatch):
    x, w, g = _problem(0, kind)
    dx, dw = _backward(x, w, g, fuse)
    monkeypatch.setenv(fp32out.TRITON_ENV_VAR, "0")
    eager_dx, eager_dw = _backward(x, w, g, fuse)
    assert dx.dtype == torch.bfloat16 and dw.dtype == (torch.float32 if fuse else torch.bfloat16)
    assert torch.equal(dx, eager_dx)
    assert torch.equal(dw, eager_dw)
    # (the precision against TF32 tensor cores: test_cuda_runtime.py)


def test_kernels_match_eager_piece_by_piece():
    x, w, g = _problem(1, "wide-range")
    assert fp32out._triton_kernels(g) is fp16_scale_triton
    cs = fp16_scale_triton.column_scales(g)
    rs = fp16_scale_triton.column_scales(g.t()).t()  # a transposed (non-contiguous) operand
    eager = [torch.linalg.vector_norm(g, float("inf"), dim=d, keepdim=True) for d in (1, 0)]
    assert torch.equal(rs, fp32out._pow2_scale(eager[0])) and torch.equal(cs, fp32out._pow2_scale(eager[1]))
    scaled, plain = fp16_scale_triton.convert(g, cs, torch.bfloat16)
    assert torch.equal(scaled, torch.mul(g, cs).half()) and torch.equal(plain, g.bfloat16())
    # a bf16 operand
    wcol = fp16_scale_triton.column_scales(w)
    assert torch.equal(wcol, fp32out._pow2_scale(w.float().abs().amax(dim=0)[None, :]))
    p = torch.randn(T, V, device="cuda")
    expect = p.clone().div_(rs).div_(cs)
    assert torch.equal(fp16_scale_triton.unscale(p.clone(), rs, cs, torch.float32, None), expect)
    assert torch.equal(fp16_scale_triton.unscale(p.clone(), rs, cs, torch.bfloat16, None), expect.bfloat16())
    acc = torch.randn(T, V, device="cuda")
    assert torch.equal(fp16_scale_triton.unscale(p, rs, cs, torch.float32, acc.clone()), acc + expect)


def test_scales_from_maxima_give_the_eager_bits():
    # chunked_logprobs' backward turns a tile's column maxima into scales in one launch
    powers = torch.tensor([2.0**e for e in range(-149, 128)], device="cuda")
    amax = torch.cat(
        [powers, powers * 1.7, powers * 0.75, torch.tensor([0.0, float("inf"), float("nan"), 3.4e38], device="cuda")]
    ).float()
    got = fp32out.pow2_scales(amax)
    assert torch.equal(got.view(torch.int32), fp32out._pow2_scale(amax).view(torch.int32))


def test_nan_and_inf_pass_through_as_eagerly(monkeypatch):
    x, w, g = _problem(2, "cross-entropy")
    g[3, 5] = float("nan")
    g[9, 4] = float("inf")
    dx, dw = _backward(x, w, g, fuse=True)
    monkeypatch.setenv(fp32out.TRITON_ENV_VAR, "0")
    eager_dx, eager_dw = _backward(x, w, g, fuse=True)
    assert torch.equal(dx.isnan(), eager_dx.isnan()) and torch.equal(dw.isnan(), eager_dw.isnan())
    finite = dw.isfinite() & eager_dw.isfinite()
    assert torch.equal(dw[finite], eager_dw[finite])


def test_runs_repeat_bit_for_bit():
    x, w, g = _problem(3, "cross-entropy", t=2048, h=1024, v=32768)
    first = _backward(x, w, g, fuse=True)
    for _ in range(3):
        again = _backward(x, w, g, fuse=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_cuda_graph_replays_the_backward_with_main_grad_accumulation():
    x, w, g = _problem(4, "cross-entropy", t=1024, h=768, v=16384)
    xs = x.clone().requires_grad_(True)
    ws = torch.nn.Parameter(w.clone())
    ws.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
    gs = g.clone()

    def step():
        lm_head_linear(xs, ws, None, "fp32out", fuse_wgrad=True).backward(gs)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compiles the kernels and probes the GEMM
        step()
    torch.cuda.current_stream().wait_stream(stream)
    once = ws.main_grad.clone()
    dx_once = xs.grad.clone()
    ws.main_grad.zero_()
    xs.grad = None

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()
    ws.main_grad.zero_()  # capture does not run the work; start the count from zero
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ws.main_grad, once)
    assert torch.equal(xs.grad, dx_once)
    graph.replay()  # a second micro-batch accumulates
    torch.cuda.synchronize()
    assert torch.equal(ws.main_grad, once + once)
    # new data in the captured input, same graph
    gs.copy_(_problem(5, "cross-entropy", t=1024, h=768, v=16384)[2])
    ws.main_grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    ref = gs.double().t() @ x.double()
    assert ((ws.main_grad.double() - ref).norm() / ref.norm()).item() < 2.0**-11
