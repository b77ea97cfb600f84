"""slime's Megatron side from its one flag, on a real megatron-core GPTModel (CPU, gloo, TP=1 and 2).

The stand-in slime checkout (tests/fixtures/slime_src: slime's shapes of arguments.py,
model_provider.py, model.py, loss.py and ppo_utils.py, not its code), stock and patched by
``fp32patch apply``, runs slime's parse_args, setup_model_and_optimizer and one training step
(slime_step.py says what runs and what stands in for CUDA and Megatron-LM):

- ``--fp32-lm-head fp32out`` wires the GPTModel slime's provider built, and the same switch sets
  SGLang's flag in the server arguments; the step's log-probs and entropy (at temperature 0.7,
  through slime's full and chunked log-prob code) are within fp32 rounding of the float64 ones of
  the step's own hidden states and weight, where the stock step's are bf16-rounded; the output
  weight's gradient reaches DDP's main_grad at fp32out's grade;
- a --custom-model-provider-path model is wired the same; one whose head fp32patch cannot wire is
  refused, naming the provider; a critic keeps its value head;
- without the flag the patched checkout gives the stock one's log-probs, entropy and every
  gradient bit for bit, and never imports fp32patch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from slime_step import reference, run, worker

from tests.support.rendezvous import file_store

OFF = [run("off")]
ON = [
    run("fp32out", "--fp32-lm-head", "fp32out"),
    run("fp32out-chunked", "--fp32-lm-head", "fp32out", "--log-probs-chunk-size", "3"),
    run("custom", "--fp32-lm-head", "fp32out", "--custom-model-provider-path", "slime_providers.gpt"),
    run("critic", "--fp32-lm-head", "fp32out", "--advantage-estimator", "ppo", role="critic"),
    run("unwirable", "--fp32-lm-head", "fp32out", "--custom-model-provider-path", "slime_providers.linear_head"),
]
FP32_BOUND = 2e-5  # |Δ| against float64: fp32 rounding of logits |z| < 10 over 128 entries
# the stock head's bf16 logits miss float64 by at least this much somewhere (this tiny model's
# logits are below 1 in magnitude: bf16's half ulp there is ~2e-3 of them)
BF16_FLOOR = 1e-4
HERE = Path(__file__).parent
REPO = HERE.parents[2]


def _job(tmp_path_factory, root: Path, world: int, phases) -> dict:
    """Rank 0's results (every rank computes the same log-probs; the weights are gathered)."""
    out = tmp_path_factory.mktemp("slime-step")
    job = {"root": str(root), "providers": str(HERE), "repo": str(REPO), "phases": phases, "out": str(out)}
    with file_store() as init_method:
        mp.spawn(worker, args=(world, init_method, job), nprocs=world, join=True)
    ranks = [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]
    for other in ranks[1:]:
        for name, record in other["runs"].items():
            if record["ok"] and "log_probs" in record:
                assert torch.equal(record["log_probs"], ranks[0]["runs"][name]["log_probs"]), name
    return ranks[0]


@pytest.fixture(scope="module", params=[1, 2], ids=lambda w: f"tp{w}")
def runs(request, tmp_path_factory) -> dict:
    from tests.fixtures.slime_shapes import checkout
    from tests.nemo_rl_harness import cli

    world = request.param
    stock = checkout(tmp_path_factory.mktemp("stock"))
    patched = checkout(tmp_path_factory.mktemp("patched"))
    code, data = cli("apply", "-s", str(patched), "--patch", "slime-fp32-lm-head")
    assert code == 0, data
    return {
        "stock": _job(tmp_path_factory, stock, world, [OFF]),
        "patched": _job(tmp_path_factory, patched, world, [OFF, ON]),
    }


def _ok(results: dict, name: str) -> dict:
    record = results["runs"][name]
    assert record["ok"], f"{name}: {record['error']}\n{record['traceback']}"
    return record


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want).abs().max().item()


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return _error(got, want) / want.abs().max().item()


def test_off_is_stock_bit_for_bit_and_never_imports_fp32patch(runs):
    stock, patched = _ok(runs["stock"], "off"), _ok(runs["patched"], "off")
    assert runs["patched"]["modules"][0] == []
    assert (stock["mode"], patched["mode"]) == (None, None)
    for key in ("log_probs", "entropy", "weight_grad"):
        assert torch.equal(stock[key], patched[key]), key
    assert stock["grads"].keys() == patched["grads"].keys()
    for name, grad in stock["grads"].items():
        assert torch.equal(grad, patched["grads"][name]), name


@pytest.mark.parametrize("name", ["fp32out", "fp32out-chunked", "custom"])
def test_the_flag_gives_an_fp32_training_step(runs, name):
    record = _ok(runs["patched"], name)
    assert (record["mode"], record["sglang_flag"]) == ("fp32out", True)  # one switch, both engines
    assert record["log_probs"].dtype == torch.float32
    want = reference(record)
    assert _error(record["log_probs"], want["log_probs"]) < FP32_BOUND
    assert _error(record["entropy"], want["entropy"]) < FP32_BOUND
    # fp32out's weight gradient: grad_output carried in scaled fp16 (TF32's 2**-11), accumulated in fp32
    assert _relative(record["weight_grad"], want["weight_grad"]) < 2e-3


def test_the_stock_step_is_bf16_rounded(runs):
    """The same model and batch: the stock step's log-probs miss float64 by bf16's rounding, ten
    times and more the flag's."""
    stock, wired = _ok(runs["stock"], "off"), _ok(runs["patched"], "fp32out")
    assert torch.equal(stock["hidden"], wired["hidden"])
    stock_error = _error(stock["log_probs"], reference(stock)["log_probs"])
    assert stock_error > BF16_FLOOR
    assert stock_error > 10 * _error(wired["log_probs"], reference(wired)["log_probs"])


def test_chunked_log_probs_equal_the_full_ones(runs):
    full, chunked = _ok(runs["patched"], "fp32out"), _ok(runs["patched"], "fp32out-chunked")
    assert torch.equal(full["hidden"], chunked["hidden"])
    assert _error(chunked["log_probs"], full["log_probs"].double()) < 1e-6
    assert _error(chunked["weight_grad"], full["weight_grad"].double()) < 1e-6


def test_a_critic_keeps_its_value_head(runs):
    record = _ok(runs["patched"], "critic")
    assert (record["mode"], record["layer"]) == (None, "LinearForLastLayer")


def test_a_provider_fp32patch_cannot_wire_is_refused_naming_it(runs):
    record = runs["patched"]["runs"]["unwirable"]
    assert not record["ok"]
    assert record["error"].startswith("Fp32LmHeadConfigError: fp32patch (slime actor): --fp32-lm-head is 'fp32out'")
    assert "--custom-model-provider-path slime_providers.linear_head" in record["error"]
    assert "ColumnParallelLinear" in record["error"]
