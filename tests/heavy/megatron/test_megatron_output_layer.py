"""apply_fp32_lm_head on real megatron-core models at tensor parallel size 1 (CPU, gloo).

Every check is against a float64 reference, with the error allowed by rounding alone
(see ``megatron_harness.assert_within``): fp32 accumulation, the mode's grad_output
precision, and a final bf16 rounding where the result is bf16.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.module import Float16Module
from megatron_harness import (
    DX_SLACK,
    GRAD_SLACK,
    MODES,
    B,
    H,
    Nest,
    S,
    V,
    assert_within,
    config,
    emulate_ddp,
    gpt_model,
    hybrid_model,
    problem,
)

from fp32patch.runtime.megatron_lm_head import apply_fp32_lm_head, fp32_lm_head_mode

pytestmark = pytest.mark.usefixtures("tp1")


def bounds(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor):
    """float64 logits, input and weight gradients, and the magnitudes their bounds need."""
    x64, w64, g64 = x.double(), weight.double(), grad.double()
    flat_x, flat_g = x64.reshape(-1, H), g64.reshape(-1, V)
    return {
        "logits": (x64 @ w64.t(), x64.abs() @ w64.abs().t()),
        "dx": (g64 @ w64, g64.abs() @ w64.abs()),
        "dw": (flat_g.t() @ flat_x, flat_g.abs().t() @ flat_x.abs()),
    }


def check_head(logits, dx, dw, x, weight, grad, mode, dw_in_bf16=True):
    ref = bounds(x, weight, grad)
    assert logits.dtype == torch.float32
    assert_within(logits, *ref["logits"], terms=H)
    assert_within(dx, *ref["dx"], terms=V, slack=DX_SLACK[mode], rounded_to_bf16=True)
    assert_within(dw, *ref["dw"], terms=S * B, slack=GRAD_SLACK[mode], rounded_to_bf16=dw_in_bf16)


# ---- a whole real model: MambaModel (NemotronH's class) inside Float16Module ----------


def run_hybrid(mode: str | None, tied: bool = False):
    """Token ids through a real Float16Module(MambaModel); returns what the head saw."""
    cfg = config(hidden_dropout=0.0, attention_dropout=0.0)
    model = hybrid_model(cfg, tied=tied)
    wrapped = Float16Module(cfg, model)
    if mode is not None:
        assert apply_fp32_lm_head([wrapped], mode) == [model.output_layer]
    seen: dict[str, torch.Tensor] = {}

    def grab(module, args, kwargs):
        hidden = args[0] if args else kwargs["input_"]
        hidden.retain_grad()
        passed = kwargs.get("weight")
        seen["hidden"], seen["weight"] = hidden, module.weight if passed is None else passed

    model.output_layer.register_forward_pre_hook(grab, with_kwargs=True)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (B, S), generator=gen)
    positions = torch.arange(S).expand(B, S)
    logits = wrapped(ids, positions, attention_mask=None)  # [b, s, v]
    grad = torch.randn(B, S, V, generator=gen)
    logits.backward(grad)
    # Back to Megatron's [s, b, ...] layout, the head's own.
    return logits.transpose(0, 1), seen["hidden"], seen["weight"], grad.transpose(0, 1), model


@pytest.mark.parametrize("mode", MODES)
def test_a_real_model_gives_fp32_logits_and_exact_gradients(mode: str):
    logits, hidden, weight, grad, model = run_hybrid(mode)
    check_head(logits, hidden.grad, model.output_layer.weight.grad, hidden, weight, grad, mode)


def test_the_stock_head_rounds_logits_to_bf16_and_the_fp32_head_does_not():
    stock, hidden, weight, _, _ = run_hybrid(None)
    fp32, *_ = run_hybrid("fp32out")
    ref, mag = bounds(hidden, weight, torch.zeros(S, B, V))["logits"]
    # The same computation: Megatron's logits are ours rounded to bf16.
    assert_within(stock, ref, mag, terms=H, rounded_to_bf16=True)
    torch.testing.assert_close(stock, fp32.bfloat16().float(), rtol=2.0**-7, atol=0)
    with pytest.raises(AssertionError, match="rounding bound"):
        assert_within(stock, ref, mag, terms=H)
    stock_err = (stock.double() - ref).norm()
    assert (fp32.double() - ref).norm() * 1000 < stock_err


@pytest.mark.parametrize("mode", MODES)
def test_a_real_model_with_tied_embeddings_uses_the_embedding_weight(mode: str):
    logits, hidden, weight, grad, model = run_hybrid(mode, tied=True)
    assert model.output_layer.weight is None
    assert weight is model.embedding.word_embeddings.weight
    ref = bounds(hidden, weight, grad)
    assert_within(logits, *ref["logits"], terms=H)
    assert_within(hidden.grad, *ref["dx"], terms=V, slack=DX_SLACK[mode], rounded_to_bf16=True)


# ---- every nesting shape, real models inside -------------------------------------------


def shape_hybrid(cfg):
    model = hybrid_model(cfg)
    return model, model.output_layer


def shape_float16(cfg):
    model = hybrid_model(cfg)
    return Float16Module(cfg, model), model.output_layer


def shape_ddp(cfg):
    model = gpt_model(cfg)
    return Nest("module", Float16Module(cfg, model)), model.output_layer


def shape_llava(cfg):
    model = gpt_model(cfg)
    return Nest("language_model", model, post_process=True), model.output_layer


def shape_nemotron_vl(cfg):
    model = gpt_model(cfg)
    vl = Nest("llava_model", Nest("language_model", model, post_process=True))
    return Nest("module", Float16Module(cfg, vl)), model.output_layer


def shape_omni(cfg):
    model = gpt_model(cfg)
    return Nest("thinker", Nest("language_model", model)), model.output_layer


def shape_pipeline(cfg):
    first = gpt_model(cfg, pre_process=True, post_process=False)
    last = gpt_model(cfg, pre_process=False, post_process=True)
    return [Float16Module(cfg, first), Float16Module(cfg, last)], last.output_layer


SHAPES = [
    shape_hybrid,
    shape_float16,
    shape_ddp,
    shape_llava,
    shape_nemotron_vl,
    shape_omni,
    shape_pipeline,
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda f: f.__name__.removeprefix("shape_"))
def test_each_nesting_shape(shape, mode: str):
    chunk, layer = shape(config())
    assert apply_fp32_lm_head(chunk, mode) == [layer]
    p = problem()
    with torch.no_grad():
        layer.weight.copy_(p.weight)
    x = p.x.clone().requires_grad_()
    # As GPTModel/HybridModel call their head (weight=None unless tied).
    logits, _ = layer(x, weight=None, runtime_gather_output=None)
    logits.backward(p.grad)
    check_head(logits, x.grad, layer.weight.grad, p.x, p.weight, p.grad, mode)


# ---- gradient accumulation: Megatron's DDP and its fused path -----------------------------


def two_micro_batches(mode: str, fused: bool):
    """Two forward/backward passes into one DDP-managed weight; returns it and the inputs."""
    cfg = config()
    model = gpt_model(cfg)
    layer = model.output_layer
    if fused:
        # Megatron refuses gradient_accumulation_fusion=True in the config without the
        # APEX CUDA kernel; the layer's flag is what its forward passes on.
        layer.gradient_accumulation_fusion = True
    p = problem()
    with torch.no_grad():
        layer.weight.copy_(p.weight)
    emulate_ddp(layer.weight)
    apply_fp32_lm_head(Nest("module", model), mode)
    grads = [p.grad, problem(seed=1).grad]
    for grad in grads:
        logits, _ = layer(p.x)
        logits.backward(grad)
    return layer.weight, p, grads


@pytest.mark.parametrize("fused", [False, True], ids=["ddp", "ddp-fused"])
@pytest.mark.parametrize("mode", MODES)
def test_weight_gradients_accumulate_in_main_grad(mode: str, fused: bool):
    weight, p, grads = two_micro_batches(mode, fused)
    assert weight.grad is None  # DDP's hook has taken it
    assert weight.main_grad.dtype == torch.float32
    x = p.x.double().reshape(-1, H)
    ref = sum(g.double().reshape(-1, V).t() @ x for g in grads)
    mag = sum(g.double().abs().reshape(-1, V).t() @ x.abs() for g in grads)
    # Unfused, each micro-batch's gradient is rounded to bf16 before DDP adds it.
    rounding = 0 if fused else sum((g.double().reshape(-1, V).t() @ x).abs() for g in grads)
    assert_within(
        weight.main_grad,
        ref,
        mag,
        terms=2 * S * B,
        slack=GRAD_SLACK[mode],
        extra=2.0**-8 * rounding,
    )


# how much smaller the fused (fp32 main_grad) error must be than one bf16 rounding: fp32
# and the hi/lo split carry grad_output with 16+ bits; fp32out with TF32's 11
@pytest.mark.parametrize(("mode", "factor"), [("fp32", 100), ("fp32out-hilo", 100), ("fp32out", 4)])
def test_fusion_keeps_the_weight_gradient_out_of_bf16(mode: str, factor: int):
    fused, p, grads = two_micro_batches(mode, fused=True)
    unfused, _, _ = two_micro_batches(mode, fused=False)
    x = p.x.double().reshape(-1, H)
    ref = sum(g.double().reshape(-1, V).t() @ x for g in grads)
    fused_err = (fused.main_grad.double() - ref).norm()
    unfused_err = (unfused.main_grad.double() - ref).norm()
    assert fused_err * factor < unfused_err


@pytest.mark.parametrize("mode", MODES)
def test_tied_weight_passed_at_call_time_gets_the_gradient(mode: str):
    cfg = config()
    model = gpt_model(cfg, tied=True)
    layer = model.output_layer
    assert layer.weight is None  # GPTModel passes the embedding's weight in
    embedding = model.shared_embedding_or_output_weight()
    p = problem()
    with torch.no_grad():
        embedding.copy_(p.weight)
    layer.gradient_accumulation_fusion = True
    emulate_ddp(embedding)
    assert apply_fp32_lm_head(Float16Module(cfg, model), mode) == [layer]
    x = p.x.clone().requires_grad_()
    logits, _ = layer(x, weight=embedding)
    logits.backward(p.grad)
    assert embedding.grad is None
    check_head(logits, x.grad, embedding.main_grad, p.x, p.weight, p.grad, mode, dw_in_bf16=False)


# ---- re-application, errors ------------------------------------------------------------------


def test_applying_twice_is_a_no_op():
    chunk, layer = shape_ddp(config())
    p = problem()
    first = apply_fp32_lm_head(chunk, "fp32out")
    impl = layer.__dict__["_forward_impl"]
    before, _ = layer(p.x)
    assert apply_fp32_lm_head(chunk, "fp32out") == first == [layer]
    assert layer.__dict__["_forward_impl"] is impl
    after, _ = layer(p.x)
    assert torch.equal(before, after)


def test_a_different_mode_second_is_refused_and_changes_nothing():
    chunk, layer = shape_float16(config())
    apply_fp32_lm_head(chunk, "tf32")
    with pytest.raises(ValueError, match="already runs in mode 'tf32'"):
        apply_fp32_lm_head(chunk, "fp32out")
    assert fp32_lm_head_mode(layer) == "tf32"


def test_a_last_stage_without_output_layer_is_named():
    cfg = config()
    model = gpt_model(cfg)
    del model.output_layer
    with pytest.raises(ValueError, match=r"Float16Module\.module \(GPTModel\) is the last"):
        apply_fp32_lm_head([Float16Module(cfg, model)], "fp32out")


def test_a_vl_model_whose_language_model_is_missing_is_named():
    with pytest.raises(ValueError, match="Nest is the last pipeline stage"):
        apply_fp32_lm_head(Nest("language_model", None, post_process=True), "fp32")


def test_a_frozen_head_still_passes_the_input_gradient():
    # Megatron sends a frozen weight down another path (linear_with_frozen_weight).
    chunk, layer = shape_hybrid(config())
    p = problem()
    with torch.no_grad():
        layer.weight.copy_(p.weight)
    layer.weight.requires_grad_(False)
    apply_fp32_lm_head(chunk, "fp32out")
    x = p.x.clone().requires_grad_()
    logits, _ = layer(x)
    logits.backward(p.grad)
    assert layer.weight.grad is None
    ref, mag = bounds(p.x, p.weight, p.grad)["dx"]
    assert_within(x.grad, ref, mag, terms=V, slack=DX_SLACK["fp32out"], rounded_to_bf16=True)
