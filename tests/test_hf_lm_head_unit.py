"""hf_lm_head on plain torch modules shaped like Hugging Face causal LMs (no transformers
needed): finding the head, what is refused and how, what the override leaves alone, and
the logits and gradients it gives. Real transformers models, FSDP2 and tensor parallelism
are the heavy suite's (tests/heavy/transformers)."""

from __future__ import annotations

import copy

import pytest
import torch

from fp32patch.runtime.hf_lm_head import (
    NoLmHeadError,
    UnsupportedLmHeadError,
    apply_fp32_lm_head,
    fp32_lm_head_mode,
)
from fp32patch.runtime.lm_head_gemm import lm_head_linear
from fp32patch.runtime.modes import MEGATRON_MODES
from tests.support import tiny_lm
from tests.support.in_place import CHANGES, assert_same_bits, change

T, H, V = 12, 32, 96


class CausalLM(tiny_lm.CausalLM):
    """What the override meets in a transformers causal LM (tests/support/tiny_lm.py), at this module's sizes."""

    def __init__(self, tied: bool = False, seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__(H, V, tied=tied, seed=seed, dtype=dtype)


class RewardModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score = torch.nn.Linear(H, 1, dtype=torch.bfloat16)

    def get_output_embeddings(self):
        return None


class VisionLanguage(torch.nn.Module):
    """A VL wrapper that keeps its text model, head and all, under ``language_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.vision = torch.nn.Linear(4, H, dtype=torch.bfloat16)
        self.language_model = CausalLM()

    def get_output_embeddings(self):
        return None


def ids(seed: int = 1, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, V, (batch, T), generator=torch.Generator().manual_seed(seed))


def reference(model: CausalLM, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.hidden(tokens).double() @ model.lm_head.weight.double().t()


def rel_to_max(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


# ---- switching on and off ---------------------------------------------------------------


@pytest.mark.parametrize("value", [None, False])
def test_off_leaves_the_model_alone(value):
    model = CausalLM()
    stock = model(ids())
    assert apply_fp32_lm_head(model, value) is model
    assert "forward" not in model.lm_head.__dict__ and fp32_lm_head_mode(model) is None
    assert torch.equal(model(ids()), stock)


@pytest.mark.parametrize("value", ["TF32", "true", 1, "bf16"])
def test_invalid_values_are_refused_with_the_valid_ones(value):
    with pytest.raises(ValueError, match='use one of false, true, "fp32", "tf32"'):
        apply_fp32_lm_head(CausalLM(), value)


@pytest.mark.parametrize("value", [True, *MEGATRON_MODES])
def test_each_mode_gives_fp32_logits_near_float64(value):
    model = CausalLM()
    assert apply_fp32_lm_head(model, value) is model
    mode = "fp32" if value is True else value
    assert fp32_lm_head_mode(model) == fp32_lm_head_mode(model.lm_head) == mode
    logits = model(ids())
    assert logits.dtype == torch.float32
    assert rel_to_max(logits, reference(model, ids())) < 1e-5
    # the stock head's bf16 logits are far from it
    stock = CausalLM()(ids())
    assert rel_to_max(stock, reference(model, ids())) > 1e-3


def test_applying_twice_is_a_no_op_and_another_mode_is_refused():
    model = CausalLM()
    apply_fp32_lm_head(model, "fp32out")
    forward = model.lm_head.__dict__["forward"]
    assert apply_fp32_lm_head(model, "fp32out") is model
    assert model.lm_head.__dict__["forward"] is forward
    with pytest.raises(ValueError, match=r"CausalLM\.lm_head already gives fp32 logits in mode 'fp32out'"):
        apply_fp32_lm_head(model, "tf32")
    assert fp32_lm_head_mode(model) == "fp32out"


def test_the_module_keeps_its_class_names_state_and_hooks():
    model = CausalLM()
    calls = []
    model.lm_head.register_forward_pre_hook(lambda module, args: calls.append("pre"))
    model.lm_head.register_forward_hook(lambda module, args, out: calls.append(out.dtype))
    before = (type(model.lm_head), list(model.state_dict()), [n for n, _ in model.named_parameters()])
    apply_fp32_lm_head(model, "fp32out")
    after = (type(model.lm_head), list(model.state_dict()), [n for n, _ in model.named_parameters()])
    assert before == after and type(model.lm_head) is torch.nn.Linear
    model(ids())
    assert calls == ["pre", torch.float32]
    # a copy is converted too, and computes with its own weight
    twin = copy.deepcopy(model)
    assert fp32_lm_head_mode(twin) == "fp32out" and twin.lm_head.forward.__self__ is twin.lm_head


def test_weights_are_read_at_every_call():
    # refits, optimizer steps and reference-weight swaps write into the same parameter
    model = CausalLM()
    apply_fp32_lm_head(model, "fp32out")
    before = model(ids())
    with torch.no_grad():
        model.lm_head.weight.copy_(CausalLM(seed=3).lm_head.weight)
    after = model(ids())
    assert not torch.equal(before, after)
    assert rel_to_max(after, reference(model, ids())) < 1e-5
    model.load_state_dict(CausalLM(seed=4).state_dict())
    assert rel_to_max(model(ids()), reference(model, ids())) < 1e-5


def test_a_vl_wrappers_language_model_head_is_found():
    model = VisionLanguage()
    apply_fp32_lm_head(model, "fp32out")
    assert fp32_lm_head_mode(model) == fp32_lm_head_mode(model.language_model.lm_head) == "fp32out"
    assert model.language_model(ids()).dtype == torch.float32


# ---- what the forward computes ------------------------------------------------------------


@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_an_fp32_input_is_cast_to_the_weights_dtype_inside_the_graph(mode):
    # FSDP2's MixedPrecisionPolicy(output_dtype=float32) hands the head fp32 hidden states
    model = CausalLM()
    apply_fp32_lm_head(model, mode)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(2)).requires_grad_()
    logits = model.lm_head(x)
    assert torch.equal(logits, lm_head_linear(x.detach().bfloat16(), model.lm_head.weight.detach(), None, mode))
    logits.sum().backward()
    assert x.grad.dtype == torch.float32  # the cast's gradient, back to the input's dtype
    assert model.lm_head.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_autocast_does_not_turn_the_head_back_to_bf16(mode):
    model = CausalLM()
    apply_fp32_lm_head(model, mode)
    plain = model(ids())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = model(ids())
    assert autocast.dtype == torch.float32 and torch.equal(autocast, plain)


@pytest.mark.parametrize("name", sorted(CHANGES))
@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_logits_changed_in_place_give_the_out_of_place_gradients(mode, name):
    def step(in_place: bool):
        model = CausalLM()
        apply_fp32_lm_head(model, mode)
        out = change(name, model(ids(batch=1)), in_place)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
        return out.detach(), *(p.grad for _, p in sorted(model.named_parameters()))

    assert_same_bits(step(True), step(False))


@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_a_tied_weights_gradient_carries_both_uses(mode):
    model = CausalLM(tied=True)
    apply_fp32_lm_head(model, mode)
    assert model.lm_head.weight is model.embed_tokens.weight
    tokens = ids()
    grad = torch.randn(2, T, V, generator=torch.Generator().manual_seed(6))
    model(tokens).backward(grad)
    both = model.embed_tokens.weight.grad.clone()
    # the head's use alone, through the same GEMM, plus the embedding's use alone
    head_only = CausalLM(tied=True)
    hidden = head_only.hidden(tokens).detach()
    weight = torch.nn.Parameter(head_only.lm_head.weight.detach().clone())
    lm_head_linear(hidden, weight, None, mode).backward(grad)
    embedding_only = both - weight.grad.float()
    assert embedding_only.abs().sum() > 0  # the embedding's rows of the used tokens
    untouched = torch.ones(V, dtype=torch.bool)
    untouched[tokens.unique()] = False
    assert torch.equal(both[untouched], weight.grad[untouched])


# ---- refusals ---------------------------------------------------------------------------------


class PeftStyleLoraLinear(torch.nn.Module):
    """A LoRA layer in peft's manner: the linear kept as ``base_layer``, adapters beside it."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(base.in_features, 4, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(4, base.out_features, bias=False)})

    @property
    def weight(self):
        return self.base_layer.weight

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class AutomodelStyleLoraLinear(torch.nn.Linear):
    """A LoRA linear in Automodel's manner: a Linear subclass carrying its adapter weights."""

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__(base.in_features, base.out_features, bias=False, dtype=base.weight.dtype)
        self.lora_A = torch.nn.Linear(base.in_features, 4, bias=False, dtype=base.weight.dtype)
        self.lora_B = torch.nn.Linear(4, base.out_features, bias=False, dtype=base.weight.dtype)


class Linear(torch.nn.Module):
    """Stands in for Transformer Engine's ``Linear``: a module of its own, not an nn.Linear."""

    __module__ = "transformer_engine.pytorch.module.linear"

    def __init__(self, base: torch.nn.Linear) -> None:
        super().__init__()
        self.weight = base.weight

    def forward(self, x):
        return x @ self.weight.t()


def with_head(make) -> CausalLM:
    model = CausalLM()
    model.lm_head = make(model.lm_head)
    return model


def with_instance_adapter(head: torch.nn.Linear) -> torch.nn.Linear:
    head.lora_scaling = 2.0  # an adapter patched onto the plain instance
    return head


def with_forward_replaced(head: torch.nn.Linear) -> torch.nn.Linear:
    head.forward = lambda x: torch.nn.functional.linear(x, head.weight)  # e.g. accelerate's hooks
    return head


REFUSALS = [
    (
        lambda: with_head(PeftStyleLoraLinear),
        UnsupportedLmHeadError,
        r"PeftStyleLoraLinear with adapter attributes \['base_layer', 'lora_A', 'lora_B'\]",
    ),
    (
        lambda: with_head(AutomodelStyleLoraLinear),
        UnsupportedLmHeadError,
        r"AutomodelStyleLoraLinear with adapter attributes \['lora_A', 'lora_B'\]",
    ),
    (
        lambda: with_head(with_instance_adapter),
        UnsupportedLmHeadError,
        r"torch.nn.modules.linear.Linear with adapter attributes \['lora_scaling'\]",
    ),
    (
        lambda: with_head(Linear),
        UnsupportedLmHeadError,
        r"is a transformer_engine\.pytorch\.module\.linear\.Linear; only a plain torch\.nn\.Linear",
    ),
    (
        lambda: with_head(with_forward_replaced),
        UnsupportedLmHeadError,
        r"CausalLM\.lm_head\.forward was already replaced",
    ),
    (RewardModel, NoLmHeadError, r"RewardModel has no LM head \(get_output_embeddings\(\) is None"),
    (
        lambda: torch.nn.Sequential(torch.nn.Linear(2, 2)),
        NoLmHeadError,
        r"Sequential has no LM head \(has no get_output_embeddings\(\)",
    ),
]


@pytest.mark.parametrize(("make", "error", "message"), REFUSALS, ids=[m for _, _, m in REFUSALS])
def test_refusals_name_what_was_found_and_change_nothing(make, error, message):
    model = make()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    forward = getattr(
        model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None, "forward", None
    )
    with pytest.raises(error, match=message):
        apply_fp32_lm_head(model, "fp32out")
    assert fp32_lm_head_mode(model) is None
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    if forward is not None:
        assert model.get_output_embeddings().forward == forward


def test_the_error_types_are_type_errors():
    # a trainer can catch the refusals as one type, a missing head as its own
    assert issubclass(NoLmHeadError, UnsupportedLmHeadError) and issubclass(UnsupportedLmHeadError, TypeError)


def test_an_fp32_weight_under_a_bf16_autocast_is_computed_from_its_bf16_copy():
    """A trainer's fp32 master weights without FSDP (verl's dp_actor under its bf16 autocast):
    the stock head computes bf16 logits from the autocast's bf16 copies; the fp32 head computes
    fp32 logits from the same copies, and the gradient reaches the fp32 weight."""
    model = CausalLM(dtype=torch.float32)
    apply_fp32_lm_head(model, "fp32out")
    x = torch.randn(3, 5, H, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.lm_head(x)
    assert logits.dtype == torch.float32
    w = model.lm_head.weight.detach().bfloat16()
    xb = x.detach().bfloat16()
    assert torch.equal(logits.detach(), lm_head_linear(xb, w, None, "fp32out"))
    grad = torch.randn_like(logits)
    logits.backward(grad)
    assert model.lm_head.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    # the GEMM's own gradient (bf16 for fp32out), carried back through the casts
    w_ref = w.clone().requires_grad_()
    x_ref = xb.clone().requires_grad_()
    lm_head_linear(x_ref, w_ref, None, "fp32out").backward(grad)
    assert torch.equal(model.lm_head.weight.grad, w_ref.grad.float())
    assert torch.equal(x.grad, x_ref.grad.float())


def test_an_fp32_weight_outside_an_autocast_is_refused_by_the_forward():
    model = CausalLM(dtype=torch.float32)
    apply_fp32_lm_head(model, "fp32out")  # the forward decides: it sees the autocast or not
    with pytest.raises(
        UnsupportedLmHeadError, match="the forward sees a float32 head weight outside a bf16/fp16 autocast"
    ):
        model.lm_head(torch.randn(2, H))
    with torch.autocast("cpu", dtype=torch.float16, enabled=False), pytest.raises(UnsupportedLmHeadError):
        model.lm_head(torch.randn(2, H))


def test_an_fp32_weight_seen_by_the_forward_is_refused_there():
    # apply_fp32_lm_head cannot always know the compute dtype (FSDP2 casts at each forward)
    model = CausalLM()
    apply_fp32_lm_head(model, "fp32out")
    model.lm_head.float()
    with pytest.raises(UnsupportedLmHeadError, match="the forward sees a float32 head weight"):
        model.lm_head(torch.randn(2, H))


def test_instead_of_logits_hands_the_heads_input_and_weight_to_compute_inside_its_call():
    """A stack that needs log-probs, not logits, computes them in the head's own call (where a
    trainer's hooks gathered the weight); only that head, only inside the block; an unconverted
    head is refused."""
    from fp32patch.runtime.heads.hf import instead_of_logits

    model, other = CausalLM(seed=1), CausalLM(seed=2)
    ids = torch.randint(0, V, (2, T))
    with pytest.raises(UnsupportedLmHeadError, match="not converted"):
        with instead_of_logits(model.lm_head, lambda hidden, weight: None):
            pass
    apply_fp32_lm_head(model, "fp32out")
    apply_fp32_lm_head(other, "fp32out")
    seen = []

    def compute(hidden, weight):
        seen.append((hidden, weight))
        return hidden.sum(-1, keepdim=True).float()

    with instead_of_logits(model.lm_head, compute):
        out = model(ids)
        logits_of_other = other(ids)
    assert out.shape == (2, T, 1) and len(seen) == 1
    assert torch.equal(seen[0][0], model.hidden(ids)) and seen[0][1] is model.lm_head.weight
    assert logits_of_other.shape == (2, T, V) and logits_of_other.dtype == torch.float32
    assert model(ids).shape == (2, T, V)  # outside the block: the fp32 logits again
