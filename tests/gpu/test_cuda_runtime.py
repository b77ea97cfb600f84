"""CUDA tests of the runtimes (skipped without a GPU; run on a GPU machine with
``python -m pytest tests/gpu``): the copy way under CUDA-graph capture and replay,
fp32out's kernel and numerics, the Megatron modes' precision on real tensor cores."""

from __future__ import annotations

import pytest
import torch

from bench.lm_head import Model, env_way  # the benchmark's vLLM-shaped stand-ins
from fp32patch.runtime import fp32out, vllm_lm_head
from fp32patch.runtime.lm_head_gemm import lm_head_linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

T, H, V = 256, 1024, 32768


def _inputs(seed=0, t=T, h=H, v=V):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=gen) * (6.0 / h**0.5)).bfloat16()
    return hidden, weight


def _rel(got, hidden, weight):
    ref = hidden.double() @ weight.double().t()
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def test_fp32out_runs_the_out_dtype_kernel_without_a_weight_copy():
    hidden, weight = _inputs()
    assert fp32out.out_dtype_supported(hidden.device, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logits = fp32out.linear(hidden, weight)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - logits.numel() * 4
    assert logits.dtype == torch.float32
    assert extra < weight.numel() * 4 // 100  # no fp32 weight, nor anything of its size
    assert _rel(logits, hidden, weight) < 2e-6
    assert not torch.backends.cuda.matmul.allow_tf32  # an IEEE fp32 GEMM to compare with
    ieee = torch.mm(hidden.float(), weight.float().t())
    assert torch.allclose(logits, ieee, rtol=0, atol=1e-4 * ieee.abs().max().item())


def test_copy_way_under_graph_capture_allocates_no_copy_and_replays_refits(monkeypatch):
    monkeypatch.setenv(vllm_lm_head.ENV, "copy")
    hidden, weight = _inputs(1, v=131072)  # a 512 MiB fp32 copy: impossible to miss
    model = Model(weight.clone())
    static = hidden.clone()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on the capture stream, as vLLM does
        eager = vllm_lm_head.compute_logits(model, static)  # builds the copy, outside capture
    torch.cuda.current_stream().wait_stream(stream)
    copy = model.lm_head._fp32patch_state.copy
    assert copy.builds == 1
    copy_ptr = copy.weight.data_ptr()

    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocated_bytes.all.allocated"]
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        out = vllm_lm_head.compute_logits(model, static)
    torch.cuda.synchronize()
    during = torch.cuda.memory_stats()["allocated_bytes.all.allocated"] - before
    # inside the capture: the logits and the upcast hidden states, no weight copy
    expected = out.numel() * 4 + static.numel() * 4
    assert during <= expected + (1 << 20), (during, expected)
    assert during < copy.weight.numel() * 4 // 2  # the copy (512 MiB) was not made here
    assert copy.builds == 1

    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

    # a refit that bypasses load_weights, then sync(): rebuilt in place, the graph sees it
    _, new = _inputs(2, v=131072)
    model.lm_head.weight.data.copy_(new)
    assert vllm_lm_head.sync(model) == 1
    assert copy.weight.data_ptr() == copy_ptr and copy.builds == 2
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, static, new) < 2e-6

    # load_weights' door (mark_dirty) rebuilds at the next eager call, in place as well
    _, newer = _inputs(3, v=131072)
    model.lm_head.weight.data.copy_(newer)
    vllm_lm_head.mark_dirty(model)
    assert _rel(vllm_lm_head.compute_logits(model, static), static, newer) < 2e-6
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, static, newer) < 2e-6 and copy.weight.data_ptr() == copy_ptr


def test_copy_way_refuses_to_allocate_inside_a_capture(monkeypatch):
    monkeypatch.setenv(vllm_lm_head.ENV, "copy")
    hidden, weight = _inputs(4)
    model = Model(weight)
    vllm_lm_head.compute_logits(model, hidden[:1])  # decides the way, as a warm-up would...
    model.lm_head._fp32patch_state.copy.weight = None  # ...but no copy exists at capture time
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with pytest.raises(RuntimeError, match="inside CUDA-graph capture"):
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            vllm_lm_head.compute_logits(model, hidden)


@pytest.mark.parametrize("way", ["1", "fp32out", "copy"])
def test_vllm_ways_on_the_gpu(way):
    hidden, weight = _inputs(5)
    model = Model(weight)
    with env_way(way):
        logits = vllm_lm_head.compute_logits(model, hidden)
    assert logits.dtype == torch.float32 and _rel(logits, hidden, weight) < 2e-6
    expected = "fp32out" if way in ("1", "fp32out") else "copy"
    assert vllm_lm_head.describe(model)[0]["way"] == expected


def test_megatron_backward_precision_against_tf32_tensor_cores():
    """The precision claims of the fp32out backwards, against real TF32 hardware."""
    hidden, weight = _inputs(6, t=2048, h=1024, v=8192)
    gen = torch.Generator(device="cuda").manual_seed(7)
    grad = torch.softmax(torch.randn(2048, 8192, device="cuda", generator=gen) * 4, dim=-1) / 2048
    dw64 = grad.double().t() @ hidden.double()
    errs = {}
    for mode in ("fp32", "tf32", "fp32out", "fp32out-hilo", "fp32out-bf16grad"):
        x = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device="cuda")
        logits = lm_head_linear(x, w, None, mode, fuse_wgrad=True)
        assert logits.dtype == torch.float32 and _rel(logits.detach(), hidden, weight) < 1e-5
        logits.backward(grad)
        errs[mode] = ((w.main_grad.double() - dw64).norm() / dw64.norm()).item()
    # fp32out rounds grad_output as TF32 does: the same error, up to accumulation order
    assert errs["fp32out"] <= errs["tf32"] * 1.02, errs
    assert errs["fp32out-hilo"] < errs["tf32"] / 8, errs
    assert errs["tf32"] * 4 < errs["fp32out-bf16grad"], errs
    assert errs["fp32"] < 1e-6, errs
