"""vllm-fp32-logits on a real vLLM: every family's logits in fp32 with one switch.

Tiny bf16 models of several head shapes (untied, tied, Gemma2's embed_tokens with
soft-cap, MoE, and NemotronH with both vLLM patches applied), built by the real vLLM on
the CPU. Off: bit for bit what the unpatched LogitsProcessor gives. On: fp32 logits
within 1e-5 of float64, through every refit.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.heavy.vllm import tiny
from tests.heavy.vllm.conftest import PATCHED_ROOT

LOGITS = "vllm/model_executor/layers/logits_processor.py"
FAMILIES = sorted(tiny.FAMILIES)
GENERIC = [name for name in FAMILIES if name != "nemotron-h"]


def _native() -> bool:
    """vLLM 0.26+: LogitsProcessor has its own head_dtype."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    return hasattr(LogitsProcessor, "_apply_head")


def stock_logits(model, stock_class, h):
    """The model's own compute_logits, with its processor running the unpatched code."""
    patched = model.logits_processor
    stock = copy.copy(patched)
    stock.__class__ = stock_class
    model.logits_processor = stock
    try:
        return model.compute_logits(h)
    finally:
        model.logits_processor = patched


def hidden(rows: int = 7, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, tiny.HIDDEN, generator=g) * 3).to(torch.bfloat16)


def build(vllm_runtime, name: str, **overrides):
    return vllm_runtime.model(family=tiny.FAMILIES[name], **overrides)


def test_the_patched_file_is_what_vllm_imports():
    import vllm.model_executor.layers.logits_processor as module

    assert module.__file__ == str(PATCHED_ROOT / LOGITS)
    assert hasattr(module, "_fp32patch_lm_head_runtime")


@pytest.mark.parametrize("value", [None, "0"])
@pytest.mark.parametrize("name", FAMILIES)
def test_off_is_bit_identical_to_stock(vllm_runtime, env, stock_processor_class, name, value):
    env(value)
    model = build(vllm_runtime, name)
    h = hidden()
    got, want = model.compute_logits(h), stock_logits(model, stock_processor_class, h)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert "_fp32patch_state" not in tiny.head(model, tiny.FAMILIES[name]).__dict__  # the runtime never ran


def _expected_way(value: str) -> str:
    from fp32patch.runtime import fp32out

    if value == "1":
        if _native():
            return "native"
        return "fp32out" if fp32out.out_dtype_supported(torch.device("cpu"), torch.bfloat16) else "copy"
    return value


@pytest.mark.parametrize("value", ["1", "fp32out", "copy"])
@pytest.mark.parametrize("name", FAMILIES)
def test_on_gives_fp32_logits_close_to_float64(vllm_runtime, env, stock_processor_class, name, value):
    from fp32patch.runtime import vllm_lm_head

    family = tiny.FAMILIES[name]
    env(value)  # set before the model is built, as a vLLM worker has it
    model = build(vllm_runtime, name)
    [before] = vllm_lm_head.describe(model)
    h = hidden()
    want = tiny.family_reference(h, model, family)
    logits = model.compute_logits(h)
    assert logits.dtype == torch.float32 and logits.shape == (h.shape[0], tiny.VOCAB)
    err = tiny.rel_err(logits, want)
    assert err < 1e-5, err
    # the same weights in a model built without the variable (0.26+ decides at build time)
    env(None)
    off = build(vllm_runtime, name)
    tiny.head(off, family).weight.data.copy_(tiny.head(model, family).weight)
    stock = stock_logits(off, stock_processor_class, h)
    assert stock.dtype == torch.bfloat16
    assert tiny.rel_err(stock, want) > 100 * err  # the stock path really is coarser: the test can tell them apart

    [info] = vllm_lm_head.describe(model)
    assert info["way"] == before["way"] == _expected_way(value), info
    assert info["patch"] == ("nemotron-h-fp32-lm-head" if name == "nemotron-h" else "vllm-fp32-logits")
    assert info["reason"] and info["head"] == type(tiny.head(model, family)).__name__


def _refit_load_weights(model, family, new):
    model.load_weights([(family.weight, new[: tiny.VOCAB])])  # a checkpoint holds the unpadded vocab


def _refit_in_place(model, family, new):
    tiny.head(model, family).weight.data.copy_(new)  # NCCL reshard style: no load_weights


REFITS = {"load_weights": _refit_load_weights, "in-place": _refit_in_place}


@pytest.mark.parametrize("refit", sorted(REFITS))
@pytest.mark.parametrize("value", ["1", "copy"])
@pytest.mark.parametrize("name", FAMILIES)
def test_logits_follow_a_refit(vllm_runtime, env, name, value, refit):
    family = tiny.FAMILIES[name]
    env(value)
    model = build(vllm_runtime, name)
    head = tiny.head(model, family)
    h = hidden()
    for step, seed in enumerate((11, 12, 13)):  # dummy weights, then refit after refit
        logits = model.compute_logits(h)
        assert logits.dtype == torch.float32
        assert tiny.rel_err(logits, tiny.family_reference(h, model, family)) < 1e-5, step
        g = torch.Generator().manual_seed(seed)
        REFITS[refit](model, family, torch.randn(head.weight.shape, generator=g).to(torch.bfloat16))
    assert tiny.rel_err(model.compute_logits(h), tiny.family_reference(h, model, family)) < 1e-5


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.gemms = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(k in name for k in ("mm", "linear", "matmul", "gemm")):
            self.gemms.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("value", ["1", "fp32out", "copy"])
def test_both_patches_run_the_head_gemm_once(vllm_runtime, env, value):
    """NemotronH with both patches: its own route hands the processor a stand-in head (or
    leaves vLLM's head_dtype to it); the generic route recognises that and adds nothing."""
    env(value)
    model = build(vllm_runtime, "nemotron-h")
    h = hidden()
    model.compute_logits(h)  # the copy way builds its copy on first use
    with _CountGemms() as counted:
        logits = model.compute_logits(h)
    assert logits.dtype == torch.float32
    assert len(counted.gemms) == 1, counted.gemms


@pytest.mark.parametrize("name", ["qwen2", "gemma2"])
def test_quantized_head_keeps_the_stock_path_with_one_log_line(vllm_runtime, env, decisions, name):
    family = tiny.FAMILIES[name]

    class Fp8LinearMethod:  # the class name is what the runtime and vLLM's own check read
        def __init__(self, inner):
            self.inner = inner

        def apply(self, layer, x, bias=None):
            return self.inner.apply(layer, x, bias=bias)

    env("1")
    model = build(vllm_runtime, name)
    head = tiny.head(model, family)
    head.quant_method = Fp8LinearMethod(head.quant_method)
    for _ in range(3):
        assert model.compute_logits(hidden()).dtype == torch.bfloat16
    lines = [r.getMessage() for r in decisions if "quantized head (Fp8LinearMethod)" in r.getMessage()]
    assert len(lines) == 1, lines


def test_native_path_alone_refuses_a_quantized_head(vllm_runtime, env, stock_processor_class):
    """What the guard saves 0.26+ from: vLLM's own head_dtype path raises on such a head."""
    if not _native():
        pytest.skip("this vLLM predates head_dtype (0.26)")

    class Fp8LinearMethod:
        def __init__(self, inner):
            self.inner = inner

        def apply(self, layer, x, bias=None):
            return self.inner.apply(layer, x, bias=bias)

    env("1")
    model = build(vllm_runtime, "qwen2")
    model.lm_head.quant_method = Fp8LinearMethod(model.lm_head.quant_method)
    with pytest.raises(ValueError, match="unquantized lm_head"):
        stock_logits(model, stock_processor_class, hidden())


def _lora(model, hidden_size: int):
    """vLLM's own LoRA logits processor around the model's, with no adapter loaded."""
    from vllm.lora.layers.logits_processor import LogitsProcessorWithLoRA

    lora = LogitsProcessorWithLoRA(model.logits_processor, hidden_size, torch.bfloat16, torch.device("cpu"), None)
    lora.sharded_to_full_mapping_gpu = None
    lora.lora_a_stacked = lora.lora_b_stacked = None  # create_lora_weights' buffers; no adapter reads them
    # no adapter: punica adds nothing to the logits
    lora.punica_wrapper = types.SimpleNamespace(add_lora_logits=lambda logits, *args, **kwargs: logits)
    model.logits_processor = lora
    return lora


def test_lora_logits_processor(vllm_runtime, env, decisions):
    """Up to 0.25 LoRA's own _get_logits keeps the stock path, said once; from 0.26 vLLM's
    LoRA runs the head through _apply_head, so it gets vLLM's fp32 head too."""
    from fp32patch.runtime import vllm_lm_head

    env("1")
    model = build(vllm_runtime, "qwen2")
    _lora(model, tiny.HIDDEN)
    h = hidden()
    for _ in range(3):
        logits = model.compute_logits(h)
    [info] = vllm_lm_head.describe(model)
    if _native():
        assert logits.dtype == torch.float32 and info["way"] == "native"
        assert tiny.rel_err(logits, tiny.family_reference(h, model, tiny.FAMILIES["qwen2"])) < 1e-5
    else:
        assert logits.dtype == torch.bfloat16 and info["way"] == "stock"
        lines = [r.getMessage() for r in decisions if "LoRA" in r.getMessage()]
        assert len(lines) == 1, lines


def test_hf_overrides_head_dtype_is_recognised(vllm_runtime, env, decisions):
    from fp32patch.runtime import vllm_lm_head

    if not _native():
        pytest.skip("this vLLM predates head_dtype (0.26)")
    env(None)
    model = build(vllm_runtime, "qwen2", head_dtype="float32")
    h = hidden()
    by_vllm = model.compute_logits(h)
    [before] = vllm_lm_head.describe(model)
    assert before["way"] == "native" and "hf_overrides" in before["reason"]
    env("1")
    logits = model.compute_logits(h)
    assert logits.dtype == torch.float32 and torch.equal(logits, by_vllm)
    assert any("head_dtype=float32, set by hf_overrides" in r.getMessage() for r in decisions)


def test_drafters_argmax_stays_vllms_own(vllm_runtime, env, stock_processor_class):
    """get_top_tokens (0.17+) is the drafters' argmax: up to 0.25 it keeps its own bf16
    GEMM and never reaches the runtime; from 0.26 it follows vLLM's head_dtype."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    if not hasattr(LogitsProcessor, "get_top_tokens"):
        pytest.skip("this vLLM has no get_top_tokens")
    env("1")
    model = build(vllm_runtime, "qwen2")
    h = hidden(rows=64)
    top = model.logits_processor.get_top_tokens(model.lm_head, h)
    if _native():
        assert torch.equal(top, model.compute_logits(h).argmax(dim=-1))
    else:
        assert "_fp32patch_state" not in model.lm_head.__dict__  # the runtime never ran
        env(None)
        assert torch.equal(top, stock_logits(model, stock_processor_class, h).argmax(dim=-1))


def test_describe_reports_the_way_before_the_first_logits(vllm_runtime, env):
    from fp32patch.runtime import vllm_lm_head

    env(None)
    [off] = vllm_lm_head.describe(build(vllm_runtime, "gemma2"))
    assert (off["way"], off["head"], off["patch"]) == ("stock", "VocabParallelEmbedding", "vllm-fp32-logits")
    assert "unset" in off["reason"]
    env("1")
    [on] = vllm_lm_head.describe(build(vllm_runtime, "gemma2"))
    assert on["way"] == _expected_way("1") and on["reason"]


def test_the_variable_overrides_another_explicit_head_dtype_with_a_log_line(vllm_runtime, env, decisions):
    from fp32patch.runtime import vllm_lm_head

    if not _native():
        pytest.skip("this vLLM predates head_dtype (0.26)")
    env("1")
    model = build(vllm_runtime, "qwen2", head_dtype="model")
    assert any("overrides hf_overrides head_dtype=model" in r.getMessage() for r in decisions)
    h = hidden()
    logits = model.compute_logits(h)
    assert logits.dtype == torch.float32
    assert tiny.rel_err(logits, tiny.family_reference(h, model, tiny.FAMILIES["qwen2"])) < 1e-5
    assert vllm_lm_head.describe(model)[0]["way"] == "native"
