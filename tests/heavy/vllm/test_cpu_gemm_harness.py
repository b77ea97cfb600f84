"""The harness takes vLLM's plain CPU GEMM on every CPU, also one that vLLM believes has AMX.

A CPU with AMX (``amx_tile``) makes vLLM's CPU platform pack the head's weight for
sgl-kernel's GEMM, which the CUDA wheel these suites run lacks: every model build failed on
such a machine. Here vLLM is made to believe it runs on one (AMX, AVX-512 BF16 and oneDNN
all reported present), and the harness must still give the head torch's linear on its own
weight, with the logits the tests measure unchanged.
"""

from __future__ import annotations

import pytest
import torch

from tests.heavy.vllm import tiny


@pytest.fixture
def amx_cpu(monkeypatch):
    """vLLM sees a CPU with AMX, AVX-512 BF16 and a oneDNN build, whatever this one has."""
    import vllm._custom_ops as ops

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    if hasattr(torch._C, "_cpu") and hasattr(torch._C._cpu, "_is_amx_tile_supported"):
        monkeypatch.setattr(torch._C._cpu, "_is_amx_tile_supported", lambda: True)  # releases that ask torch._C
    monkeypatch.setattr(ops, "_supports_onednn", True, raising=False)
    monkeypatch.setenv("VLLM_CPU_SGL_KERNEL", "1")  # releases that gate the AMX kernel on it


def test_vllm_believing_in_amx_would_take_a_kernel_the_wheel_lacks(vllm_runtime, amx_cpu):
    """The control: with AMX reported, vLLM's own dispatch leaves the plain path for the head
    (or fails inside a kernel this wheel lacks), so the fake does reach vLLM's choice."""
    family = tiny.FAMILIES["qwen2"]
    lm_head = tiny.head(vllm_runtime.model(family=family), family)
    probe = torch.nn.Module()
    probe.weight = torch.nn.Parameter(lm_head.weight.detach().clone(), requires_grad=False)
    try:
        tiny.stock_cpu_dispatch()(probe, remove_weight=False)
    except (AttributeError, RuntimeError) as exc:  # the CUDA wheel's _C has no sgl-kernel op
        assert "convert_weight_packed" in str(exc) or "onednn" in str(exc).lower()
    else:
        assert probe.cpu_linear is not torch.nn.functional.linear


@pytest.mark.parametrize("way", [None, "1"])
@pytest.mark.parametrize("name", sorted(tiny.FAMILIES))
def test_the_harness_keeps_the_plain_gemm_on_a_cpu_with_amx(vllm_runtime, amx_cpu, env, name, way):
    family = tiny.FAMILIES[name]
    env(way)  # read when the model's processor is built on 0.26+
    model = vllm_runtime.model(family=family)
    lm_head = tiny.head(model, family)
    assert lm_head.cpu_linear is torch.nn.functional.linear
    assert lm_head.weight.numel() > 0  # the weight stayed in place, unpacked
    h = (torch.randn(5, tiny.HIDDEN, generator=torch.Generator().manual_seed(3)) * 3).to(torch.bfloat16)
    logits = model.compute_logits(h)[:, : tiny.VOCAB]
    want = tiny.family_reference(h, model, family)
    if way is None:
        assert logits.dtype == torch.bfloat16
        assert tiny.rel_err(logits, want) < 1e-2  # the head's own weight, rounded to bf16
    else:
        assert logits.dtype == torch.float32
        assert tiny.rel_err(logits, want) < 1e-5


def test_the_harness_refuses_a_head_left_on_another_kernel():
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.bfloat16), requires_grad=False)
    layer.cpu_linear = lambda x, w, b: x
    with pytest.raises(RuntimeError, match="plain CPU GEMM"):
        tiny.check_plain_cpu_gemm(layer)
