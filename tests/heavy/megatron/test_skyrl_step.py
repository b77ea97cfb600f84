"""SkyRL 0.4.0's Megatron backend from its one field, through its own ``MegatronModelWrapper`` on a
real megatron-core GPTModel (CPU, gloo, TP=1 and 2; skyrl_step.py says what runs and what stands in
for CUDA, Transformer Engine and Megatron Bridge).

SkyRL as the environment installs it (stock), and a copy patched by ``fp32patch apply``: the old
log-probs (``forward``) and one training step (``forward_backward_mini_batch``: SkyRL packs the
micro-batch into one row, divides the logits by the temperature in place, takes log-probs and
entropy with its own vocab-parallel code, its PPO loss with an entropy bonus, backward):

- ``trainer.fp32_lm_head`` not set: the patched tree gives stock's log-probs, entropy, loss and
  every gradient bit for bit, and never imports fp32patch;
- ``trainer.fp32_lm_head=fp32out``: the output layer is wired at the wrapper's construction; the
  log-probs (of both calls) and the entropy are within fp32 rounding of float64's from the very
  operands, the output weight's gradient within fp32out's grade (5e-4 of its largest entry), where
  stock's log-probs are bf16-rounded and its weight gradient five times and more further off;
  SkyRL's ``logprobs_chunk_size`` changes nothing;
- the same with SkyRL's fused LM-head path (``trainer.fused_lm_head_logprob``, which never calls the
  output layer and divides the bf16 weight by the temperature): off, stock's bit for bit; on,
  fp32patch's chunked piece computes its log-probs and entropy at the same grade, the temperature
  dividing fp32 logits.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from skyrl_step import reference, run, trainer_config, worker

from tests.heavy.skyrl.py311 import allow_skyrl
from tests.support.rendezvous import file_store

allow_skyrl()  # the reference reads SkyRL's own loss and config in this process

HERE = Path(__file__).parent
REPO = HERE.parents[2]
WRAPPER = "skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py"
FP32_BOUND = 2e-5  # |Δ| against float64: fp32 rounding of the logits over 128 entries
BF16_FLOOR = 1e-4  # the stock step's bf16 logits miss float64 by at least this much somewhere
OFF = [run("off"), run("fused", fused=True)]
ON = [run("on", "fp32out"), run("on-chunked", "fp32out", chunk=2), run("fused-on", "fp32out", fused=True)]


def _job(tmp_path_factory, root: Path | None, world: int, phases: list) -> dict:
    """Rank 0's records of each phase's runs (the modules fp32patch imported by the end of each)."""
    out = tmp_path_factory.mktemp("skyrl-megatron")
    job = {"root": str(root) if root else None, "repo": str(REPO), "phases": phases, "out": str(out)}
    with file_store() as init_method:
        mp.spawn(worker, args=(world, init_method, job), nprocs=world, join=True)
    ranks = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    for other in ranks[1:]:  # every rank reduces to the same log-probs
        for name, record in other["runs"].items():
            if record["ok"]:
                assert torch.equal(record["log_probs"], ranks[0]["runs"][name]["log_probs"]), name
    return ranks[0]


@pytest.fixture(scope="module")
def patched_root() -> Iterator[Path]:
    from tests.heavy import roots

    root = roots.patched_root("skyrl", WRAPPER, label="skyrl-")
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"tp{w}")
def runs(request, tmp_path_factory, patched_root) -> dict:
    world = request.param
    return {
        "world": world,
        "stock": _job(tmp_path_factory, None, world, [OFF]),
        "patched": _job(tmp_path_factory, patched_root, world, [OFF, ON]),
    }


def _ok(results: dict, name: str) -> dict:
    record = results["runs"][name]
    assert record["ok"], f"{name}: {record['error']}\n{record['traceback']}"
    return record


def _error(got, want) -> float:
    return (torch.as_tensor(got).double() - want).abs().max().item()


def _relative(got, want) -> float:
    return _error(got, want) / want.abs().max().item()


def test_runs_use_the_trees_they_name(runs, patched_root):
    assert "site-packages" in runs["stock"]["skyrl"]
    assert runs["patched"]["skyrl"].startswith(str(patched_root))
    assert WRAPPER and "fp32patch" in (patched_root / WRAPPER).read_text()


@pytest.mark.parametrize("name", ["off", "fused"])
def test_off_is_stock_bit_for_bit_and_never_imports_fp32patch(runs, name):
    stock, off = _ok(runs["stock"], name), _ok(runs["patched"], name)
    assert runs["patched"]["modules"][0] == []  # the patched tree, the field unset: fp32patch never imported
    assert (stock["mode"], off["mode"]) == (None, None)
    for key in ("log_probs", "old_log_probs", "hidden", "weight_grad"):
        assert torch.equal(stock[key], off[key]), key
    assert stock["metrics"][0]["final_loss"] == off["metrics"][0]["final_loss"]
    assert stock["grads"].keys() == off["grads"].keys()
    for name, grad in stock["grads"].items():
        assert torch.equal(grad, off["grads"][name]), name


@pytest.mark.parametrize("name", ["on", "on-chunked", "fused-on"])
def test_the_field_gives_an_fp32_step(runs, name):
    record = _ok(runs["patched"], name)
    assert record["mode"] == "fp32out"
    assert record["log_probs_dtype"] == "torch.float32"
    want = reference(record, runs["world"], trainer_config(run("loss", fused=name.startswith("fused"))))
    assert _error(record["log_probs"], want["log_probs"]) < FP32_BOUND
    assert _error(record["old_log_probs"], want["log_probs"]) < FP32_BOUND  # forward-only: the same head
    assert _error(record["metrics"][0]["policy_entropy"], want["entropy"]) < FP32_BOUND
    # fp32out's weight gradient: grad_output carried in scaled fp16 (TF32's 2**-11), accumulated in fp32
    assert _relative(record["weight_grad"], want["weight_grad"]) < 5e-4


@pytest.mark.parametrize(("stock_run", "wired_run"), [("off", "on"), ("fused", "fused-on")])
def test_the_stock_step_is_bf16_rounded(runs, stock_run, wired_run):
    stock, wired = _ok(runs["stock"], stock_run), _ok(runs["patched"], wired_run)
    assert torch.equal(stock["hidden"], wired["hidden"])  # the same operands reach the head
    cfg = trainer_config(run("loss", fused=stock_run == "fused"))
    stock_want, wired_want = reference(stock, runs["world"], cfg), reference(wired, runs["world"], cfg)
    stock_error = _error(stock["log_probs"], stock_want["log_probs"])
    assert stock_error > BF16_FLOOR
    assert stock_error > 10 * _error(wired["log_probs"], wired_want["log_probs"])
    # the weight gradient: stock's comes from bf16 logits (and, fused, the bf16 W / T) and lands in
    # bf16 (.grad), five times and more fp32out's error
    stock_grad = _relative(stock["weight_grad"], stock_want["weight_grad"])
    assert stock_grad > 5 * _relative(wired["weight_grad"], wired_want["weight_grad"])


def test_the_fused_path_computes_what_the_output_layer_does(runs):
    """SkyRL's fused LM-head path under the field: no output layer call, the same fp32-grade
    log-probs as the wired output layer's logits give (both within fp32 rounding of float64)."""
    layer, fused = _ok(runs["patched"], "on"), _ok(runs["patched"], "fused-on")
    assert torch.equal(layer["hidden"], fused["hidden"])
    assert _error(fused["log_probs"], layer["log_probs"].double()) < 2 * FP32_BOUND
    assert _error(fused["old_log_probs"], layer["old_log_probs"].double()) < 2 * FP32_BOUND


@pytest.mark.parametrize(("name", "base"), [("on", "off"), ("fused-on", "fused"), ("fused-on", "on")])
def test_every_gradient_below_the_head_agrees(runs, name, base):
    """The decoder's and the embedding's gradients: the wired step's against stock's (they differ
    by the head's rounding only) and the fused path's against the output layer's. Under tensor
    parallelism the hidden states' gradient is summed over the ranks once, by Megatron's region
    before the head (a second sum in the head would double it)."""
    record = _ok(runs["patched"], name)
    other = _ok(runs["stock" if base in ("off", "fused") else "patched"], base)
    for param, grad in record["grads"].items():
        if param == "output_layer.weight":
            continue
        want = other["grads"][param].double()
        scale = want.abs().max().item()
        assert scale > 0, param
        assert _error(grad, want) / scale < 0.05, (param, _error(grad, want) / scale)


def test_chunked_log_probs_equal_the_whole_ones(runs):
    whole, chunked = _ok(runs["patched"], "on"), _ok(runs["patched"], "on-chunked")
    assert _error(chunked["log_probs"], whole["log_probs"].double()) < 1e-6
    assert _error(chunked["weight_grad"], whole["weight_grad"].double()) < 1e-6
