"""AReaL's Megatron side from its one key, on a real megatron-core GPTModel (CPU, gloo, TP=1).

AReaL 1.0.4's own files, from its wheel (cached under $FP32PATCH_TEST_CACHE): ``megatron_engine.py``
patched by the spec (``fp32patch``'s transform, as ``apply`` writes it), whose gate
``_fp32patch_wire_megatron`` runs where ``MegatronEngine.initialize`` calls it, on an engine that
holds the model chunks as ``make_mcore_model`` returns them (a GPTModel in megatron-core's
Float16Module) and AReaL's config shape (``megatron.enable_fp32_lm_head``); and AReaL's own log-prob
code, ``areal/utils/functional/vocab_parallel.py``'s ``gather_logprobs_entropy`` (its one import
from AReaL, ``areal.infra.platforms.is_npu_available``, stood in: False). One step: a packed
batch-1 micro-batch (three samples in one row, block-diagonal attention, positions restarting),
AReaL's labels (``torch.roll(input_ids, -1)``), log-probs and entropy at the temperature, a
policy-gradient loss with an entropy bonus, backward.

- key on: the log-probs and entropy are within 1e-4 (here 2e-5) of the float64 ones of the step's
  own hidden states and output weight, where the stock step's miss them by more; the weight
  gradient is fp32out's; the logits scaled in place (``logits.div_(T)``) give the same step;
- key off: the patched file's gate leaves the model alone and imports nothing of fp32patch; the
  step is the stock one's bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from megatron_harness import S, V, config, gpt_model, no_rng_fork
from nemo_rl_fused import PACKED_LENGTHS

from fp32patch.runtime.heads.megatron import fp32_lm_head_mode
from tests.support.areal import engine_files, load_vocab_parallel
from tests.support.lifecycle import gate_namespace

ENGINE = "areal/engine/megatron_engine.py"
TEMPERATURE = 0.7
ENTROPY_COEF = 0.01
BOUND = 2e-5  # |Δ| against float64 of fp32-rounded logits below 10 in magnitude, over 128 entries


@pytest.fixture(scope="module")
def areal_files() -> dict[str, bytes]:
    return engine_files(ENGINE)


@pytest.fixture(scope="module")
def vocab_parallel(areal_files, tmp_path_factory):
    """AReaL 1.0.4's own log-prob module, imported from its wheel's file."""
    return load_vocab_parallel(areal_files["vocab"], tmp_path_factory.mktemp("areal"))


def engine(on: bool) -> SimpleNamespace:
    """An AReaL MegatronEngine as the gate sees it: its config and the chunks make_mcore_model built."""
    from megatron.core.transformer.module import Float16Module

    cfg = config(hidden_dropout=0.0, attention_dropout=0.0)
    chunk = Float16Module(cfg, gpt_model(cfg))
    megatron = SimpleNamespace(enable_fp32_lm_head=on, enable_chunked_logits=False)
    engine_config = SimpleNamespace(
        megatron=megatron,
        fsdp=SimpleNamespace(enable_fp32_lm_head=False),
        archon=SimpleNamespace(enable_fp32_lm_head=False),
        is_critic=False,
        experiment_name="areal-step",
        trial_name="t0",
    )
    return SimpleNamespace(config=engine_config, model=[chunk])


def batch() -> dict:
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(7))
    positions = torch.cat([torch.arange(n) for n in PACKED_LENGTHS]).unsqueeze(0)
    blocks = torch.block_diag(*[torch.ones(n, n, dtype=torch.bool) for n in PACKED_LENGTHS])
    mask = ~(blocks & torch.ones(S, S, dtype=torch.bool).tril())
    last = torch.cat([torch.arange(n) == n - 1 for n in PACKED_LENGTHS])
    advantages = torch.linspace(-1.0, 1.0, S).masked_fill(last, 0.0)
    return {"ids": ids, "positions": positions, "mask": mask[None, None], "advantages": advantages}


def step(eng: SimpleNamespace, vocab_parallel, *, in_place: bool = False, tp_group=None) -> dict:
    """One AReaL step: the model's logits, AReaL's labels and log-prob code, loss, backward."""
    model = eng.model[0]
    gpt = model.module
    seen: dict = {}
    gpt.decoder.register_forward_hook(lambda module, args, out: seen.__setitem__("hidden", out.detach()))
    data = batch()
    with no_rng_fork():
        logits = model(data["ids"], data["positions"], data["mask"]).squeeze(0)  # [s, v]
    labels = torch.roll(data["ids"], shifts=-1, dims=-1).squeeze(0)
    temperature = TEMPERATURE
    if in_place:
        logits.div_(TEMPERATURE)  # a trainer scaling the logits in place
        temperature = 1.0
    logp, entropy = vocab_parallel.gather_logprobs_entropy(logits, labels, temperature=temperature, tp_group=tp_group)
    loss = -(data["advantages"] * logp).mean() - ENTROPY_COEF * entropy.mean()
    loss.backward()
    weight = gpt.output_layer.weight
    grad = getattr(weight, "main_grad", None)
    return {
        "logits_dtype": logits.dtype,
        "log_probs": logp.detach(),
        "entropy": entropy.detach(),
        "hidden": seen["hidden"].squeeze(1).double(),
        "weight": weight.detach().double(),
        "weight_grad": (grad if grad is not None else weight.grad).detach().double(),
        "grads": {n: p.grad.clone() for n, p in gpt.named_parameters() if p.grad is not None},
        "mode": fp32_lm_head_mode(gpt.output_layer),
        "ids": data["ids"].squeeze(0),
        "advantages": data["advantages"],
    }


def reference(record: dict) -> dict:
    """float64 log-probs, entropy and weight gradient of the step's own hidden states and weight."""
    weight = record["weight"].clone().requires_grad_()
    logits = record["hidden"] @ weight.t() / TEMPERATURE
    logp_all = torch.log_softmax(logits, dim=-1)
    labels = torch.roll(record["ids"], -1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    loss = -(record["advantages"].double() * logp).mean() - ENTROPY_COEF * entropy.mean()
    (grad,) = torch.autograd.grad(loss, weight)
    return {"log_probs": logp.detach(), "entropy": entropy.detach(), "weight_grad": grad}


def _gate(source: bytes):
    namespace, imported = gate_namespace(source)
    return namespace["_fp32patch_wire_megatron"], imported


def test_the_key_on_gives_fp32_grade_log_probs_and_entropy(tp1, areal_files, vocab_parallel):
    wire, _ = _gate(areal_files["patched"])
    on = engine(True)
    wire(on)
    record = step(on, vocab_parallel)
    assert record["logits_dtype"] == torch.float32 and record["mode"] == "fp32out"
    ref = reference(record)
    for name in ("log_probs", "entropy"):
        err = (record[name].double() - ref[name]).abs().max().item()
        assert err < BOUND, (name, err)
    # the stock step misses float64 by bf16's rounding of the logits
    stock = step(engine(False), vocab_parallel)
    stock_ref = reference(stock)
    assert (stock["log_probs"].double() - stock_ref["log_probs"]).abs().max().item() > 5 * BOUND
    # the weight gradient (bf16, as the stock head gives it without DDP's main_grad): within bf16's
    # rounding of float64's, as a whole (fp32out's grad_output, TF32's 11 bits, is inside that)
    grad, want = record["weight_grad"], ref["weight_grad"]
    assert (grad - want).norm() / want.norm() < 2.0**-8


def test_logits_scaled_in_place_give_the_same_step(tp1, areal_files, vocab_parallel):
    wire, _ = _gate(areal_files["patched"])
    first, second = engine(True), engine(True)
    wire(first)
    wire(second)
    divided = step(first, vocab_parallel)
    in_place = step(second, vocab_parallel, in_place=True)
    for name in ("log_probs", "entropy"):
        assert torch.allclose(in_place[name], divided[name], rtol=0, atol=2e-5), name
    assert in_place["grads"].keys() == divided["grads"].keys()
    for name, grad in in_place["grads"].items():
        assert torch.allclose(grad.float(), divided["grads"][name].float(), rtol=1e-3, atol=1e-5), name


def test_the_key_off_is_the_stock_step_bit_for_bit(tp1, areal_files, vocab_parallel):
    wire, imported = _gate(areal_files["patched"])
    off = engine(False)
    wire(off)
    assert not [m for m in imported if m.startswith("fp32patch")], imported
    patched, stock = step(off, vocab_parallel), step(engine(False), vocab_parallel)
    assert patched["mode"] is None
    for name in ("log_probs", "entropy"):
        assert torch.equal(patched[name], stock[name]), name
    assert patched["grads"].keys() == stock["grads"].keys()
    for name, grad in patched["grads"].items():
        assert torch.equal(grad, stock["grads"][name]), name
    assert b"_fp32patch_wire_megatron" not in areal_files["stock"]


# ---------------------------------------------------------------- tensor parallel size 2


def _tp2_worker(rank: int, world: int, init_method: str, out_dir: str, patched: bytes, vocab: bytes) -> None:
    """One rank of a TP=2 AReaL step, key on and off: the vocabulary-parallel logits [s, V/2],
    AReaL's own vocab-parallel log-probs over the tensor-parallel group; each rank's errors against
    float64 of the step's hidden states and the whole output weight (gathered from both ranks)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron_harness import close_parallel, init_parallel

    torch.set_num_threads(1)
    init_parallel(rank, world, init_method)
    try:
        module = load_vocab_parallel(vocab, Path(out_dir))
        wire, _ = _gate(patched)
        group = parallel_state.get_tensor_model_parallel_group()
        results = {}
        for on in (True, False):
            eng = engine(on)
            wire(eng)
            record = step(eng, module, tp_group=group)
            shards = [torch.empty_like(record["weight"]) for _ in range(world)]
            dist.all_gather(shards, record["weight"].contiguous(), group=group)
            whole = dict(record, weight=torch.cat(shards))
            ref = reference(whole)
            results[on] = {
                "logits_dtype": record["logits_dtype"],
                "mode": record["mode"],
                "shard_rows": record["weight"].shape[0],
                "log_probs": record["log_probs"],
                "errors": {n: (record[n].double() - ref[n]).abs().max().item() for n in ("log_probs", "entropy")},
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        close_parallel()  # the model-parallel groups and the process group


def test_tp2_the_key_on_gives_fp32_grade_log_probs_through_areals_vocab_parallel_path(areal_files, tmp_path):
    import torch.multiprocessing as mp

    from tests.support.rendezvous import file_store

    with file_store() as init_method:
        args = (2, init_method, str(tmp_path), areal_files["patched"], areal_files["vocab"])
        mp.spawn(_tp2_worker, args=args, nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for results in ranks:
        on, off = results[True], results[False]
        assert on["shard_rows"] == V // 2  # each rank held half the vocabulary
        assert on["logits_dtype"] == torch.float32 and on["mode"] == "fp32out"
        assert off["mode"] is None  # (Float16Module hands the bf16 GEMM's logits on as fp32: bf16-rounded)
        for name, err in on["errors"].items():
            assert err < BOUND, (name, err)
        # off: the stock vocab-parallel step misses float64 by bf16's rounding of the logits
        assert off["errors"]["log_probs"] > 5 * BOUND, off["errors"]
    # the group's reductions give both ranks every token's log-prob, the same on each
    assert torch.equal(ranks[0][True]["log_probs"], ranks[1][True]["log_probs"])
