"""TP=2 over NCCL with a real megatron-core ColumnParallelLinear on two GPUs: each fp32
mode gives the same logits and gradients as one GPU. Skipped with fewer than two GPUs
or without megatron-core."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")

S, B, H, V = 64, 2, 256, 1024


def _problem():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(S, B, H, generator=gen).bfloat16()
    w = (torch.randn(V, H, generator=gen) * 0.1).bfloat16()
    g = torch.randn(S, B, V, generator=gen) / (S * B)
    return x, w, g


def _worker(rank, world, init_method, mode, sequence_parallel, results):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fp32patch.runtime.megatron_lm_head import apply_fp32_lm_head

    torch.cuda.set_device(rank)
    # a file store (tests/support/rendezvous.py): no port for another process to take first
    dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(1234)
    try:
        cfg = TransformerConfig(
            num_layers=1,
            hidden_size=H,
            num_attention_heads=4,
            bf16=True,
            params_dtype=torch.bfloat16,
            tensor_model_parallel_size=world,
            sequence_parallel=sequence_parallel,
        )
        layer = ColumnParallelLinear(
            H,
            V,
            config=cfg,
            init_method=lambda t: None,
            bias=False,
            gather_output=not sequence_parallel,
            skip_bias_add=False,
        ).cuda()
        x, w, g = _problem()
        part = V // world
        with torch.no_grad():
            layer.weight.copy_(w[rank * part : (rank + 1) * part].cuda())

        class Chunk(torch.nn.Module):
            post_process = True

            def __init__(self):
                super().__init__()
                self.output_layer = layer

        apply_fp32_lm_head(Chunk(), mode)
        xin = x.cuda()
        if sequence_parallel:
            xin = xin[rank * (S // world) : (rank + 1) * (S // world)]
        xin = xin.clone().requires_grad_(True)
        logits, _ = layer(xin)
        grad = g.cuda()
        if sequence_parallel:  # gather_output=False: this rank holds its vocabulary columns
            grad = grad[..., rank * part : (rank + 1) * part]
        logits.backward(grad.contiguous())
        results[rank] = {
            "logits": logits.detach().float().cpu(),
            "dx": xin.grad.float().cpu(),
            "dw": layer.weight.grad.float().cpu(),
        }
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["gather-output", "sequence-parallel"])
@pytest.mark.parametrize("mode", ["fp32", "tf32", "fp32out", "fp32out-hilo", "fp32out-bf16grad"])
def test_tp2_matches_one_gpu(mode, sequence_parallel):
    pytest.importorskip("megatron.core")
    import torch.multiprocessing as mp

    from fp32patch.runtime.lm_head_gemm import lm_head_linear
    from tests.support.rendezvous import file_store

    manager = mp.Manager()
    results = manager.dict()
    with file_store() as init_method:
        mp.spawn(_worker, args=(2, init_method, mode, sequence_parallel, results), nprocs=2, join=True)

    x, w, g = _problem()
    xr = x.cuda().requires_grad_(True)
    wr = w.cuda().requires_grad_(True)
    ref = lm_head_linear(xr, wr, None, mode)
    ref.backward(g.cuda())
    ref, dx, dw = ref.detach().cpu(), xr.grad.float().cpu(), wr.grad.float().cpu()
    tol = dict(rtol=0, atol=1e-3 if mode == "tf32" else 1e-5)
    if sequence_parallel:
        # each rank: every sequence row (gathered in), its own vocabulary columns out;
        # its input gradient is its own sequence rows (reduce-scattered back)
        logits = torch.cat([results[r]["logits"] for r in (0, 1)], dim=-1)
        got_dx = torch.cat([results[r]["dx"] for r in (0, 1)], dim=0)
    else:
        logits = results[0]["logits"]
        assert torch.equal(results[0]["logits"], results[1]["logits"])
        got_dx = results[0]["dx"]
    torch.testing.assert_close(logits, ref, **tol)
    # Megatron all-reduces (or reduce-scatters) the input gradient in the input's dtype:
    # each rank's part is rounded to bf16 before the sum, a rounding one GPU does not do
    torch.testing.assert_close(got_dx, dx, rtol=2.0**-7, atol=2.0**-8 * dx.abs().max().item())
    got_dw = torch.cat([results[r]["dw"] for r in (0, 1)], dim=0)
    torch.testing.assert_close(got_dw, dw, rtol=0, atol=2e-2 * dw.abs().max().item())
