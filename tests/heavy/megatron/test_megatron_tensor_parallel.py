"""Tensor parallel size 2 (two gloo processes) gives the logits and gradients of size 1.

Each scenario converts a real ColumnParallelLinear and runs one forward and backward on
both ranks; the same scenario runs here at TP=1. Logits and weight gradients must agree
to fp32 rounding. Input gradients are summed across ranks in bf16 by Megatron's own
all-reduce (or reduce-scatter under sequence parallelism), so they agree to the rounding
of that sum: the bound adds half a bf16 ulp of each rank's partial sum.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from megatron_harness import (
    DX_SLACK,
    GRAD_SLACK,
    IN_PLACE_VARIANTS,
    MODES,
    U_BF16,
    VARIANTS,
    B,
    V,
    assert_within,
    problem,
    run_scenario,
    seq_shard,
    tp_worker,
    vocab_shard,
)

from tests.support.in_place import assert_same_bits
from tests.support.rendezvous import file_store

WORLD = 2


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> list[dict]:
    """Every scenario's results from each of the two ranks."""
    out = tmp_path_factory.mktemp("tp2")
    with file_store() as init_method:
        mp.spawn(tp_worker, args=(WORLD, init_method, str(out)), nprocs=WORLD, join=True)
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_tp2_matches_tp1(tp1, tp2, variant: str, mode: str):
    p = problem()
    ref_logits, ref_dx, ref_dw = p.logits64(), p.dx64(), p.dw64()
    x64, w64, g64 = p.x.double().abs(), p.weight.double().abs(), p.grad.double().abs()
    logits_mag = x64 @ w64.t()
    dx_mag = g64 @ w64
    dw_mag = g64.reshape(-1, V).t() @ x64.reshape(-1, x64.shape[-1])
    slack = GRAD_SLACK[mode]
    fused = variant == "ddp_fused"

    one = run_scenario(variant, mode, rank=0, world=1)
    for rank, results in enumerate(tp2):
        two = results[(variant, mode)]
        vocab = vocab_shard(rank, WORLD)

        gathered = two["logits"].shape[-1] == V
        assert two["logits"].dtype == torch.float32
        want = one["logits"] if gathered else one["logits"][..., vocab]
        torch.testing.assert_close(two["logits"], want, rtol=1e-6, atol=1e-6)
        assert_within(
            two["logits"],
            ref_logits if gathered else ref_logits[..., vocab],
            logits_mag if gathered else logits_mag[..., vocab],
            terms=p.x.shape[-1],
        )

        # Each rank's weight gradient is its rows of the TP=1 one.
        assert two["dw"].dtype == one["dw"].dtype
        torch.testing.assert_close(two["dw"], one["dw"][vocab], rtol=U_BF16, atol=1e-6)
        assert_within(
            two["dw"],
            ref_dw[vocab],
            dw_mag[vocab],
            terms=p.x.shape[0] * p.x.shape[1],
            slack=slack,
            rounded_to_bf16=not fused,
        )

        # The input gradient: all-reduced (or reduce-scattered) partial sums per shard.
        partials = sum(
            (p.grad.double()[..., vocab_shard(r, WORLD)] @ p.weight.double()[vocab_shard(r, WORLD)]).abs()
            for r in range(WORLD)
        )
        rows = seq_shard(rank, WORLD) if variant == "sequence_parallel" else slice(None)
        assert two["dx"].shape == one["dx"][rows].shape
        assert_within(
            two["dx"],
            ref_dx[rows],
            dx_mag[rows],
            terms=V,
            slack=DX_SLACK[mode],
            rounded_to_bf16=True,
            extra=U_BF16 * partials[rows],
        )


@pytest.mark.parametrize("batch", [1, B])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", IN_PLACE_VARIANTS)
def test_tp2_logits_divided_in_place_give_the_out_of_place_gradients(tp2, variant: str, mode: str, batch: int):
    # the temperature scaling of a trainer, after GPTModel's transpose/contiguous, on each rank
    for results in tp2:
        got = results[("in-place", variant, mode, batch, True)]
        expected = results[("in-place", variant, mode, batch, False)]
        assert got.keys() == expected.keys()
        assert_same_bits(tuple(got.values()), tuple(expected.values()))
