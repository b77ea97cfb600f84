"""The vLLM runtime's logic on plain torch modules shaped like vLLM's (no vLLM needed):
which way it takes, how it finds heads, and when the copy is rebuilt."""

from __future__ import annotations

import contextlib

import pytest
import torch

from bench.lm_head import LmHead, Model
from fp32patch.runtime import vllm_lm_head


def _model(seed: int = 0, v: int = 96, h: int = 32) -> Model:
    gen = torch.Generator().manual_seed(seed)
    return Model((torch.randn(v, h, generator=gen) * 0.1).bfloat16())


def _hidden(seed: int = 1, h: int = 32) -> torch.Tensor:
    return torch.randn(5, h, generator=torch.Generator().manual_seed(seed)).bfloat16()


def _rel(logits: torch.Tensor, model: Model, hidden: torch.Tensor) -> float:
    ref = hidden.double() @ model.lm_head.weight.double().t()
    return ((logits.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", None),
        ("0", None),
        ("1", "auto"),
        ("fp32out", "fp32out"),
        ("copy", "copy"),
        (" copy ", "copy"),
    ],
)
def test_requested_way(value, expected):
    environ = {} if value is None else {vllm_lm_head.ENV: value}
    assert vllm_lm_head.requested_way(environ) == expected


@pytest.mark.parametrize("value", ["TF32", "true", "fp32", "2", "False"])
def test_invalid_values_list_the_valid_ones(value):
    with pytest.raises(ValueError, match=r"use one of 0, 1, fp32out, copy"):
        vllm_lm_head.requested_way({vllm_lm_head.ENV: value})


def test_auto_takes_copy_where_torch_has_no_out_dtype_kernel(monkeypatch):
    # the CPU build of torch has no bf16 x bf16 -> fp32 mm: "1" picks the copy there
    monkeypatch.setenv(vllm_lm_head.ENV, "1")
    model = _model()
    logits = vllm_lm_head.compute_logits(model, _hidden())
    assert vllm_lm_head.describe(model)[0]["way"] == "copy"
    assert logits.dtype == torch.float32 and _rel(logits, model, _hidden()) < 1e-6


class Wrapper:
    def __init__(self, inner):
        self.inner = inner

    def unwrap(self):
        return self.inner


class VL(torch.nn.Module):
    def __init__(self, language_model):
        super().__init__()
        self.language_model = language_model


class Policy(torch.nn.Module):
    """A head two levels down, under neither unwrap() nor language_model."""

    def __init__(self, model):
        super().__init__()
        self.block = torch.nn.ModuleDict({"decoder": model})


def test_heads_are_found_through_unwrap_language_model_and_a_scan():
    model = _model()
    assert vllm_lm_head.resolve_heads(model) == [model]
    assert vllm_lm_head.resolve_heads(Wrapper(Wrapper(VL(model)))) == [model]
    assert vllm_lm_head.resolve_heads(VL(Wrapper(model))) == [model]
    assert vllm_lm_head.resolve_heads(Policy(model)) == [model]
    two = torch.nn.ModuleList([_model(1), _model(2)])
    assert len(vllm_lm_head.resolve_heads(two)) == 2


def test_a_model_without_a_head_raises():
    with pytest.raises(LookupError, match="no LM head found in Sequential"):
        vllm_lm_head.sync(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    lonely = torch.nn.Module()
    lonely.lm_head = LmHead(torch.zeros(4, 2).bfloat16())  # a head but no logits processor
    with pytest.raises(LookupError):
        vllm_lm_head.mark_dirty(lonely)


def test_copy_is_rebuilt_only_when_the_weight_changed(monkeypatch):
    monkeypatch.setenv(vllm_lm_head.ENV, "copy")
    model = _model()
    h = _hidden()
    for _ in range(3):
        vllm_lm_head.compute_logits(model, h)
    state = model.lm_head._fp32patch_state
    assert state.copy.builds == 1
    address = state.copy.weight.data_ptr()

    weight = model.lm_head.weight
    weight.data[7, 3] += 1.0  # one element, written past autograd and load_weights
    assert _rel(vllm_lm_head.compute_logits(model, h), model, h) < 1e-6
    assert state.copy.builds == 2 and state.copy.weight.data_ptr() == address  # rebuilt in place

    vllm_lm_head.mark_dirty(Wrapper(model))
    vllm_lm_head.compute_logits(model, h)
    assert state.copy.builds == 3
    assert vllm_lm_head.sync(VL(model)) == 1 and state.copy.builds == 4


def test_copy_is_off_the_parameters_and_state_dict(monkeypatch):
    monkeypatch.setenv(vllm_lm_head.ENV, "copy")
    model = _model()
    before = (list(dict(model.named_parameters())), list(model.state_dict()), list(dict(model.named_buffers())))
    vllm_lm_head.compute_logits(model, _hidden())
    after = (list(dict(model.named_parameters())), list(model.state_dict()), list(dict(model.named_buffers())))
    assert before == after
    assert vllm_lm_head.describe(model)[0]["copy_bytes"] == model.lm_head.weight.numel() * 4


def test_switching_the_way_takes_a_new_decision(monkeypatch):
    model = _model()
    h = _hidden()
    monkeypatch.setenv(vllm_lm_head.ENV, "copy")
    vllm_lm_head.compute_logits(model, h)
    monkeypatch.setenv(vllm_lm_head.ENV, "fp32out")
    logits = vllm_lm_head.compute_logits(model, h)
    assert vllm_lm_head.describe(model)[0]["way"] == "fp32out" and logits.dtype == torch.float32


def test_the_generic_route_recognises_the_nemotron_stand_in(monkeypatch):
    """Both vLLM patches applied: NemotronH's route hands the processor a stand-in head;
    the generic route returns it untouched, so the GEMM runs once."""
    monkeypatch.setenv(vllm_lm_head.ENV, "copy")
    model = _model()
    state = vllm_lm_head._state(model.logits_processor, model.lm_head, "copy", torch.bfloat16, "test")
    stand_in = vllm_lm_head._Fp32Head(model.lm_head, state)
    assert vllm_lm_head.fp32_head(model.logits_processor, stand_in, _hidden()) is stand_in
    routed = vllm_lm_head.fp32_head(model.logits_processor, model.lm_head, _hidden())
    assert isinstance(routed, vllm_lm_head._Fp32Head) and routed._head is model.lm_head


def test_describe_gives_each_head_a_way_and_a_reason(monkeypatch):
    monkeypatch.delenv(vllm_lm_head.ENV, raising=False)
    model = _model()
    [info] = vllm_lm_head.describe(model)
    # neither patch is applied to the module this model comes from: stock, and why
    assert (info["owner"], info["way"], info["patch"]) == ("Model", "stock", None)
    assert "neither fp32patch vLLM patch" in info["reason"]
    monkeypatch.setenv(vllm_lm_head.ENV, "fp32out")
    vllm_lm_head.compute_logits(model, _hidden())
    [info] = vllm_lm_head.describe(model)
    assert info["way"] == "fp32out" and "fp32out" in info["reason"]


@pytest.mark.parametrize("grad", [False, True], ids=["inference-mode", "autograd"])
@pytest.mark.parametrize("way", ["fp32out", "copy"])
def test_either_ways_logits_can_be_changed_in_place(monkeypatch, way, grad):
    # vLLM's logits processor scales the logits in place (``logits *= scale``); the runtime's
    # GEMMs are plain torch ops (no autograd.Function), so their output may be changed so
    monkeypatch.setenv(vllm_lm_head.ENV, way)
    model = _model()
    h = _hidden().reshape(5, 1, 32).requires_grad_(grad)
    with contextlib.nullcontext() if grad else torch.inference_mode():
        logits = vllm_lm_head.compute_logits(model, h).transpose(0, 1)
        expected = logits / 0.7 * 1.5
        logits.div_(0.7).mul_(1.5)
    assert logits.dtype == torch.float32 and torch.equal(logits, expected)
    if grad:
        logits.sum().backward()
        assert h.grad is not None and h.grad.shape == h.shape
