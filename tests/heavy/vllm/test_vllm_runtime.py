"""fp32 logits from a patched vLLM, on the CPU, through every refit door."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.heavy.vllm import tiny
from tests.heavy.vllm.conftest import NEMOTRON, PATCHED_ROOT, REPO

WAYS = ["1", "fp32out", "copy"]


def hidden(rows: int = 7, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, tiny.HIDDEN, generator=g) * 3).to(torch.bfloat16)


def test_the_patched_file_is_what_vllm_imports():
    import vllm.model_executor.models.nemotron_h as module

    assert module.__file__ == str(PATCHED_ROOT / NEMOTRON)
    assert hasattr(module, "_fp32patch_lm_head_runtime")


@pytest.mark.parametrize("value", [None, "0"])
def test_off_is_bit_identical_to_stock(vllm_runtime, env, value):
    env(value)
    patched = vllm_runtime.model()
    stock = vllm_runtime.model(tiny.stock_module().NemotronHForCausalLM)
    stock.load_state_dict(patched.state_dict())
    h = hidden()
    got, want = patched.compute_logits(h), stock.compute_logits(h)
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert "_fp32patch_state" not in patched.lm_head.__dict__  # the runtime never ran


@pytest.mark.parametrize("way", WAYS)
def test_on_gives_fp32_logits_close_to_float64(vllm_runtime, env, way):
    model = vllm_runtime.model()
    h = hidden()
    want = tiny.reference(h, model)
    env(None)
    bf16_err = tiny.rel_err(model.compute_logits(h), want)
    env(way)
    logits = model.compute_logits(h)
    assert logits.dtype == torch.float32 and logits.shape == (h.shape[0], tiny.VOCAB)
    err = tiny.rel_err(logits, want)
    assert err < 1e-5, err
    assert bf16_err > 100 * err  # the stock path really is coarser: the test can tell them apart


class VLShape(torch.nn.Module):
    """A VL model's shape (NemotronH_Nano_VL_V2): the text model nested as language_model."""

    def __init__(self, language_model):
        super().__init__()
        self.language_model = language_model

    def compute_logits(self, hidden_states):
        return self.language_model.compute_logits(hidden_states)


class GraphWrapperShape:
    """A CUDA-graph wrapper's shape: not a module, reaches the real one by unwrap()."""

    def __init__(self, runnable):
        self.runnable = runnable

    def unwrap(self):
        return self.runnable


def _new_weight(model, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(model.lm_head.weight.shape, generator=g).to(torch.bfloat16)


def _door_load_weights(model, vl, new):
    model.load_weights([("lm_head.weight", new[: tiny.VOCAB])])  # a checkpoint holds the unpadded vocab


def _door_data_copy(model, vl, new):
    model.lm_head.weight.data.copy_(new)  # NCCL reshard style: no load_weights, no version bump


def _door_param_copy(model, vl, new):
    with torch.no_grad():
        model.lm_head.weight.copy_(new)


def _door_rebind(model, vl, new):
    model.lm_head.weight.data = new.clone()


def _door_vl_sync(model, vl, new):
    from fp32patch.runtime import vllm_lm_head

    vl.language_model.lm_head.weight.data.copy_(new)
    vllm_lm_head.sync(GraphWrapperShape(vl))


DOORS = {
    "load_weights": _door_load_weights,
    "param.data.copy_": _door_data_copy,
    "param.copy_": _door_param_copy,
    "param.data=": _door_rebind,
    "vl-wrapper+unwrap+sync": _door_vl_sync,
}


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize("way", ["fp32out", "copy"])
def test_logits_follow_every_refit(vllm_runtime, env, way, door):
    env(way)
    model = vllm_runtime.model()
    vl = VLShape(model)
    h = hidden()
    for step, seed in enumerate((11, 12, 13)):  # dummy weights, then refit after refit
        logits = vl.compute_logits(h) if door.startswith("vl") else model.compute_logits(h)
        assert tiny.rel_err(logits, tiny.reference(h, model)) < 1e-5, (step, door)
        DOORS[door](model, vl, _new_weight(model, seed))
    logits = model.compute_logits(h)
    assert tiny.rel_err(logits, tiny.reference(h, model)) < 1e-5


def test_copy_is_not_a_parameter_and_is_rebuilt_only_when_needed(vllm_runtime, env):
    from fp32patch.runtime import vllm_lm_head

    env("copy")
    model = vllm_runtime.model()
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    h = hidden()
    model.compute_logits(h)
    model.compute_logits(h)
    [info] = vllm_lm_head.describe(model)
    assert info["way"] == "copy" and info["copy_builds"] == 1
    assert info["copy_bytes"] == model.lm_head.weight.numel() * 4
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    model.load_weights([("lm_head.weight", _new_weight(model, 5)[: tiny.VOCAB])])
    model.compute_logits(h)
    assert vllm_lm_head.describe(model)[0]["copy_builds"] == 2


def test_one_log_line_per_head_not_per_step(vllm_runtime, env, decisions):
    env("fp32out")
    model = vllm_runtime.model()
    for _ in range(5):
        model.compute_logits(hidden())
    lines = [r.getMessage() for r in decisions]
    assert len(lines) == 1 and "fp32out" in lines[0], lines


@pytest.mark.parametrize("value", ["TF32", "true", "2", "fp32"])
def test_invalid_value_is_an_error_listing_the_valid_ones(vllm_runtime, env, value):
    model = vllm_runtime.model()
    env(value)
    with pytest.raises(ValueError, match=r"use one of 0, 1, fp32out, copy"):
        model.compute_logits(hidden())


def test_quantized_head_falls_back_with_a_log_line(vllm_runtime, env, decisions):
    class Fp8LinearMethod:  # the class name is what the runtime reads
        def __init__(self, inner):
            self.inner = inner

        def apply(self, layer, x, bias=None):
            return self.inner.apply(layer, x, bias=bias)

    env("fp32out")
    model = vllm_runtime.model()
    model.lm_head.quant_method = Fp8LinearMethod(model.lm_head.quant_method)
    logits = model.compute_logits(hidden())
    assert logits.dtype == torch.bfloat16
    assert any("quantized head (Fp8LinearMethod)" in r.getMessage() for r in decisions)


def test_lora_logits_processor_falls_back_with_a_log_line(vllm_runtime, env, decisions):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    class LogitsProcessorWithLoRA(LogitsProcessor):
        pass

    env("fp32out")
    model = vllm_runtime.model()
    model.logits_processor.__class__ = LogitsProcessorWithLoRA
    assert model.compute_logits(hidden()).dtype == torch.bfloat16
    assert any("LoRA" in r.getMessage() for r in decisions)


def test_native_head_dtype_is_recognised(vllm_runtime, env, decisions):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    if "head_dtype" not in LogitsProcessor.__init__.__code__.co_names:
        pytest.skip("this vLLM predates head_dtype (0.26)")
    env(None)
    native = vllm_runtime.model(head_dtype="float32")
    h = hidden()
    stock_fp32 = native.compute_logits(h)
    env("1")
    logits = native.compute_logits(h)
    assert logits.dtype == torch.float32 and torch.equal(logits, stock_fp32)
    assert any("head_dtype=float32" in r.getMessage() for r in decisions)


def test_a_policy_without_a_head_is_an_error():
    from fp32patch.runtime import vllm_lm_head

    with pytest.raises(LookupError, match="no LM head found in Linear"):
        vllm_lm_head.mark_dirty(torch.nn.Linear(2, 2))
    with pytest.raises(LookupError):
        vllm_lm_head.sync(GraphWrapperShape(VLShape(torch.nn.Linear(2, 2))))


_WITHOUT_FP32PATCH = """
import os, sys
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
sys.path.insert(0, {root!r})
sys.path.insert(1, {tests!r})
import importlib.util
assert importlib.util.find_spec("fp32patch") is None, "fp32patch must not be importable here"
from heavy_probe import tiny_session
import tests.heavy.vllm.tiny as tiny
with tiny_session() as build:
    model = build(family=tiny.FAMILIES[{family!r}])
    h = __import__("torch").randn(3, 64).to(__import__("torch").bfloat16)
    print("off:", model.compute_logits(h).dtype)
    os.environ["NRL_VLLM_FP32_LM_HEAD"] = "1"
    try:
        model.compute_logits(h)
    except RuntimeError as exc:
        print("on:", exc)
"""


@pytest.mark.parametrize(
    ("family", "says"),
    [
        ("nemotron-h", "asks for fp32 LM-head logits"),
        ("qwen2", "asks for fp32 LM-head logits"),
    ],  # one gate for both patches
)
def test_patched_file_works_where_fp32patch_is_not_installed(tmp_path, family, says):
    """Off: stock behaviour. On: the first use fails, saying fp32patch is missing."""
    probe = tmp_path / "heavy_probe.py"
    probe.write_text(
        "import contextlib\n"
        "import tests.heavy.vllm.tiny as tiny\n"
        "from tests.support.rendezvous import file_store\n"
        "@contextlib.contextmanager\n"
        "def tiny_session():\n"
        "    with file_store() as init_method, tiny.session(init_method) as builder:\n"
        "        yield builder.model\n"
    )
    # the test helpers travel without the fp32patch package: copy just tests/
    import shutil

    shutil.copytree(REPO / "tests", tmp_path / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NRL_VLLM_FP32_LM_HEAD")}
    script = _WITHOUT_FP32PATCH.format(root=str(PATCHED_ROOT), tests=str(tmp_path), family=family)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "off: torch.bfloat16" in out.stdout
    assert f"on: NRL_VLLM_FP32_LM_HEAD='1' {says}, but fp32patch cannot be imported" in out.stdout
