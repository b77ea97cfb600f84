"""vllm-fp32-logits on vLLM 0.9.x, whose torch (2.7) has no ``mm(out_dtype=)``: the
``copy`` way, run through the real patched ``logits_processor.py`` of vLLM 0.9.1.

The file comes out of the 0.9.1 wheel and is patched by the spec; only the vLLM modules
it imports (distributed gather, platform, envs) are stood in for by plain ones, since a
whole vLLM 0.9.1 needs a CUDA torch 2.7. torch itself is wrapped to refuse
``out_dtype``, as torch 2.7 does.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from fp32patch.patcher.spec import load_specs
from fp32patch.patcher.transform import transform
from fp32patch.runtime import fp32out, vllm_lm_head
from tests.conftest import LOGITS_PROCESSOR
from tests.support.pypi import member_files

pytestmark = pytest.mark.network

VERSION = "0.9.1"
VOCAB, PADDED, HIDDEN = 300, 320, 64


class UnquantizedEmbeddingMethod:
    """vLLM's unquantized head method: a bf16 GEMM with a bf16 result."""

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(x, layer.weight, bias)


class ParallelLMHead(torch.nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter((torch.randn(PADDED, HIDDEN, generator=g) * 0.5).bfloat16())
        self.quant_method = UnquantizedEmbeddingMethod()


def _vllm_imports(monkeypatch) -> None:
    """The names logits_processor.py 0.9.1 imports from vLLM, at tensor-parallel size 1."""
    modules = {
        name: types.ModuleType(name)
        for name in (
            "vllm",
            "vllm.envs",
            "vllm.distributed",
            "vllm.model_executor",
            "vllm.model_executor.layers",
            "vllm.model_executor.layers.vocab_parallel_embedding",
            "vllm.model_executor.sampling_metadata",
            "vllm.platforms",
        )
    }
    modules["vllm"].envs = modules["vllm.envs"]
    modules["vllm.envs"].VLLM_LOGITS_PROCESSOR_THREADS = None
    modules["vllm.distributed"].tensor_model_parallel_all_gather = lambda t: t
    modules["vllm.distributed"].tensor_model_parallel_gather = lambda t: t
    modules["vllm.model_executor.layers.vocab_parallel_embedding"].VocabParallelEmbedding = ParallelLMHead
    modules["vllm.model_executor.sampling_metadata"].SamplingMetadata = object
    modules["vllm.platforms"].current_platform = types.SimpleNamespace(use_all_gather=lambda: False)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


def _load(source: bytes, name: str):
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


@pytest.fixture
def modules(monkeypatch):
    """(stock, patched) logits_processor modules of vLLM 0.9.1."""
    _vllm_imports(monkeypatch)
    original = member_files("vllm", VERSION, [LOGITS_PROCESSOR])[LOGITS_PROCESSOR].read_bytes()
    [spec] = [s for s in load_specs() if s.id == "vllm-fp32-logits"]
    result = transform(spec, original, path=LOGITS_PROCESSOR, version=VERSION)
    assert result.status == "applied" and result.variant == "head-gemm"
    return _load(original, "stock_lp_0_9_1"), _load(result.new, "patched_lp_0_9_1")


@pytest.fixture
def torch_2_7(monkeypatch):
    """torch.mm as torch 2.7 has it: no out_dtype keyword."""
    real = torch.mm

    def mm(a, b, *, out=None, **kwargs):
        if kwargs:
            raise TypeError(f"mm() got an unexpected keyword argument '{next(iter(kwargs))}'")
        return real(a, b) if out is None else real(a, b, out=out)

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(fp32out, "_SUPPORT", {})  # probe again, under this torch
    yield
    assert not fp32out.out_dtype_supported(torch.device("cpu"), torch.bfloat16)


def _hidden(seed: int = 1) -> torch.Tensor:
    return (torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16()


def _reference(head: ParallelLMHead, h: torch.Tensor) -> torch.Tensor:
    return h.double() @ head.weight.detach().double()[:VOCAB].T


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("value", [None, "0"])
def test_off_is_the_stock_code(modules, torch_2_7, monkeypatch, value):
    stock, patched = modules
    if value is None:
        monkeypatch.delenv(vllm_lm_head.ENV, raising=False)
    else:
        monkeypatch.setenv(vllm_lm_head.ENV, value)
    head, h = ParallelLMHead(), _hidden()
    got = patched.LogitsProcessor(VOCAB)(head, h)
    assert got.dtype == torch.bfloat16 and torch.equal(got, stock.LogitsProcessor(VOCAB)(head, h))
    assert "_fp32patch_state" not in head.__dict__


def test_auto_takes_the_copy_way_and_follows_refits(modules, torch_2_7, monkeypatch):
    _, patched = modules
    monkeypatch.setenv(vllm_lm_head.ENV, "1")
    processor, head, h = patched.LogitsProcessor(VOCAB, soft_cap=None), ParallelLMHead(), _hidden()
    for step in range(3):
        logits = processor(head, h)
        assert logits.dtype == torch.float32 and logits.shape == (9, VOCAB)
        assert _rel(logits, _reference(head, h)) < 1e-6, step
        state = head._fp32patch_state
        assert (state.way, state.copy.builds) == ("copy", step + 1)
        with torch.no_grad():  # a refit straight into the parameter: no load_weights, no hook
            head.weight.copy_(ParallelLMHead(seed=10 + step).weight)
    processor(head, h)
    processor(head, h)
    assert head._fp32patch_state.copy.builds == 4  # rebuilt once per refit, not per call


def test_named_fp32out_is_an_exact_upcast_there(modules, torch_2_7, monkeypatch):
    _, patched = modules
    monkeypatch.setenv(vllm_lm_head.ENV, "fp32out")
    head, h = ParallelLMHead(), _hidden()
    logits = patched.LogitsProcessor(VOCAB, scale=0.5)(head, h)
    assert logits.dtype == torch.float32
    assert _rel(logits, _reference(head, h) * 0.5) < 1e-6  # vLLM's own scale, on fp32 logits
    assert head._fp32patch_state.way == "fp32out" and head._fp32patch_state.copy.weight is None


@pytest.mark.parametrize(
    ("environ", "way"),
    [
        ({"FP32PATCH_VLLM_LM_HEAD": "copy"}, "copy"),
        ({"FP32PATCH_VLLM_LM_HEAD": "fp32out", "NRL_VLLM_FP32_LM_HEAD": "fp32out"}, "fp32out"),
        ({"FP32PATCH_VLLM_LM_HEAD": "1", "NRL_VLLM_FP32_LM_HEAD": ""}, "copy"),
    ],
)
def test_the_neutral_name_turns_the_patched_file_on(modules, torch_2_7, monkeypatch, environ, way):
    _, patched = modules
    for name in ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    head, h = ParallelLMHead(), _hidden()
    logits = patched.LogitsProcessor(VOCAB)(head, h)
    assert logits.dtype == torch.float32 and _rel(logits, _reference(head, h)) < 1e-6
    assert head._fp32patch_state.way == way


def test_the_two_names_disagreeing_stop_the_forward_naming_both(modules, torch_2_7, monkeypatch):
    _, patched = modules
    monkeypatch.setenv("FP32PATCH_VLLM_LM_HEAD", "1")
    monkeypatch.setenv("NRL_VLLM_FP32_LM_HEAD", "0")
    with pytest.raises(ValueError, match=r"FP32PATCH_VLLM_LM_HEAD='1' and NRL_VLLM_FP32_LM_HEAD='0' disagree"):
        patched.LogitsProcessor(VOCAB)(ParallelLMHead(), _hidden())
