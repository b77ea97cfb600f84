"""The LM-head GEMM in each mode: fp32 logits, gradient precision against float64, and
Megatron's main_grad protocol, on plain torch (no Megatron needed)."""

from __future__ import annotations

import pytest
import torch

from fp32patch.runtime.fp32out import split, sum_mm
from fp32patch.runtime.lm_head_gemm import lm_head_linear
from fp32patch.runtime.modes import MEGATRON_MODES
from tests.support.in_place import CHANGES, assert_same_bits, change

# The modes whose backward must be at least as precise as TF32.
PRECISE_MODES = ("fp32", "tf32", "fp32out", "fp32out-hilo")
# What each mode's weight gradient adds to fp32 accumulation, relative to sum |a*b|: half an
# ulp of the precision grad_output is carried in (11 bits for fp32out, as TF32; ~16 bits
# for the hi/lo split; nothing for fp32 and for tf32, which does not exist on the CPU).
GRAD_ROUNDING = {"fp32": 0.0, "tf32": 0.0, "fp32out": 2.0**-11, "fp32out-hilo": 2.0**-16}
# The same for the input gradient, which fp32out computes as the stock head does: from
# grad_output rounded to bf16 (half an ulp: 2**-8 relative).
DX_GRAD_ROUNDING = {**GRAD_ROUNDING, "fp32out": 2.0**-8}
N, H, V = 96, 64, 512  # tokens, hidden, vocabulary


def tf32_round(t: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to TF32 (10 explicit mantissa bits), to nearest even, as a GPU
    tensor core's operand would be. Nearest rounding is the kinder choice for TF32."""
    bits = t.float().contiguous().view(torch.int32)
    keep_even = (bits >> 13) & 1
    return ((bits + 0x0FFF + keep_even) & ~0x1FFF).view(torch.float32)


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, H, generator=gen).bfloat16()
    w = (torch.randn(V, H, generator=gen) * 0.05).bfloat16()
    return x, w


def grad_output(kind: str, x: torch.Tensor, w: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """fp32 dLoss/dlogits: a cross-entropy gradient (what training sends) or plain noise."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(N, V, generator=gen)
    probs = torch.softmax(x.double() @ w.double().t(), dim=-1)
    probs[torch.arange(N), torch.randint(0, V, (N,), generator=gen)] -= 1
    return (probs / N).float()


def run(mode: str, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor, fuse: bool):
    """One forward and backward of the head; returns logits, x.grad and the weight grad."""
    x = x.clone().requires_grad_()
    weight = torch.nn.Parameter(w.clone())
    if fuse:
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    out = lm_head_linear(x, weight, None, mode, fuse_wgrad=fuse)
    out.backward(g)
    return out, x.grad, (weight.main_grad if fuse else weight.grad)


@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_logits_are_fp32_and_exact_to_fp32_accumulation(mode: str):
    x, w = operands()
    out = lm_head_linear(x, w, None, mode)
    ref = x.double() @ w.double().t()
    # Operands from bf16 are exact in fp32 and TF32: the only error is fp32 accumulation.
    bound = H * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    assert out.dtype == torch.float32
    assert ((out.double() - ref).abs() <= bound).all()
    # bf16 logits, what the stock head returns, are far outside that bound.
    assert not ((ref.bfloat16().double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("kind", ["cross-entropy", "normal"])
def test_fp32out_weight_gradient_is_as_precise_as_tf32(kind: str):
    x, w = operands()
    g = grad_output(kind, x, w)
    ref_dw = g.double().t() @ x.double()
    # What the tf32 mode computes on a GPU: grad_output rounded to TF32 (the bf16
    # operands are exact in TF32), fp32 accumulation.
    tf32_dw = tf32_round(g).t() @ x.float()

    _, _, main_grad = run("fp32out", x, w, g, fuse=True)
    _, _, weight_grad = run("fp32out", x, w, g, fuse=False)

    assert main_grad.dtype == torch.float32 and weight_grad.dtype == torch.bfloat16
    # fp32out rounds grad_output exactly as TF32 does (11 bits, to nearest) and keeps the
    # bf16 operands exact: the same error, up to the order of fp32 accumulation
    slack = 1 + 2.0**-10
    assert relative_error(main_grad, ref_dw) <= relative_error(tf32_dw, ref_dw) * slack
    assert relative_error(weight_grad, ref_dw) <= relative_error(tf32_dw.bfloat16(), ref_dw) * slack
    # and not by luck: a plain bf16 rounding of grad_output is several times worse
    bf16_dw = g.bfloat16().float().t() @ x.float()
    assert relative_error(main_grad, ref_dw) * 4 < relative_error(bf16_dw, ref_dw)


@pytest.mark.parametrize("kind", ["cross-entropy", "normal"])
def test_fp32out_input_gradient_is_the_stock_heads(kind: str):
    x, w = operands()
    g = grad_output(kind, x, w)
    ref_dx = g.double() @ w.double()
    _, dx, _ = run("fp32out", x, w, g, fuse=True)
    # the stock bf16 head: bf16 grad_output, one bf16 GEMM
    stock = torch.mm(g.bfloat16(), w)
    assert dx.dtype == torch.bfloat16 and torch.equal(dx, stock)
    # the price: grad_output at TF32's 11 bits would give a bf16 dx up to ~1.6x closer here
    # (on the benchmark's sharper gradients, 1.04x: bench/RESULTS.md)
    tf32_dx = (tf32_round(g) @ w.float()).bfloat16()
    assert relative_error(tf32_dx, ref_dx) < relative_error(dx, ref_dx) < relative_error(tf32_dx, ref_dx) * 2


@pytest.mark.parametrize("kind", ["cross-entropy", "normal"])
def test_fp32out_hilo_backward_is_far_more_precise_than_tf32(kind: str):
    x, w = operands()
    g = grad_output(kind, x, w)
    ref_dw = g.double().t() @ x.double()
    tf32_dw = tf32_round(g).t() @ x.float()
    _, _, main_grad = run("fp32out-hilo", x, w, g, fuse=True)
    # the hi/lo split keeps ~16 bits of grad_output, TF32 11
    assert relative_error(main_grad, ref_dw) * 8 < relative_error(tf32_dw, ref_dw)


@pytest.mark.parametrize("kind", ["cross-entropy", "normal"])
def test_fp32out_bf16grad_trades_backward_precision_below_tf32(kind: str):
    # Why it is opt-in: one bf16 rounding of grad_output loses to TF32's rounding.
    x, w = operands()
    g = grad_output(kind, x, w)
    ref_dw = g.double().t() @ x.double()
    tf32_dw = tf32_round(g).t() @ x.float()
    _, _, main_grad = run("fp32out-bf16grad", x, w, g, fuse=True)
    assert relative_error(main_grad, ref_dw) > relative_error(tf32_dw, ref_dw)


@pytest.mark.parametrize("mode", PRECISE_MODES)
def test_gradients_match_float64_to_rounding(mode: str):
    x, w = operands()
    g = grad_output("cross-entropy", x, w)
    ref_dw = g.double().t() @ x.double()
    ref_dx = g.double() @ w.double()
    _, dx, main_grad = run(mode, x, w, g, fuse=True)
    _, _, weight_grad = run(mode, x, w, g, fuse=False)
    # fp32 accumulation over N (resp. V) products, plus the rounding of grad_output.
    dw_bound = (N * 2.0**-24 + GRAD_ROUNDING[mode]) * (g.double().abs().t() @ x.double().abs())
    dx_bound = (V * 2.0**-24 + DX_GRAD_ROUNDING[mode]) * (g.double().abs() @ w.double().abs())
    assert ((main_grad.double() - ref_dw).abs() <= dw_bound).all()
    # Rounded once to bf16 (half an ulp, 2**-9 relative) on top of that.
    assert ((weight_grad.double() - ref_dw).abs() <= dw_bound + ref_dw.abs() * 2.0**-8).all()
    assert ((dx.double() - ref_dx).abs() <= dx_bound + ref_dx.abs() * 2.0**-8).all()


def test_main_grad_accumulates_across_micro_batches_in_fp32():
    x, w = operands()
    weight = torch.nn.Parameter(w.clone())
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    ref = torch.zeros(weight.shape, dtype=torch.float64)
    for seed in (1, 2):
        g = grad_output("normal", x, w, seed=seed)
        lm_head_linear(x, weight, None, "fp32out", fuse_wgrad=True).backward(g)
        ref += g.double().t() @ x.double()
    assert weight.grad is None  # Megatron's fused path: the gradient lives in main_grad
    # Both micro-batches are in (one overwritten would be off by ~70%), with fp32
    # accumulation of 11-bit products: below what one bf16 rounding on the way would cost.
    assert relative_error(weight.main_grad, ref) < 2.0**-11
    rounded = weight.main_grad.bfloat16().double()
    assert relative_error(rounded, ref) > 2.0**-11


@pytest.mark.parametrize("zero_out", [False, True])
def test_ddp_flag_is_set_and_a_placeholder_grad_returned(zero_out: bool):
    # Megatron's DDP marks its parameters with grad_added_to_main_grad and skips adding
    # .grad into main_grad when the layer set the flag.
    x, w = operands()
    weight = torch.nn.Parameter(w.clone())
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    weight.grad_added_to_main_grad = False
    if zero_out:
        weight.zero_out_wgrad = True
    lm_head_linear(x, weight, None, "tf32", fuse_wgrad=True).sum().backward()
    assert weight.grad_added_to_main_grad is True
    assert weight.grad is not None and weight.grad.shape == weight.shape
    if zero_out:
        assert not weight.grad.any()
    ref = torch.ones(V, N, dtype=torch.float64) @ x.double()
    assert relative_error(weight.main_grad, ref) < 1e-6


def test_without_fusion_main_grad_is_left_to_ddp():
    x, w = operands()
    weight = torch.nn.Parameter(w.clone())
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    lm_head_linear(x, weight, None, "fp32out", fuse_wgrad=False).sum().backward()
    assert not weight.main_grad.any()
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16


def test_fusion_without_a_main_grad_falls_back_to_weight_grad():
    x, w = operands()
    weight = torch.nn.Parameter(w.clone())
    lm_head_linear(x, weight, None, "fp32out", fuse_wgrad=True).sum().backward()
    assert weight.grad is not None and weight.grad.dtype == torch.bfloat16


def test_megatron_fsdp_weights_are_refused():
    x, w = operands()
    weight = torch.nn.Parameter(w.clone())
    weight.main_grad = torch.zeros(weight.shape)
    weight.__fsdp_param__ = True
    with pytest.raises(NotImplementedError, match="Megatron-FSDP"):
        lm_head_linear(x, weight, None, "fp32out", fuse_wgrad=True)


def test_frozen_weight_still_passes_the_input_gradient():
    x, w = operands()
    x = x.clone().requires_grad_()
    lm_head_linear(x, w, None, "fp32out").sum().backward()  # w does not require grad
    ref = torch.ones(N, V, dtype=torch.float64) @ w.double()
    assert relative_error(x.grad, ref) < 2.0**-8


@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_bias_is_added_in_fp32_and_gets_its_gradient(mode: str):
    x, w = operands()
    bias = torch.nn.Parameter(torch.randn(V).bfloat16())
    out = lm_head_linear(x.reshape(8, 12, H), w, bias, mode)
    assert out.shape == (8, 12, V)
    ref = x.double() @ w.double().t() + bias.double()
    assert relative_error(out.reshape(N, V), ref) < 1e-6
    out.sum().backward()
    assert torch.equal(bias.grad, torch.full((V,), float(N), dtype=torch.bfloat16))


@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_a_surrounding_autocast_does_not_turn_the_head_back_to_bf16(mode: str):
    x, w = operands()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = lm_head_linear(x, w, None, mode)
    assert out.dtype == torch.float32
    assert relative_error(out, x.double() @ w.double().t()) < 1e-6


# ---- the logits changed in place under autograd (a trainer's temperature scaling) ----------

# How the logits leave the head: 2-D, or Megatron's [s, b, h] turned to [b, s, v] by
# GPTModel's transpose(0, 1).contiguous(), which returns the transposed view itself for b = 1
LAYOUTS = {"2-D": None, "[s, 1, h]": 1, "[s, 2, h]": 2}


def in_place_step(mode: str, layout: str, name: str, in_place: bool, fuse: bool = False, bias: bool = False):
    x, w = operands()
    g = grad_output("cross-entropy", x, w)
    batch = LAYOUTS[layout]
    if batch is not None:
        x, g = x.reshape(-1, batch, H), g.reshape(-1, batch, V).transpose(0, 1)
    x = x.clone().requires_grad_()
    weight = torch.nn.Parameter(w.clone())
    if fuse:
        weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    b = torch.nn.Parameter(torch.randn(V, generator=torch.Generator().manual_seed(4)).bfloat16()) if bias else None
    logits = lm_head_linear(x, weight, b, mode, fuse_wgrad=fuse)
    if batch is not None:
        logits = logits.transpose(0, 1).contiguous()
    out = change(name, logits, in_place)
    assert (out is logits) == in_place
    out.backward(g)
    return out.detach(), x.grad, weight.grad, getattr(weight, "main_grad", None), None if b is None else b.grad


@pytest.mark.parametrize("name", sorted(CHANGES))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_logits_can_be_changed_in_place_with_the_out_of_place_gradients(mode: str, layout: str, name: str):
    # the head's output is no view made inside its autograd.Function, so autograd allows
    # the in-place op, and the gradients are those of the same change out of place
    assert_same_bits(in_place_step(mode, layout, name, True), in_place_step(mode, layout, name, False))


@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_in_place_change_with_bias_and_main_grad_fusion(mode: str):
    got = in_place_step(mode, "[s, 1, h]", "div_", True, fuse=True, bias=True)
    expected = in_place_step(mode, "[s, 1, h]", "div_", False, fuse=True, bias=True)
    assert got[2] is None and got[3].any()  # the weight gradient went to main_grad
    assert_same_bits(got, expected)


@pytest.mark.parametrize("view", ["the logits", "a view of them"])
@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_a_hook_on_the_logits_runs_after_an_in_place_change(mode: str, view: str):
    # FSDP2 puts its unshard-before-backward hook on the tensor a unit returns; verl scales
    # logits.squeeze(0) in place. Were the [b, s, V] logits an autograd view of the Function's
    # 2-D output, the in-place op would move the graph onto that base and the hook would never
    # run (the head's sharded weight then read freed storage in its backward), as it runs for
    # torch's own linear
    x = torch.randn(1, 32, H, generator=torch.Generator().manual_seed(5)).bfloat16().requires_grad_()
    w = torch.nn.Parameter(torch.randn(V, H, generator=torch.Generator().manual_seed(6)).bfloat16())
    for logits in (lm_head_linear(x, w, None, mode), torch.nn.functional.linear(x, w)):
        assert not logits._is_view()
        ran: list[torch.Size] = []
        logits.register_hook(lambda grad, ran=ran: ran.append(grad.shape))
        target = logits.squeeze(0) if view == "a view of them" else logits
        target.div_(0.7)
        logits.float().logsumexp(-1).sum().backward()
        assert ran == [logits.shape]


def test_unknown_mode_is_refused():
    x, w = operands()
    with pytest.raises(ValueError, match="unknown fp32 LM-head mode 'bf16'"):
        lm_head_linear(x, w, None, "bf16")


@pytest.mark.parametrize("terms", [1, 2, 3])
def test_split_error_falls_with_each_term(terms: int):
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(32, 256, generator=gen)
    b = torch.randn(256, 16, generator=gen).bfloat16()
    ref = a.double() @ b.double()
    err = relative_error(sum_mm(split(a, b.dtype, terms), b), ref)
    # Each term carries 8 more bits of a; fp32 accumulation (~2**-24 * sqrt(k)) is the floor.
    assert err < max(2.0 ** (-8 * terms), 2.0**-20)


def test_split_needs_a_term():
    with pytest.raises(ValueError, match="at least 1"):
        split(torch.ones(1, 1), torch.bfloat16, terms=0)
