"""NeMo-RL's fused log-prob path (``use_fused_linear_logprobs``) on a real megatron-core GPTModel.

The stand-in NeMo-RL checkout's fused forward (tests/fixtures/nemo_rl_src, model_utils.py and
train.py: fp32patch's code of NeMo-RL's shape), stock and patched by ``fp32patch apply``, runs a
training step through the checkout's own setup.py and train.py at TP=1 and TP=2 (gloo, sequence
parallel), with an untied and a tied output weight (``shared_embedding_or_output_weight``), on a
packed batch-1 micro-batch at temperature 0.7 (nemo_rl_fused.py says what runs and what stands in
for CUDA):

- the guard of each Megatron worker accepts the fp32 head with the fused path;
- wired by fp32patch, the fused log-probs are fp32-grade: within fp32 rounding of the float64
  log-probs of the hidden states and weight the step used, at the temperature, where the stock
  fused path is bf16-rounded; the output weight's gradient is TF32-grade (fp32out);
- the stock fused path divides the log-probs by the temperature (log p / T): NeMo-RL's bug,
  which the patched path does not inherit;
- without the key the patched checkout gives the stock checkout's log-probs and gradients bit
  for bit, and never imports fp32patch;
- the older switch name (``use_linear_ce_fusion_loss``, before July 2026) works the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from nemo_rl_fused import TEMPERATURE, reference, run, worker

from tests.support.rendezvous import file_store

STOCK = [run("stock-untied"), run("stock-tied", tied=True)]
WIRED = [run("fp32out-untied", key="fp32out"), run("fp32out-tied", key="fp32out", tied=True)]
FP32_BOUND = 2e-5  # |Δ log p| against float64: fp32 rounding of logits ~|z| < 10 (worst token)
WORLDS = [1, 2]


def _job(tmp_path_factory, root, world: int, phases) -> list[dict]:
    out = tmp_path_factory.mktemp(f"fused-tp{world}")
    job = {"root": str(root), "phases": phases, "out": str(out)}
    with file_store() as init_method:
        mp.spawn(worker, args=(world, init_method, job), nprocs=world, join=True)
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _tree(tmp_path_factory, shape_name: str, patched: bool):
    from tests.fixtures.nemo_rl_shapes import checkout
    from tests.nemo_rl_harness import cli

    root = checkout(shape_name, tmp_path_factory.mktemp("nemo-rl"))
    if patched:
        code, data = cli("apply", "-s", str(root), "--patch", "nemo-rl-fp32-lm-head")
        assert code == 0, data
    return root


@pytest.fixture(scope="module", params=WORLDS, ids=lambda w: f"tp{w}")
def trees(request, tmp_path_factory) -> dict:
    """The stock checkout's runs and the patched one's (phase 1: the key unset; phase 2: on)."""
    from tests.fixtures.nemo_rl_shapes import SHAPES

    world = request.param
    stock = _job(tmp_path_factory, _tree(tmp_path_factory, SHAPES[0].name, False), world, [STOCK])
    patched = _job(tmp_path_factory, _tree(tmp_path_factory, SHAPES[0].name, True), world, [STOCK, WIRED])
    return {"world": world, "stock": stock, "patched": patched}


def _ok(ranks: list[dict], name: str) -> dict:
    for rank, results in enumerate(ranks):
        record = results["runs"][name]
        assert record["ok"], f"rank {rank}, {name}: {record['error']}\n{record['traceback']}"
    return ranks[0]["runs"][name]  # every rank holds the gathered tensors


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want).abs().max().item()


def _head_rows(record: dict) -> torch.Tensor:
    """The output weight's rows only the head's gradient reaches (a tied weight's embedding
    gradient lands on the rows of the input tokens)."""
    rows = torch.ones(record["weight"].shape[0], dtype=torch.bool)
    rows[record["ids"][0]] = False
    return rows


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("name", [r["name"] for r in STOCK])
def test_without_the_key_the_patched_checkout_is_stock_bit_for_bit(trees, name):
    for stock, patched in zip(trees["stock"], trees["patched"], strict=True):
        a, b = stock["runs"][name], patched["runs"][name]
        assert a["ok"] and b["ok"], (a.get("error"), b.get("error"))
        assert torch.equal(a["log_probs"], b["log_probs"])
        assert torch.equal(a["weight_grad"], b["weight_grad"])
        assert a["grads"].keys() == b["grads"].keys()
        for param in a["grads"]:
            assert torch.equal(a["grads"][param], b["grads"][param]), param
        assert patched["modules"][0] == []  # fp32patch never imported while nothing asks


@pytest.mark.parametrize("name", [r["name"] for r in STOCK])
def test_the_stock_fused_path_divides_the_log_probs_by_the_temperature(trees, name):
    record = _ok(trees["stock"], name)
    at_one = reference(record, temperature=1.0)["log_probs"]
    at_temperature = reference(record)["log_probs"]
    # NeMo-RL trains on log p / T (bf16 logits), not on log softmax(z / T)
    assert _max_error(record["log_probs"], at_one / TEMPERATURE) < 0.1
    assert _max_error(record["log_probs"], at_temperature) > 10 * _max_error(record["log_probs"], at_one / TEMPERATURE)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_wired_fused_log_probs_are_fp32_grade_at_the_temperature(trees, tied):
    suffix = "tied" if tied else "untied"
    wired, stock = _ok(trees["patched"], f"fp32out-{suffix}"), _ok(trees["patched"], f"stock-{suffix}")
    assert wired["dtype"] == torch.float32 and wired["marked"] == TEMPERATURE
    assert wired["megatron_mode"] == "fp32out"  # each Megatron worker's guard accepted the combination
    ref = reference(wired)
    err = _max_error(wired["log_probs"], ref["log_probs"])
    assert err < FP32_BOUND, err
    # the stock fused path on the same model, at T=1 where its temperature bug does not show
    stock_err = _max_error(stock["log_probs"] * TEMPERATURE, reference(stock, temperature=1.0)["log_probs"])
    assert stock_err > 100 * err, (stock_err, err)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_wired_weight_gradient_is_tf32_grade_and_the_step_reaches_every_layer(trees, tied):
    suffix = "tied" if tied else "untied"
    wired = _ok(trees["patched"], f"fp32out-{suffix}")
    rows = _head_rows(wired) if tied else slice(None)
    err = _relative(wired["weight_grad"][rows], reference(wired)["weight_grad"][rows])
    assert err < 2.0**-10, err  # fp32out: TF32's rounding of the gradient, fp32 accumulation
    grads = wired["grads"]
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert any(name.startswith("decoder.layers.0.") and g.any() for name, g in grads.items())
    assert any(name.startswith("embedding.") and g.any() for name, g in grads.items())


def test_the_switch_name_before_july_2026_gets_the_same_path(tmp_path_factory):
    # 2026-06-20's shape: use_linear_ce_fusion_loss and linear_ce_fusion_chunk_size
    from tests.fixtures.nemo_rl_shapes import BY_NAME

    root = _tree(tmp_path_factory, BY_NAME["29fc948c5"].name, True)
    runs = [run("old-key", key="fp32out", fused_key="use_linear_ce_fusion_loss")]
    record = _ok(_job(tmp_path_factory, root, 1, [runs]), "old-key")
    assert record["marked"] == TEMPERATURE
    assert _max_error(record["log_probs"], reference(record)["log_probs"]) < FP32_BOUND
