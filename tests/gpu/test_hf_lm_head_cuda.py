"""CUDA tests of the PyTorch/HF head (``hf_lm_head``; skipped without a GPU; run with
``python -m pytest tests/gpu``): the bf16 x bf16 -> fp32 kernel with no weight copy, bf16
autocast around it, the route followed when the weight moves between CPU and GPU (offload),
CUDA-graph capture and replay, and an in-place temperature under autograd."""

from __future__ import annotations

import pytest
import torch

from fp32patch.runtime import fp32out
from fp32patch.runtime.hf_lm_head import apply_fp32_lm_head

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

T, H, V = 512, 1024, 32768


class CausalLM(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
        self.lm_head.to(weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)

    def get_output_embeddings(self):
        return self.lm_head


def _inputs(seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(V, H, device="cuda", generator=gen) * (6.0 / H**0.5)).bfloat16()
    return hidden, weight


# fp32 logits: within 1e-5 of float64 over the head's own bf16 inputs, relative to the largest
# logit (fp32 accumulation over H; the TF32 GEMM's order of summation reads 2.3e-6 on an H200)
FP32_LOGITS = 1e-5


def _rel(got, hidden, weight):
    ref = hidden.double() @ weight.double().t()
    return ((got.double() - ref).abs().max() / ref.abs().max()).item()


def test_bf16_operands_go_to_the_out_dtype_kernel_with_no_weight_copy():
    hidden, weight = _inputs()
    model = apply_fp32_lm_head(CausalLM(weight), "fp32out")
    assert fp32out.out_dtype_supported(hidden.device, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    logits = model.lm_head(hidden)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - logits.numel() * 4
    assert extra < weight.numel() * 4 // 100  # no fp32 weight, nor anything of its size
    assert torch.equal(logits, torch.mm(hidden, model.lm_head.weight.t(), out_dtype=torch.float32))
    assert _rel(logits, hidden, weight) < FP32_LOGITS
    del logits
    assert torch.cuda.memory_allocated() == base  # nothing kept between calls


@pytest.mark.parametrize("mode", ["fp32out", "fp32out-bf16grad", "tf32", "fp32"])
def test_autocast_and_an_fp32_input_still_give_the_modes_fp32_gemm(mode):
    # NeMo-RL: bf16 autocast around the forward, FSDP2 handing the head fp32 hidden states
    hidden, weight = _inputs(1)
    model = apply_fp32_lm_head(CausalLM(weight), mode)
    plain = model.lm_head(hidden)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        under_autocast = model.lm_head(hidden.float())
    assert under_autocast.dtype == torch.float32 and torch.equal(under_autocast, plain)
    assert _rel(plain, hidden, weight) < FP32_LOGITS


def test_the_route_follows_the_weight_between_cpu_and_gpu():
    # CPU offload: the GEMM is chosen per call from the live tensors' device
    hidden, weight = _inputs(2)
    model = apply_fp32_lm_head(CausalLM(weight), "fp32out")
    on_gpu = model.lm_head(hidden)
    model.cpu()
    on_cpu = model.lm_head(hidden.cpu())
    model.cuda()
    again = model.lm_head(hidden)
    assert on_cpu.device.type == "cpu" and on_cpu.dtype == torch.float32
    assert torch.equal(again, on_gpu)
    assert _rel(on_cpu, hidden.cpu(), weight.cpu()) < FP32_LOGITS


def test_cuda_graph_capture_and_replay_follow_the_live_weight():
    hidden, weight = _inputs(3)
    model = apply_fp32_lm_head(CausalLM(weight), "fp32out")
    static = hidden.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        model.lm_head(static)  # warm-up: the out_dtype probe runs outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = model.lm_head(static)
    new_hidden, new_weight = _inputs(4)
    static.copy_(new_hidden)
    with torch.no_grad():
        model.lm_head.weight.copy_(new_weight)  # a refit in place
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.mm(new_hidden, new_weight.t(), out_dtype=torch.float32))


@pytest.mark.parametrize("mode", ["fp32out", "fp32out-bf16grad"])
def test_logits_divided_in_place_train_as_out_of_place(mode):
    hidden, weight = _inputs(5)
    grad = torch.randn(1, T, V, device="cuda", generator=torch.Generator(device="cuda").manual_seed(6))

    def step(in_place: bool):
        model = apply_fp32_lm_head(CausalLM(weight), mode)
        x = hidden.float().reshape(1, T, H).requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model.lm_head(x)
        logits = logits.div_(0.7) if in_place else logits / 0.7
        logits.backward(grad)
        return x.grad, model.lm_head.weight.grad

    for got, expected in zip(step(True), step(False), strict=True):
        assert torch.equal(got, expected)


def test_an_fp32_master_weight_under_bf16_autocast_uses_the_out_dtype_kernel_on_its_bf16_copy():
    """fp32 weights without FSDP under a trainer's bf16 autocast (verl's dp_actor): the head
    computes from the weight's bf16 copy (what the stock head under that autocast computes
    from) with the bf16 x bf16 -> fp32 kernel, and the gradient reaches the fp32 weight."""
    hidden, weight = _inputs(3)
    model = apply_fp32_lm_head(CausalLM(weight.float()), "fp32out")
    assert model.lm_head.weight.dtype == torch.float32
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model.lm_head(hidden.float())
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.mm(hidden, weight.t(), out_dtype=torch.float32))
    assert _rel(logits, hidden, weight) < FP32_LOGITS
    logits.sum().backward()
    assert model.lm_head.weight.grad.dtype == torch.float32
    assert torch.isfinite(model.lm_head.weight.grad).all()
