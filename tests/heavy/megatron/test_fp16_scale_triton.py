"""fp32out's Triton kernels through Triton's interpreter, on the CPU: each kernel against
the eager arithmetic it replaces, bit for bit, and the whole backward through them against
the eager backward. It lives in this suite because this environment carries Triton, as a
Megatron training stack does; tests/gpu checks the compiled kernels on a GPU.

Triton reads TRITON_INTERPRET once, when it is first imported, and megatron-core imports it
before these tests run; so without the variable this file runs itself in a child pytest
that has it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fp32patch.runtime import fp16_scale_triton, fp32out
from fp32patch.runtime.lm_head_gemm import lm_head_linear

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu covers the compiled kernels")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
only_interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the child pytest")


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_this_file_under_the_interpreter():
    child = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", __file__],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and " failed" not in child.stdout


@pytest.fixture
def kernels():
    assert fp16_scale_triton.load()
    return fp16_scale_triton


def _wide(m: int, n: int, seed: int) -> torch.Tensor:
    """Rows ~2**50 apart in size, an all-zero row and column."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, n, generator=gen) * torch.exp2(torch.randint(-40, 10, (m, 1), generator=gen).float())
    a[1:2] = 0
    a[:, 2:3] = 0
    return a


def _eager_scales(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(
        fp32out._pow2_scale(torch.linalg.vector_norm(a, float("inf"), dim=dim, keepdim=True).float()) for dim in (1, 0)
    )


@only_interpreted
@pytest.mark.parametrize("shape", [(70, 300), (33, 517), (1100, 5), (1, 1)])
def test_scales_and_conversion_match_eager(kernels, shape):
    a = _wide(*shape, seed=shape[0])
    rs, cs = kernels.row_col_scales(a, rows=True, cols=True)
    eager_rs, eager_cs = _eager_scales(a)
    assert torch.equal(rs, eager_rs) and torch.equal(cs, eager_cs)
    by_row, by_col = kernels.scale_to_fp16(a, rs, cs)
    assert torch.equal(by_row, torch.mul(a, rs).half())
    assert torch.equal(by_col, torch.mul(a, cs).half())
    # a transposed view: rows and columns trade places
    t_rs, t_cs = kernels.row_col_scales(a.t(), rows=True, cols=True)
    assert torch.equal(t_rs, cs.t()) and torch.equal(t_cs, rs.t())


@only_interpreted
def test_scale_formula_at_the_edges_of_fp32(kernels):
    # one row per maximum: 0, subnormals, the normal range's ends, inf and NaN
    tiny = torch.finfo(torch.float32).tiny
    maxima = [0.0, 1e-45, tiny / 2, tiny * (1 - 2**-23), tiny, 2.0**-114, 2.0**-113.5, 1.0, 0.75]
    maxima += [2.0**13, 2.0**14, 2.0**114, 2.0**115, 3e38, float("inf"), float("nan")]
    a = torch.tensor(maxima)[:, None] * torch.tensor([[1.0, -0.5, 0.25]])
    a[:, 1] = -a[:, 0]  # the maximum of |a| may come from a negative entry
    a[0] = 0
    rs, _ = kernels.row_col_scales(a, rows=True, cols=False)
    eager_rs, _ = _eager_scales(a)
    assert torch.equal(rs, eager_rs), torch.stack([torch.tensor(maxima), rs[:, 0], eager_rs[:, 0]], 1)


@only_interpreted
def test_maxima_keep_nan_above_inf_as_eager_does(kernels):
    a = torch.randn(4, 8)
    a[1, 2] = float("nan")
    a[2, 3] = float("-inf")
    a[1, 3] = float("inf")
    rs, cs = kernels.row_col_scales(a, rows=True, cols=True)
    eager_rs, eager_cs = _eager_scales(a)
    assert torch.equal(rs, eager_rs) and torch.equal(cs, eager_cs)
    assert rs[1].item() == rs[2].item() == 1.0


@only_interpreted
def test_bf16_column_scales(kernels):
    w = torch.randn(1100, 40).bfloat16()  # several programs down the rows
    w[:, 3] *= 2.0**-60
    _, cs = kernels.row_col_scales(w, rows=False, cols=True)
    assert torch.equal(cs, _eager_scales(w)[1])
    (_, by_col) = kernels.scale_to_fp16(w, None, cs)
    assert torch.equal(by_col, torch.mul(w, cs).half())
    assert torch.equal(by_col.float() / cs, w.float())  # exact: bf16 fits fp16 after scaling


@only_interpreted
def test_unscale_in_place_and_into_an_accumulator(kernels):
    gen = torch.Generator().manual_seed(5)
    p = torch.randn(70, 300, generator=gen)
    rs = torch.exp2(torch.randint(-60, 60, (70, 1), generator=gen).float())
    cs = torch.exp2(torch.randint(-60, 60, (1, 300), generator=gen).float())
    expect = p.clone().div_(rs).div_(cs)
    assert torch.equal(kernels.unscale(p.clone(), rs, cs, torch.float32, None), expect)
    acc = torch.randn(70, 300, generator=gen)
    got = kernels.unscale(p, rs, cs, torch.float32, acc.clone())
    assert torch.equal(got, acc + expect)
    # (the interpreter truncates fp32 -> bf16; the rounding cast is checked on the GPU)


@only_interpreted
def test_whole_backward_through_the_kernels_matches_eager(kernels, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(96, 64, generator=gen).bfloat16()
    w = (torch.randn(300, 64, generator=gen) * 0.05).bfloat16()
    g = _wide(96, 300, seed=7)

    def backward():
        # fp32 outputs: the interpreter's truncating bf16 cast would differ from eager's
        into = torch.ones(w.shape)
        dx, dw_into = fp32out.fp16_scaled_grads(g, w, x, torch.float32, torch.float32, into)
        _, dw = fp32out.fp16_scaled_grads(g, None, x, torch.float32, torch.float32)
        return dx, dw_into, dw

    eager = backward()
    # the CPU's tensors through the kernels, as CUDA tensors would go
    monkeypatch.setattr(fp32out, "_triton_kernels", lambda a: kernels)
    fused = backward()
    for got, expect in zip(fused, eager, strict=True):
        assert torch.equal(got, expect)
    ref = g.double().t() @ x.double()
    assert ((fused[2].double() - ref).norm() / ref.norm()).item() < 2.0**-11


@only_interpreted
def test_lm_head_backward_through_the_kernels_accumulates_main_grad(kernels, monkeypatch):
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(96, 64, generator=gen).bfloat16()
    w = (torch.randn(300, 64, generator=gen) * 0.05).bfloat16()
    g = _wide(96, 300, seed=9)
    monkeypatch.setattr(fp32out, "_triton_kernels", lambda a: kernels)
    weight = torch.nn.Parameter(w.clone())
    weight.main_grad = torch.zeros(w.shape)
    ref = torch.zeros(w.shape, dtype=torch.float64)
    for scale in (1.0, 2.0**-30):
        lm_head_linear(x, weight, None, "fp32out", fuse_wgrad=True).backward(g * scale)
        ref += (g * scale).double().t() @ x.double()
    assert weight.grad is None
    assert ((weight.main_grad.double() - ref).norm() / ref.norm()).item() < 2.0**-11
