"""FSDP2 (world size 2) and tensor parallelism (TP=2, and sequence parallel) give the
one-process result, on real transformers models over gloo (CPU); and what FSDP2's bf16
gradient leaves of each mode's weight-gradient precision.

The runs are hf_parallel.py's, spawned once for the module; the one-process results are
computed here from what each rank's head saw, single-threaded as the ranks ran, so that the
CPU GEMMs sum in the same order and the results can be compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from hf_harness import MODES, U_BF16, V, rel_norm, spawn, tiny, token_ids
from hf_parallel import FSDP_RUNS, HEAD_UNIT_RUNS, TP_RUNS, fsdp_ids, worker

from fp32patch.runtime.hf_lm_head import apply_fp32_lm_head, fp32_linear
from fp32patch.runtime.lm_head_gemm import lm_head_linear
from tests.support.in_place import TEMPERATURE

WORLD = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("hf-parallel")
    spawn(worker, WORLD, str(out))
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.fixture(autouse=True)
def one_thread():
    """The ranks ran single-threaded; so do the references."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def head_step(mode: str | None, x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor):
    """The head alone, in one process, as the rank's head saw it: logits (as the head
    returned them, under autocast) and the weight gradient in the weight's dtype."""
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
    apply_fp32_lm_head(Holder(head), mode)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(x)
    out.backward(grad)
    return out.detach(), head.weight.grad


class Holder(torch.nn.Module):
    """A model around one head, as apply_fp32_lm_head finds heads."""

    def __init__(self, head: torch.nn.Module) -> None:
        super().__init__()
        self.head = head

    def get_output_embeddings(self):
        return self.head


# ---- FSDP2 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("family", "mode"), FSDP_RUNS)
def test_fsdp2_gives_the_one_process_heads_logits_and_gradients(ranks, family, mode):
    shards = []
    dws = []
    for rank, results in enumerate(ranks):
        run = results[("fsdp", family, mode)]
        # at rest the fp32 master shard, in the forward the unsharded bf16 parameter; the head
        # is handed FSDP2's fp32 output (output_dtype=float32)
        assert run["weight_at_rest"] == ("DTensor", torch.float32)
        assert run["weight"].dtype == torch.bfloat16 and run["weight"].shape == (V, run["x"].shape[-1])
        assert run["x"].dtype == torch.float32
        assert torch.equal(run["ids"], fsdp_ids(rank))
        out, dw = head_step(mode, run["x"], run["weight"], run["grad"])
        assert out.dtype == (torch.bfloat16 if mode is None else torch.float32)
        assert torch.equal(run["out"], out)
        if mode is not None:
            # the cast inside the graph, then lm_head_gemm's GEMM
            assert torch.equal(out, lm_head_linear(run["x"].bfloat16(), run["weight"], None, mode))
        if run["tied"]:  # the embedding's use of the same weight, added by autograd in bf16
            grad = run["embedding_grad"] * run["embedding_scale"]
            dw = dw + torch.ops.aten.embedding_backward(grad, run["ids"], V, run["padding_idx"], False, False)
        dws.append(dw.float())
        shards.append(run["dw_shard"])
        assert run["logits"].dtype == torch.float32  # FSDP2's output cast, or ours before it
    # FSDP2's reduce-scatter in fp32: the mean of the ranks' gradients, each rank its rows
    assert torch.equal(torch.cat(shards), (dws[0] + dws[1]) / 2)


@pytest.mark.parametrize(("family", "mode"), HEAD_UNIT_RUNS)
def test_fsdp2_with_the_head_a_unit_of_its_own_and_logits_scaled_in_place(ranks, family, mode):
    # verl's sharding: the head's backward reads its resharded weight, which only FSDP2's
    # unshard hook on the logits brings back; an in-place scale through a view must not drop it
    dws, shards = [], []
    for results in ranks:
        run = results[("fsdp-head-unit", family, mode)]
        assert run["weight"].dtype == torch.bfloat16
        assert run["logits"].dtype == (torch.bfloat16 if mode is None else torch.float32)
        out, dw = head_step(mode, run["x"], run["weight"], run["grad"])
        assert torch.equal(run["out"], out)
        dws.append(dw.float())
        shards.append(run["dw_shard"])
    assert all(s.isfinite().all() for s in shards)
    assert torch.equal(torch.cat(shards), (dws[0] + dws[1]) / 2)


def fsdp_dw_errors(ranks) -> dict[str, dict[str, float]]:
    """Each mode's weight-gradient error against float64 (the mean over ranks of g^T x over the
    head's own bf16 input and gradient): after FSDP2's bf16 gradient and fp32 reduce-scatter,
    and, for comparison, the fp32 gradient the mode computes before that bf16 rounding."""
    table = {}
    for mode in (None, *MODES):
        runs = [results[("fsdp", "qwen2", mode)] for results in ranks]
        xs = [run["x"].bfloat16().double().reshape(-1, run["x"].shape[-1]) for run in runs]
        gs = [run["grad"].double().reshape(-1, V) for run in runs]
        ref = sum(g.t() @ x for g, x in zip(gs, xs, strict=True)) / len(runs)
        after = torch.cat([run["dw_shard"] for run in runs])
        row = {"after_fsdp2": rel_norm(after, ref)}
        if mode is not None:
            before = []
            for run in runs:
                weight = torch.nn.Parameter(run["weight"].clone())
                weight.main_grad = torch.zeros(weight.shape)
                lm_head_linear(run["x"].bfloat16(), weight, None, mode, fuse_wgrad=True).backward(run["grad"])
                before.append(weight.main_grad)
            row["fp32_before_rounding"] = rel_norm(sum(before) / len(runs), ref)
        table["stock" if mode is None else mode] = row
    return table


def test_fsdp2_bf16_gradient_sets_the_weight_gradients_precision(ranks, capsys):
    table = fsdp_dw_errors(ranks)
    with capsys.disabled():
        print("\nFSDP2 (bf16 params, fp32 reduce-scatter): lm_head dW relative error vs float64")
        for name, row in table.items():
            before = row.get("fp32_before_rounding")
            print(f"  {name:<18} after FSDP2 {row['after_fsdp2']:.3e}   fp32 before bf16 {before or float('nan'):.3e}")
    floor = table["fp32"]["after_fsdp2"]  # an exact fp32 gradient, rounded to bf16 once
    # every mode ends at the bf16 rounding of the gradient: the mode's own precision hides
    # below it (fp32out's TF32-grade 11 bits, the hi/lo split's 16) ...
    for mode in ("tf32", "fp32out", "fp32out-hilo"):
        assert table[mode]["fp32_before_rounding"] * 4 < floor
        assert table[mode]["after_fsdp2"] <= floor * 1.02
    # ... except fp32out-bf16grad's, whose bf16 grad_output adds an error of the same size
    assert table["fp32out-bf16grad"]["fp32_before_rounding"] > floor / 4
    assert table["fp32out-bf16grad"]["after_fsdp2"] > floor * 1.1


# ---- tensor parallel ------------------------------------------------------------------------------


def one_process_tp(plan: str, mode: str | None) -> dict:
    """The same step as hf_parallel.tp_run, without tensor parallelism."""
    model = tiny("llama" if plan == "tied_shard1" else "qwen2")
    apply_fp32_lm_head(model, mode)
    ids = token_ids(batch=1, seed=30)
    logits = model(ids).logits.div_(TEMPERATURE)
    grad = torch.randn(logits.shape, generator=torch.Generator().manual_seed(31))
    logits.backward(grad)
    return {"logits": logits.detach(), "grads": {n: p.grad for n, p in model.named_parameters()}}


# what the stock head returns under each plan: the fp32 head returns the same kind of tensor
STOCK_KIND = {
    "colwise": ("DTensor", ("S(2)",)),
    "sequence_parallel": ("DTensor", ("S(2)",)),
    "replicated_output": ("Tensor", ()),
    "tied_shard1": ("DTensor", ("S(2)",)),
}


@pytest.mark.parametrize(("plan", "mode"), TP_RUNS)
def test_tp2_gives_the_one_process_result(ranks, plan, mode):
    one = one_process_tp(plan, mode)
    for results in ranks:
        run = results[("tp", plan, mode)]
        name, dtype, placements = run["kind"]
        assert (name, placements) == STOCK_KIND[plan]
        assert dtype == (torch.bfloat16 if mode is None else torch.float32)
        # the temperature in place: on the DTensor logits as on plain ones; a plan that returns
        # plain tensors hands over torch's to_local() view, stock head or not
        stock_in_place = results[("tp", plan, None)]["in_place"]
        assert run["in_place"] == stock_in_place
        assert stock_in_place == ("Output 0 of _ToTorchTensor" if plan == "replicated_output" else "ok")
        # the logits: the same to their own rounding (the local GEMMs of a shard may sum in
        # another order than the whole one; the tied head's partial sums are reduced in fp32,
        # the stock head's in bf16)
        rounding = 2 * U_BF16 if mode is None else 2.0**-20
        assert (run["logits"] - one["logits"]).abs().max() <= rounding * one["logits"].abs().max()
        # the gradients: as close as the stock head's are (under tensor parallelism the head's
        # input gradient is a sum of the shards' bf16 partial sums, which the network before
        # it carries on), the head's own to bf16 rounding
        assert run["grads"].keys() == one["grads"].keys()
        stock_run, stock_one = results[("tp", plan, None)], one_process_tp(plan, None)
        for key, got in run["grads"].items():
            deviation = rel_norm(got, one["grads"][key].double())
            stock_deviation = rel_norm(stock_run["grads"][key], stock_one["grads"][key].double())
            assert deviation <= max(2 * stock_deviation, U_BF16), (key, deviation, stock_deviation)
        head = "lm_head.weight" if "lm_head.weight" in run["grads"] else "model.embed_tokens.weight"
        assert rel_norm(run["grads"][head], one["grads"][head].double()) < (
            U_BF16 if head == "lm_head.weight" else 2**-5
        )


def test_the_tied_head_is_hidden_sharded_and_its_gradient_carries_both_uses(ranks):
    # the embedding plan shards the shared weight on its hidden dimension; the fp32 head's
    # partial sums are reduced in fp32, the gradient of the one weight has both uses
    run = ranks[0][("tp", "tied_shard1", "fp32out")]
    one = one_process_tp("tied_shard1", "fp32out")
    assert "lm_head.weight" not in run["grads"]  # one parameter, listed once
    shared = "model.embed_tokens.weight"
    assert rel_norm(run["grads"][shared], one["grads"][shared].double()) < U_BF16
    stock = ranks[0][("tp", "tied_shard1", None)]
    assert rel_norm(run["logits"], stock["logits"].double()) < U_BF16  # the same model


def test_unsupported_dtensor_layouts_are_refused_at_the_call():
    # a replicated weight, or an input the plan did not replicate: refused, never guessed
    from hf_harness import init_gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from fp32patch.runtime.hf_lm_head import UnsupportedLmHeadError
    from tests.support.rendezvous import file_store

    with file_store() as init_method:
        init_gloo(0, 1, init_method)
        try:
            mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
            w = torch.randn(V, 8).bfloat16()
            x = torch.randn(2, 8).bfloat16()
            replicated = DTensor.from_local(w, mesh, [Replicate()])
            with pytest.raises(UnsupportedLmHeadError, match=r"weight placed Replicate\(\) is not supported"):
                fp32_linear(DTensor.from_local(x, mesh, [Replicate()]), replicated, None, "fp32out")
            sharded = DTensor.from_local(w, mesh, [Shard(0)])
            with pytest.raises(UnsupportedLmHeadError, match=r"the input is a DTensor \(Shard\(dim=0\),\)"):
                fp32_linear(DTensor.from_local(x, mesh, [Shard(0)]), sharded, None, "fp32out")
            with pytest.raises(UnsupportedLmHeadError, match="the input is a plain tensor"):
                fp32_linear(x, sharded, None, "fp32out")
            bias = DTensor.from_local(torch.zeros(V).bfloat16(), mesh, [Replicate()])
            with pytest.raises(UnsupportedLmHeadError, match=r"Shard\(dim=1\) with a bias"):
                fp32_linear(
                    DTensor.from_local(x, mesh, [Replicate()]), DTensor.from_local(w, mesh, [Shard(1)]), bias, "fp32out"
                )
            with pytest.raises(
                UnsupportedLmHeadError, match="the input is a DTensor .* but the weight is a plain tensor"
            ):
                fp32_linear(DTensor.from_local(x, mesh, [Replicate()]), w, None, "fp32out")
        finally:
            torch.distributed.destroy_process_group()
