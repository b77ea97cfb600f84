"""CUDA tests of SGLang's patched fp32 LM head (skipped without a GPU; ``python -m pytest
tests/gpu``). SGLang is not installed on the GPU machine: the head is the code the patch
inserts into SGLang 0.5.3-0.5.17's ``LogitsProcessor`` (``snippets/sglang_gate.py``, run as it is)
and the runtime function it calls; SGLang's own two products are written as its formulas."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import fp32patch
from fp32patch.runtime.heads import sglang as head

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GATE = Path(fp32patch.__file__).parent / "patches" / "snippets" / "sglang_gate.py"
T, H, V = 256, 2048, 65536
DEVICE = "cuda"  # tests/test_bench_sglang_head.py runs the device-free tests here on the CPU as a smoke run


def _patched_head():
    """``_fp32patch_sglang_fp32_logits`` as the patched logits_processor.py defines it."""
    namespace: dict = {}
    exec(compile(GATE.read_text(), str(GATE), "exec"), namespace)  # noqa: S102
    return namespace["_fp32patch_sglang_fp32_logits"]


def _inputs(seed=0, t=T, h=H, v=V, dtype=torch.bfloat16):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(t, h, device=DEVICE, generator=gen).to(dtype)
    weight = (torch.randn(v, h, device=DEVICE, generator=gen) * (6.0 / h**0.5)).to(dtype)
    return hidden, weight


def _sglang_upcast(hidden, weight):
    """SGLang 0.5.3-0.5.17's flag: LogitsProcessor's torch.matmul of both operands cast to fp32."""
    return torch.matmul(hidden.to(torch.float32), weight.to(torch.float32).T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_patched_head_is_fp32out_without_a_weight_copy(dtype):
    fp32_logits = _patched_head()
    hidden, weight = _inputs(dtype=dtype)
    assert head.way(hidden, weight) == "fp32out"
    fp32_logits(hidden, weight)  # the out_dtype probe, once per (device, dtype), as SGLang's warm-up does
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logits = fp32_logits(hidden, weight)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - logits.numel() * 4
    assert logits.dtype == torch.float32 and logits.shape == (T, V)
    assert extra < weight.numel() * 4 // 100  # no fp32 weight, nor anything of its size
    # SGLang 0.5.18+'s own product, bit for bit
    assert torch.equal(logits, torch.mm(hidden, weight.T, out_dtype=torch.float32))
    # fp32 grade: an fp32 accumulator's error, as SGLang's own IEEE fp32 upcast has it (the H200
    # gave 3e-5 against logits of 33 for both), and far below bf16 logits' rounding
    ref = hidden.double() @ weight.double().T
    error = (logits.double() - ref).abs().max().item()
    upcast_error = (_sglang_upcast(hidden, weight).double() - ref).abs().max().item()
    half_error = (torch.mm(hidden, weight.T).double() - ref).abs().max().item()  # bf16 or fp16 logits
    assert error <= 4 * upcast_error and error * 100 < half_error, (error, upcast_error, half_error)
    # the stock flag's upcast, for comparison: it allocates the fp32 weight
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    stock = _sglang_upcast(hidden, weight)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - base - stock.numel() * 4 >= weight.numel() * 4
    assert torch.allclose(logits, stock, rtol=0, atol=1e-4 * stock.abs().max().item())


def test_mixed_or_fp32_operands_keep_sglangs_upcast():
    fp32_logits = _patched_head()
    hidden, weight = _inputs(1, t=64, v=4096)
    for h, w in ((hidden.float(), weight), (hidden.float(), weight.float())):
        assert head.way(h, w) == "upcast"
        assert torch.equal(fp32_logits(h, w), _sglang_upcast(h, w))


def test_without_fp32patch_the_patched_file_is_sglangs_upcast(monkeypatch):
    fp32_logits = _patched_head()
    hidden, weight = _inputs(2, t=64, v=4096)
    monkeypatch.setitem(sys.modules, "fp32patch.runtime.heads.sglang", None)
    assert torch.equal(fp32_logits(hidden, weight), _sglang_upcast(hidden, weight))


def test_cuda_graph_capture_after_warmup_replays_fp32out_and_sees_a_refit():
    """SGLang captures decode in CUDA graphs after two eager warm-up runs: the captured head is
    fp32out, allocates no fp32 weight in the graph's pool, and a weight refit in place is read by
    the next replay (nothing cached)."""
    fp32_logits = _patched_head()
    hidden, weight = _inputs(3, t=64, v=V)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fp32_logits(hidden, weight)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    with torch.cuda.graph(graph):
        out = fp32_logits(hidden, weight)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < weight.numel() * 4 // 4  # the logits, no fp32 weight
    graph.replay()
    assert torch.equal(out, torch.mm(hidden, weight.T, out_dtype=torch.float32))
    weight.copy_(_inputs(4, t=64, v=V)[1])  # a refit, in place
    graph.replay()
    assert torch.equal(out, torch.mm(hidden, weight.T, out_dtype=torch.float32))
