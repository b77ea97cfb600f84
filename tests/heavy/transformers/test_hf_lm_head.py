"""apply_fp32_lm_head on real transformers models in one process (CPU): Qwen2 (untied),
Llama (tied), Gemma2 (final soft-cap), built from configs.

Off is the stock model bit for bit. On, the logits are fp32 and within 1e-5 (relative to
the largest) of float64 over the head's own bf16 inputs; the weight gradient is within each
mode's rounding bound of float64 over the head's own input and gradient; the input gradient
is no further from the float64 model's than the stock head's is.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hf_harness import (
    FAMILIES,
    GRAD_SLACK,
    MODES,
    SIZES,
    U_BF16,
    U_FP32,
    H,
    T,
    V,
    head_bound,
    loss_of,
    rel_norm,
    rel_to_max,
    tiny,
    token_ids,
    watch,
)

from fp32patch.runtime.hf_lm_head import (
    NoLmHeadError,
    UnsupportedLmHeadError,
    apply_fp32_lm_head,
    fp32_lm_head_mode,
)
from tests.support.in_place import CHANGES, assert_same_bits, change


def step(model, ids=None):
    """One forward and backward of the whole model: logits, what the head saw, every
    parameter's gradient (by name)."""
    ids = token_ids() if ids is None else ids
    seen = watch(model.get_output_embeddings())
    logits = model(ids).logits
    loss_of(logits, ids).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return logits.detach(), seen, grads


# ---- off and on --------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("value", [None, False])
def test_off_is_the_stock_model_bit_for_bit(family, value):
    stock_logits, _, stock_grads = step(tiny(family))
    model = tiny(family)
    assert apply_fp32_lm_head(model, value) is model
    logits, _, grads = step(model)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, stock_logits)
    assert grads.keys() == stock_grads.keys()
    assert all(torch.equal(grads[k], stock_grads[k]) for k in grads)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_logits_near_float64_over_the_heads_own_inputs(family, mode):
    model = apply_fp32_lm_head(tiny(family), mode)
    assert fp32_lm_head_mode(model) == mode
    logits, seen, _ = step(model)
    (x,), (w,), (out,) = seen.x, seen.weight, seen.out
    assert x.dtype == w.dtype == torch.bfloat16 and out.dtype == logits.dtype == torch.float32
    ref, _ = head_bound(x, w)
    assert rel_to_max(out.reshape(ref.shape), ref) < 1e-5
    cap = model.config.final_logit_softcapping if family == "gemma2" else None
    if cap is not None:  # the model's own soft-cap, now on fp32 logits
        ref = torch.tanh(ref / cap) * cap
    assert rel_to_max(logits.reshape(ref.shape), ref) < 1e-5
    # the stock head on the same inputs is far from it
    stock = x.reshape(-1, H) @ w.t()
    assert rel_to_max(stock, head_bound(x, w)[0]) > 1e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_weight_gradient_within_the_modes_rounding_of_float64(family, mode):
    model = apply_fp32_lm_head(tiny(family), mode)
    _, seen, grads = step(model)
    (x,), (g,) = seen.x, seen.grad
    # the head's own use of its weight (a tied weight also carries the embedding's gradient)
    head = copy.deepcopy(model.get_output_embeddings())
    head(x).backward(g)
    dw = head.weight.grad
    if family == "qwen2":
        assert torch.equal(dw, grads["lm_head.weight"])
    x64, g64 = x.double().reshape(-1, H), g.double().reshape(-1, V)
    ref, mag = g64.t() @ x64, g64.abs().t() @ x64.abs()
    assert dw.dtype == torch.bfloat16
    # (plus half of bf16's smallest subnormal step, for the rarest tokens' tiny gradients)
    tol = (x64.shape[0] * U_FP32 + GRAD_SLACK[mode]) * mag + U_BF16 * ref.abs() + 2.0**-134
    excess = ((dw.double() - ref).abs() - tol).max().item()
    assert excess <= 0, f"weight gradient exceeds its rounding bound by {excess:.3g}"


def head_input_grad(model, ids):
    """The gradient that reaches the head's input in a forward and backward of ``model``,
    and that input."""
    grabbed = []

    def hook(module, args, out):
        args[0].retain_grad()
        grabbed.append(args[0])

    model.get_output_embeddings().register_forward_hook(hook)
    loss_of(model(ids).logits, ids).backward()
    (x,) = grabbed
    return x.grad, x.detach()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_input_gradient_no_further_from_float64_than_the_stock_heads(family, mode):
    ids = token_ids()
    ours, x = head_input_grad(apply_fp32_lm_head(tiny(family), mode), ids)
    stock, stock_x = head_input_grad(tiny(family), ids)
    assert torch.equal(x, stock_x)  # the same network up to the head
    # float64 from the head's input on: logits, soft-cap, loss and their gradients
    model = tiny(family)
    x64 = x.double().requires_grad_()
    logits64 = x64 @ model.get_output_embeddings().weight.double().t()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        logits64 = torch.tanh(logits64 / cap) * cap
    loss_of(logits64, ids).backward()
    ours_err, stock_err = rel_norm(ours, x64.grad), rel_norm(stock, x64.grad)
    assert ours_err <= stock_err * (1 + 2**-4), (ours_err, stock_err)


# ---- what stays as it was ---------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_names_state_dict_class_and_ties_stay(family):
    stock = tiny(family)
    model = apply_fp32_lm_head(tiny(family), "fp32out")
    head = model.get_output_embeddings()
    assert type(head) is torch.nn.Linear
    assert list(model.state_dict()) == list(stock.state_dict())
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in stock.named_parameters()]
    assert (head.weight is model.get_input_embeddings().weight) == (family != "qwen2")


def test_a_tied_weights_gradient_carries_both_uses():
    # Llama, tied: the shared weight's gradient is the head's use plus the embedding's, as an
    # untied copy with the same values gives them apart
    tied = apply_fp32_lm_head(tiny("llama"), "fp32out")
    _, _, grads = step(tied)
    untied = tiny("llama")
    untied.lm_head.weight = torch.nn.Parameter(untied.model.embed_tokens.weight.detach().clone())
    apply_fp32_lm_head(untied, "fp32out")
    _, _, apart = step(untied)
    both = grads["model.embed_tokens.weight"]
    assert torch.equal(both, apart["model.embed_tokens.weight"] + apart["lm_head.weight"])
    assert apart["model.embed_tokens.weight"].abs().sum() > 0 and apart["lm_head.weight"].abs().sum() > 0


def test_refits_and_optimizer_steps_are_followed():
    model = apply_fp32_lm_head(tiny("qwen2"), "fp32out")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        logits, seen, _ = step(model)
        ref, _ = head_bound(seen.x[0], model.lm_head.weight.detach())
        assert rel_to_max(logits.reshape(ref.shape), ref) < 1e-5
        optimizer.step()
        optimizer.zero_grad()
    # a reference-weight swap: another model's state dict copied in, then back
    own = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(tiny("qwen2", seed=5).state_dict())
    logits, seen, _ = step(model)
    ref, _ = head_bound(seen.x[0], tiny("qwen2", seed=5).lm_head.weight)
    assert rel_to_max(logits.reshape(ref.shape), ref) < 1e-5
    model.load_state_dict(own)
    assert torch.equal(model.lm_head.weight, own["lm_head.weight"])


@pytest.mark.parametrize("mode", MODES)
def test_under_autocast_the_head_computes_ours_not_autocasts(mode):
    # NeMo-RL runs the forward under torch.autocast(bf16)
    model = apply_fp32_lm_head(tiny("qwen2"), mode)
    plain = model(token_ids()).logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = model(token_ids()).logits
    assert autocast.dtype == torch.float32 and torch.equal(autocast, plain)


def test_an_fp32_input_is_cast_to_bf16_inside_the_graph():
    # FSDP2's MixedPrecisionPolicy(output_dtype=float32) hands the head fp32 hidden states
    model = apply_fp32_lm_head(tiny("qwen2"), "fp32out")
    x = torch.randn(2, T, H, generator=torch.Generator().manual_seed(3)).requires_grad_()
    out = model.lm_head(x)
    expected = apply_fp32_lm_head(tiny("qwen2"), "fp32out").lm_head(x.detach().bfloat16())
    assert torch.equal(out, expected)
    out.sum().backward()
    assert x.grad.dtype == torch.float32 and model.lm_head.weight.grad.dtype == torch.bfloat16


# every change on one family, the temperature's on the others
IN_PLACE_CASES = [
    (family, mode, name)
    for family in FAMILIES
    for mode in MODES
    for name in (sorted(CHANGES) if family == "qwen2" else ["div_"])
]


@pytest.mark.parametrize(("family", "mode", "name"), IN_PLACE_CASES)
def test_logits_changed_in_place_train_as_out_of_place(family, mode, name):
    # NeMo-RL's DTensor workers: logits.div_(temperature) on a packed (batch 1) micro-batch

    def one(in_place: bool):
        model = apply_fp32_lm_head(tiny(family), mode)
        ids = token_ids(batch=1)
        logits = change(name, model(ids).logits, in_place)
        grad = torch.randn(logits.shape, generator=torch.Generator().manual_seed(4))
        logits.backward(grad)
        return logits.detach(), *(p.grad for _, p in sorted(model.named_parameters()))

    assert_same_bits(one(True), one(False))


def test_a_vl_models_head_is_found_through_get_output_embeddings_or_language_model():
    import transformers

    text = dict(SIZES, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=1, embed_dim=32, hidden_size=H, num_heads=2, in_chans=3, patch_size=4, spatial_merge_size=1)
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).bfloat16()
    apply_fp32_lm_head(model, "fp32out")
    assert fp32_lm_head_mode(model) == fp32_lm_head_mode(model.lm_head) == "fp32out"
    assert model(token_ids()).logits.dtype == torch.float32

    class Wrapper(torch.nn.Module):  # a wrapper with no head of its own, the model inside
        def __init__(self, inner):
            super().__init__()
            self.language_model = inner

        def get_output_embeddings(self):
            return None

    wrapped = Wrapper(tiny("llama"))
    apply_fp32_lm_head(wrapped, "tf32")
    assert fp32_lm_head_mode(wrapped.language_model) == "tf32"
    # the inner text model of a VL model has no head: named
    with pytest.raises(NoLmHeadError, match=r"Qwen2VLModel\.language_model has no LM head"):
        apply_fp32_lm_head(transformers.Qwen2VLForConditionalGeneration(cfg).model, "fp32out")


# ---- refusals, on the real artifacts ----------------------------------------------------------------


def test_a_peft_lora_head_is_refused():
    import peft

    model = peft.get_peft_model(tiny("qwen2"), peft.LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(UnsupportedLmHeadError, match=r"is a peft\.tuners\.lora\.layer\.Linear with adapter attributes"):
        apply_fp32_lm_head(model, "fp32out")


def test_lora_on_other_layers_only_is_fine():
    import peft

    model = peft.get_peft_model(tiny("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    apply_fp32_lm_head(model, "fp32out")
    assert fp32_lm_head_mode(model) == "fp32out"
    assert model(token_ids()).logits.dtype == torch.float32


def test_reward_and_value_models_are_refused_as_having_no_head():
    import transformers
    from hf_harness import config

    reward = transformers.Qwen2ForSequenceClassification(config("qwen2"))
    with pytest.raises(
        NoLmHeadError, match=r"Qwen2ForSequenceClassification has no LM head \(get_output_embeddings\(\) is None"
    ):
        apply_fp32_lm_head(reward, "fp32out")


def test_an_fp32_head_is_refused_outside_an_autocast():
    # precision: float32 (or an fp32 lm_head) without FSDP2 casting it: fp32 at compute time
    model = apply_fp32_lm_head(tiny("qwen2", dtype=torch.float32), "fp32out")
    ids = torch.tensor([[3, 4, 5]])
    with pytest.raises(UnsupportedLmHeadError, match=r"the forward sees a float32 head weight outside a bf16/fp16"):
        model(input_ids=ids)


def test_an_fp32_model_under_a_bf16_autocast_gets_fp32_logits_from_the_bf16_head():
    # fp32 master weights without FSDP, the forward under a trainer's bf16 autocast (verl's
    # dp_actor): the stock head's bf16 GEMM inputs, fp32 output
    stock = tiny("qwen2", dtype=torch.float32)
    model = apply_fp32_lm_head(copy.deepcopy(stock), "fp32out")
    ids = torch.tensor([[3, 4, 5, 6]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = model(input_ids=ids, output_hidden_states=True)
        theirs = stock(input_ids=ids)
    assert ours.logits.dtype == torch.float32 and theirs.logits.dtype == torch.bfloat16
    hidden = ours.hidden_states[-1].detach().bfloat16().double()
    exact = hidden @ stock.lm_head.weight.detach().bfloat16().double().T
    assert ((ours.logits.double() - exact).norm() / exact.norm()).item() < 1e-6
    # the stock head's logits are the same GEMM rounded to bf16
    assert (theirs.logits.float() - ours.logits).abs().max() <= 2**-7 * ours.logits.abs().max()
