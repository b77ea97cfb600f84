"""fp32out's Triton kernels through Triton's interpreter, on the CPU: each kernel against
the eager arithmetic it replaces, bit for bit, and the whole backward through them against
the eager backward. It lives in this suite because this environment carries Triton, as a
Megatron training stack does; tests/gpu checks the compiled kernels on a GPU.

Without TRITON_INTERPRET this file runs itself in a child pytest that has it
(tests/support/interpreter.py)."""

from __future__ import annotations

import pytest
import torch

from fp32patch.runtime import fp16_scale_triton, fp32out
from fp32patch.runtime.lm_head_gemm import lm_head_linear
from tests.support.interpreter import INTERPRETED, only_interpreted, run_under_interpreter

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/gpu covers the compiled kernels")


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_this_file_under_the_interpreter():
    run_under_interpreter(__file__)


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


def _eager_column_scales(a: torch.Tensor) -> torch.Tensor:
    return fp32out._pow2_scale(torch.linalg.vector_norm(a, float("inf"), dim=0, keepdim=True).float())


@only_interpreted
@pytest.mark.parametrize("shape", [(70, 300), (33, 517), (1100, 5), (1, 1)])
def test_scales_and_conversions_match_eager(kernels, shape):
    a = _wide(*shape, seed=shape[0])
    for operand in (a, a.t()):  # and a transposed view: rows and columns trade places
        cs = kernels.column_scales(operand)
        assert torch.equal(cs, _eager_column_scales(operand))
        scaled, plain = kernels.convert(operand, cs)
        assert plain is None and torch.equal(scaled, torch.mul(operand, cs).half())
        assert scaled.stride() == torch.empty_like(operand).stride()
        # the plain copy from the same pass (fp16 here: the interpreter truncates to bf16,
        # tests/gpu checks bf16's rounding)
        scaled, plain = kernels.convert(operand, cs, torch.float16)
        assert torch.equal(scaled, torch.mul(operand, cs).half()) and torch.equal(plain, operand.half())


@only_interpreted
def test_scale_formula_at_the_edges_of_fp32(kernels):
    # one column per maximum: 0, subnormals, the normal range's ends, inf and NaN
    tiny = torch.finfo(torch.float32).tiny
    maxima = [0.0, 1e-45, tiny / 2, tiny * (1 - 2**-23), tiny, 2.0**-114, 2.0**-113.5, 1.0, 0.75]
    maxima += [2.0**13, 2.0**14, 2.0**114, 2.0**115, 3e38, float("inf"), float("nan")]
    a = torch.tensor([[1.0], [-0.5], [0.25]]) * torch.tensor(maxima)[None, :]
    a[1] = -a[0]  # the maximum of |a| may come from a negative entry
    a[:, 0] = 0
    cs = kernels.column_scales(a)
    assert torch.equal(cs, _eager_column_scales(a)), torch.stack([torch.tensor(maxima), cs[0]], 1)


@only_interpreted
def test_maxima_keep_nan_above_inf_as_eager_does(kernels):
    a = torch.randn(8, 4)
    a[2, 1] = float("nan")
    a[3, 2] = float("-inf")
    a[3, 1] = float("inf")
    cs = kernels.column_scales(a)
    assert torch.equal(cs, _eager_column_scales(a))
    assert cs[0, 1].item() == cs[0, 2].item() == 1.0


@only_interpreted
def test_bf16_column_scales(kernels):
    w = torch.randn(1100, 40).bfloat16()  # several programs down the rows
    w[:, 3] *= 2.0**-60
    cs = kernels.column_scales(w)
    assert torch.equal(cs, _eager_column_scales(w))
    scaled, _ = kernels.convert(w, cs)
    assert torch.equal(scaled, torch.mul(w, cs).half())
    assert torch.equal(scaled.float() / cs, w.float())  # exact: bf16 fits fp16 after scaling


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
    # fp16 weights, so that the plain copy of grad is fp16: the interpreter's truncating
    # bf16 cast would differ from eager's rounding one (tests/gpu checks bf16)
    w = (torch.randn(300, 64, generator=gen) * 0.05).half()
    g_wide = _wide(96, 300, seed=7)
    g = torch.softmax(torch.randn(96, 300, generator=gen) * 4, dim=-1) / 96

    def backward():
        # fp32 outputs: the interpreter's truncating bf16 cast would differ from eager's
        into = torch.ones(w.shape)
        dx, dw_into = fp32out.fp16_scaled_grads(g, w, x, torch.float32, torch.float32, into)
        _, dw = fp32out.fp16_scaled_grads(g_wide, None, x, torch.float32, torch.float32)
        return dx, dw_into, dw

    eager = backward()
    # the CPU's tensors through the kernels, as CUDA tensors would go
    monkeypatch.setattr(fp32out, "_triton_kernels", lambda a: kernels)
    fused = backward()
    for got, expect in zip(fused, eager, strict=True):
        assert torch.equal(got, expect)
    ref = g_wide.double().t() @ x.double()
    assert ((fused[2].double() - ref).norm() / ref.norm()).item() < 2.0**-11
    # a frozen weight (no weight gradient): the stock head's input gradient
    dx_only, dw_none = fp32out.fp16_scaled_grads(g, w, None, torch.float16, torch.float32)
    assert dw_none is None and torch.equal(dx_only, torch.mm(g.half(), w))


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


@only_interpreted
def test_logits_divided_in_place_backward_through_the_kernels(kernels, monkeypatch):
    # a trainer's temperature scaling on [b=1, s, v] logits; the kernels see the same gradient
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(24, 1, 64, generator=gen).bfloat16()
    w = (torch.randn(300, 64, generator=gen) * 0.05).half()
    g = _wide(24, 300, seed=11).reshape(1, 24, 300)
    monkeypatch.setattr(fp32out, "_triton_kernels", lambda a: kernels)

    def step(in_place: bool):
        xin, weight = x.clone().requires_grad_(), torch.nn.Parameter(w.clone())
        weight.main_grad = torch.zeros(w.shape)
        logits = lm_head_linear(xin, weight, None, "fp32out", fuse_wgrad=True).transpose(0, 1).contiguous()
        (logits.div_(0.7) if in_place else logits / 0.7).backward(g)
        return xin.grad, weight.main_grad

    for got, expect in zip(step(True), step(False), strict=True):
        assert torch.equal(got, expect)
