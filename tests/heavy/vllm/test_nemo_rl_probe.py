"""The startup probe on real vLLM models (CPU): what each worker reports, and the driver's
verdict on those reports, for every state a NeMo-RL run can be in.

NemotronH comes from the patched import root (conftest.py applies every spec to a hardlinked
copy of the environment's vLLM); "unpatched" is the environment's own nemotron_h.py, loaded
under another name. Workers that are separate processes are spawned as vLLM would: gloo, one
rank each, with their own environment.
"""

from __future__ import annotations

import copy
import inspect
import logging
import os
import socket
import sys

import pytest
import torch

from fp32patch.runtime.nemo_rl import Fp32LmHeadMismatchError, check_probe_reports, probe_vllm_model
from fp32patch.runtime.vllm_probe import MARKER
from tests.heavy.vllm import tiny
from tests.heavy.vllm.conftest import NEMOTRON, PATCHED_ROOT
from tests.heavy.vllm.test_vllm_runtime import GraphWrapperShape, VLShape
from tests.support.rendezvous import file_store

VAR = "NRL_VLLM_FP32_LM_HEAD"
KEY = "policy.megatron_cfg.fp32_lm_head"


@pytest.fixture
def var(monkeypatch):
    """Sets (a string) or unsets (None) the variable in this process."""

    def set_to(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(VAR, raising=False)
        else:
            monkeypatch.setenv(VAR, value)

    return set_to


@pytest.fixture
def info_lines(caplog):
    caplog.set_level(logging.INFO, logger="nemo_rl.fp32patch")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "nemo_rl.fp32patch"]


def refusal(reports, mode) -> str:
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        check_probe_reports(reports, mode)
    return str(caught.value)


def test_on_reports_float32_and_the_way_and_the_check_agrees(vllm_runtime, var, info_lines):
    var("fp32out")
    report = probe_vllm_model(vllm_runtime.model())
    assert report["dtype"] == "float32"
    assert report["way"] == "fp32out" and "fp32out" in report["reason"]
    assert report["env"] == "fp32out" and report["patched"] is True
    assert report["pid"] == os.getpid() and report["host"] == socket.gethostname()
    assert report["model"] == "NemotronHForCausalLM" and report["gathered"] is True
    assert report["file"] == str(PATCHED_ROOT / NEMOTRON) and report["file"] in report["files"]
    check_probe_reports([report], "fp32out")
    assert info_lines() == [
        "fp32patch (driver): LM head fp32 in both engines: Megatron fp32_lm_head='fp32out', "
        "1 vLLM worker(s) compute float32 logits (way: fp32out)"
    ]


# "1" is vLLM's own head_dtype=float32 on 0.26+ (native), the best runtime way before
@pytest.mark.parametrize(("value", "way"), [("1", ("copy", "fp32out", "native")), ("copy", ("copy",))])
def test_each_value_reports_its_way(vllm_runtime, var, value, way):
    var(value)
    report = probe_vllm_model(vllm_runtime.model())
    assert report["dtype"] == "float32" and report["way"] in way and report["env"] == value


def test_off_reports_bfloat16_and_off(vllm_runtime, var, info_lines):
    var(None)
    model = vllm_runtime.model()
    report = probe_vllm_model(model)
    assert (report["dtype"], report["way"], report["env"], report["patched"]) == ("bfloat16", "off", None, True)
    assert (
        report["reason"] == "vLLM's switch (FP32PATCH_VLLM_LM_HEAD or NRL_VLLM_FP32_LM_HEAD) is unset in this process"
    )
    assert "_fp32patch_state" not in model.lm_head.__dict__  # off: the runtime never ran
    check_probe_reports([report], None)
    assert info_lines() == [
        "fp32patch (driver): LM head fp32 off in both engines: 1 vLLM worker(s) compute bfloat16 logits"
    ]
    message = refusal([report], "fp32out")
    assert (
        f"vLLM worker 0 (host {socket.gethostname()}, pid {os.getpid()}) computes bfloat16 logits while "
        f"{KEY}='fp32out': {VAR} is unset in that process"
    ) in message


def test_on_against_megatron_off_is_refused(vllm_runtime, var):
    var("1")
    report = probe_vllm_model(vllm_runtime.model())
    message = refusal([report], False)
    assert f"computes float32 logits while {KEY} is off: {VAR}='1' in that process" in message


def test_an_unpatched_model_file_with_the_variable_set_is_refused(vllm_runtime, var, stock_processor_class):
    """A venv left unpatched: neither the model file nor the logits processor carries the patches."""
    var("fp32out")
    stock = tiny.stock_module()
    model = vllm_runtime.model(stock.NemotronHForCausalLM)
    processor = copy.copy(model.logits_processor)
    processor.__class__ = stock_processor_class
    if "_fp32patch_native_source" in processor.__dict__:
        # vLLM 0.26+: the patched constructor turned on vLLM's own head_dtype=float32; the stock
        # constructor leaves the model's dtype there, so the copy gets what the stock file sets
        del processor.__dict__["_fp32patch_native_source"]
        processor.head_dtype = torch.bfloat16
    model.logits_processor = processor
    report = probe_vllm_model(model)
    assert (report["dtype"], report["way"], report["patched"]) == ("bfloat16", "stock", False)
    assert report["reason"].startswith("the model file is not patched (run fp32patch apply in that venv)")
    message = refusal([report], "fp32out")
    # both files the vLLM patches edit for NemotronH, neither patched: vLLM's logits processor and the model's own
    stock_processor = inspect.getsourcefile(stock_processor_class)
    assert stock_processor.endswith("vllm/model_executor/layers/logits_processor.py")
    assert report["patch_files"] == [stock_processor, stock.__file__]
    assert (
        f"computes bfloat16 logits while {KEY}='fp32out': the model file is not patched "
        f"(run fp32patch apply in that venv): {stock_processor}, {stock.__file__}"
    ) in message


def _llama(builder):
    """A tiny LlamaForCausalLM: a family the NemotronH spec does not cover."""
    from transformers import LlamaConfig
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.llama import LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=tiny.VOCAB,
        hidden_size=tiny.HIDDEN,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    folder = builder.folder("llama-one-layer", config)
    model_config = ModelConfig(model=folder, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128)
    vllm_config = VllmConfig(model_config=model_config, parallel_config=builder.vllm_config.parallel_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(vllm_config):
            model = LlamaForCausalLM(vllm_config=vllm_config)
    finally:
        torch.set_default_dtype(previous)
    model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    return model


def test_a_model_family_no_installed_spec_covers(vllm_runtime, var):
    """Llama: fp32 only if a spec covers vLLM's logits processor here; otherwise the variable
    is set, the logits stay bf16 and the check names the unpatched files."""
    from vllm.model_executor.layers import logits_processor

    generic = MARKER in open(logits_processor.__file__, encoding="utf-8").read()
    var("1")
    report = probe_vllm_model(_llama(vllm_runtime))
    assert report["model"] == "LlamaForCausalLM" and report["patched"] is generic
    if generic:
        assert report["dtype"] == "float32"
        check_probe_reports([report], "fp32out")
    else:
        assert (report["dtype"], report["way"]) == ("bfloat16", "stock")
        assert report["reason"].endswith("layers/logits_processor.py")
        message = refusal([report], True)
        assert f"computes bfloat16 logits while {KEY}='fp32': the model file is not patched" in message


def test_an_unpatched_logits_processor_is_the_file_named(vllm_runtime, var, stock_processor_class):
    """Llama with vLLM's stock logits processor: the patch for every model lives in
    layers/logits_processor.py, so that is the file the refusal names, not models/llama.py."""
    var("1")
    model = _llama(vllm_runtime)
    processor = copy.copy(model.logits_processor)
    processor.__class__ = stock_processor_class
    if "_fp32patch_native_source" in processor.__dict__:
        # vLLM 0.26+: the patched constructor turned on vLLM's own head_dtype=float32; the stock
        # constructor leaves the model's dtype there, so the copy gets what the stock file sets
        del processor.__dict__["_fp32patch_native_source"]
        processor.head_dtype = torch.bfloat16
    model.logits_processor = processor
    report = probe_vllm_model(model)
    assert (report["dtype"], report["way"], report["patched"]) == ("bfloat16", "stock", False)
    stock_processor = inspect.getsourcefile(stock_processor_class)
    assert report["patch_files"] == [stock_processor] and report["file"].endswith("models/llama.py")
    message = refusal([report], True)
    assert message.count("not patched") == 1 and "llama.py" not in message
    assert f"the model file is not patched (run fp32patch apply in that venv): {stock_processor}" in message


def test_a_head_the_runtime_leaves_stock_is_refused_with_the_runtime_reason(vllm_runtime, var):
    from fp32patch.runtime import vllm_lm_head

    class Fp8LinearMethod:  # a quantized head: the runtime reads the class name
        def __init__(self, inner):
            self.inner = inner

        def apply(self, layer, x, bias=None):
            return self.inner.apply(layer, x, bias=bias)

    var("fp32out")
    model = vllm_runtime.model()
    model.lm_head.quant_method = Fp8LinearMethod(model.lm_head.quant_method)
    report = probe_vllm_model(model)
    assert (report["dtype"], report["way"], report["patched"]) == ("bfloat16", "stock", True)
    described = vllm_lm_head.describe(model)[0].get("reason")
    assert report["reason"] == (described or "the runtime kept vLLM's stock bf16 path")
    assert f"computes bfloat16 logits while {KEY}='fp32out': the way is stock: {report['reason']}" in refusal(
        [report], "fp32out"
    )


def test_an_invalid_value_in_the_worker_is_reported_and_refused(vllm_runtime, var):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    var("TF32")
    if hasattr(LogitsProcessor, "_apply_head"):  # vLLM 0.26+ reads it as the processor is built
        with pytest.raises(ValueError, match="NRL_VLLM_FP32_LM_HEAD='TF32' is not a valid value"):
            vllm_runtime.model()
        var("1")
        model = vllm_runtime.model()
        var("TF32")
    else:
        model = vllm_runtime.model()
    report = probe_vllm_model(model)
    assert report["dtype"] is None and report["env"] == "TF32"
    assert report["reason"].startswith("compute_logits raised ValueError: NRL_VLLM_FP32_LM_HEAD='TF32'")
    assert f"computes no logits while {KEY}='fp32out': compute_logits raised ValueError" in refusal([report], "fp32out")


def test_native_head_dtype_is_fp32_without_the_variable(vllm_runtime, var):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    if "head_dtype" not in LogitsProcessor.__init__.__code__.co_names:
        pytest.skip("this vLLM predates head_dtype (0.26)")
    var(None)
    report = probe_vllm_model(vllm_runtime.model(head_dtype="float32"))
    assert (report["dtype"], report["way"]) == ("float32", "native")
    assert f"computes float32 logits while {KEY} is off: the way is native: " in refusal([report], None)
    check_probe_reports([report], "fp32")


def test_wrappers_and_the_old_signature_reach_the_same_logits(vllm_runtime, var):
    """A CUDA-graph wrapper (unwrap()) around a VL model, and compute_logits(hidden_states,
    sampling_metadata) as vLLM before 0.11 spelt it."""
    from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM

    class WithSamplingMetadata(NemotronHForCausalLM):
        def compute_logits(self, hidden_states, sampling_metadata):
            assert sampling_metadata is None  # None: no pruning, as vLLM's processor reads it
            return super().compute_logits(hidden_states)

    var("fp32out")
    for model in (GraphWrapperShape(VLShape(vllm_runtime.model())), vllm_runtime.model(WithSamplingMetadata)):
        report = probe_vllm_model(model)
        assert (report["dtype"], report["way"], report["patched"]) == ("float32", "fp32out", True)


def test_the_probe_leaves_the_model_as_a_first_call_would(vllm_runtime, var):
    """No probe hook stays behind, and an fp32 copy built by the probe is refit like any other."""
    var("copy")
    model = vllm_runtime.model()
    processor = model.logits_processor
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    assert probe_vllm_model(model)["way"] == "copy"
    assert "_gather_logits" not in processor.__dict__
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    hidden = (torch.randn(5, tiny.HIDDEN, generator=torch.Generator().manual_seed(3)) * 3).bfloat16()
    new = (torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(4))).bfloat16()
    model.lm_head.weight.data.copy_(new)  # a refit that never calls load_weights
    with torch.inference_mode():  # as vLLM's model runner calls it
        logits = model.compute_logits(hidden)
    assert tiny.rel_err(logits, tiny.reference(hidden, model)) < 1e-5


# ---- workers in their own processes -----------------------------------------------------------


def _full_weight() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(tiny.VOCAB, tiny.HIDDEN, generator=gen) * 0.5).to(torch.bfloat16)


def _worker(rank: int, world: int, init_method: str, value: str | None, all_gather: bool, results) -> None:
    """One vLLM worker: its own process and environment, the model loaded, then the probe (as
    NeMo-RL's worker extension runs it on collective_rpc)."""
    sys.path.insert(0, str(PATCHED_ROOT))
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    if value is None:
        os.environ.pop(VAR, None)
    else:
        os.environ[VAR] = value
    with tiny.session(init_method, world=world, rank=rank) as builder:
        model = builder.model()
        model.load_weights([("lm_head.weight", _full_weight())])
        # False: vLLM's gather to rank 0 (other ranks get None), as on platforms without all-gather
        model.logits_processor.use_all_gather = all_gather
        results[rank] = probe_vllm_model(model)


def _spawn(world: int, value: str | None, all_gather: bool = True) -> list[dict]:
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    with file_store() as init_method:
        mp.spawn(_worker, args=(world, init_method, value, all_gather, results), nprocs=world, join=True)
    return [dict(results[rank]) for rank in range(world)]


@pytest.mark.parametrize("all_gather", [True, False], ids=["all-gather", "gather-to-rank-0"])
def test_tp2_workers_each_probe_their_shard(var, info_lines, all_gather):
    var("1")  # the driver's own environment; each worker has its own
    reports = _spawn(2, "fp32out", all_gather)
    assert [r["dtype"] for r in reports] == ["float32", "float32"]
    assert [r["way"] for r in reports] == ["fp32out", "fp32out"]
    assert [r["gathered"] for r in reports] == [True, all_gather]  # rank 1 measured on its own shard
    assert len({r["pid"] for r in reports} | {os.getpid()}) == 3
    check_probe_reports([reports], "fp32out")  # one engine's collective_rpc result, nested
    assert "2 vLLM worker(s) compute float32 logits (way: fp32out)" in info_lines()[0]


def test_the_variable_missing_in_the_workers_is_refused_naming_each(var):
    var("1")  # set where the driver runs, not passed on to the workers
    reports = _spawn(2, None)
    assert [(r["dtype"], r["way"], r["env"]) for r in reports] == [("bfloat16", "off", None)] * 2
    message = refusal(reports, "fp32out")
    for index, r in enumerate(reports):
        assert (
            f"vLLM worker {index} (host {r['host']}, pid {r['pid']}) computes bfloat16 logits while "
            f"{KEY}='fp32out': {VAR} is unset in that process"
        ) in message
