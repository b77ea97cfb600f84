"""verl's real FSDP engine (``FSDPEngineWithLMHead``, ``FSDPEngineWithValueHead``) on two gloo
ranks, from the environment's verl and from a copy patched by ``fp32patch apply``.

- Switch off (the key absent, or false): the patched tree gives what the stock tree gives,
  bit for bit (log-probs, loss, every parameter's update), for the actor (FSDP2 and FSDP1), the
  reference policy and the critic, and the process never imports fp32patch.
- Switch on (``fp32out``): the actor's head returns fp32 logits within 1e-5 (relative) of the
  float64 product of the bf16 operands it was handed, where the stock bf16 head is ~1e-3 off;
  verl's ``prepare_model_outputs`` receives fp32 logits; a training step at temperature 0.7
  gives a finite loss and a finite update that reaches the head's weight. The reference policy
  (forward only) gets the fp32 head too; the critic keeps its value head, unchanged.

The runs are verl_engine.py's; see there for what is recorded.
"""

from __future__ import annotations

import pytest
import torch
from verl_engine import run, worker
from verl_harness import patched_root, save_tiny_critic, save_tiny_qwen2, spawn

FP32_TOLERANCE = 1e-5  # relative, against float64
STOCK_RUNS = [
    run("actor-fsdp2", "fsdp2"),
    run("ref-fsdp2", "fsdp2", role="ref"),
    run("critic-fsdp2", "fsdp2", role="critic"),
    run("actor-fsdp1", "fsdp"),
]
# phase 1: the switch off (fp32patch must stay unimported); phase 2: on
OFF_RUNS = [
    run("actor-fsdp2", "fsdp2"),
    run("actor-fsdp2-false", "fsdp2", key=False),
    run("ref-fsdp2", "fsdp2", role="ref", key=False),
    run("critic-fsdp2", "fsdp2", role="critic"),
    run("actor-fsdp1", "fsdp", key=False),
]
ON_RUNS = [
    run("actor-fsdp2-on", "fsdp2", key="fp32out"),
    run("ref-fsdp2-on", "fsdp2", role="ref", key="fp32out"),
    run("critic-fsdp2-on", "fsdp2", role="critic", key="fp32out"),
    run("actor-fsdp1-on", "fsdp", key="fp32out"),
]
PAIRS = [
    ("actor-fsdp2", "actor-fsdp2"),
    ("actor-fsdp2", "actor-fsdp2-false"),
    ("ref-fsdp2", "ref-fsdp2"),
    ("critic-fsdp2", "critic-fsdp2"),
    ("critic-fsdp2", "critic-fsdp2-on"),
    ("actor-fsdp1", "actor-fsdp1"),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("verl-models")
    save_tiny_qwen2(base / "actor")
    save_tiny_critic(base / "critic")
    return {"model_dir": str(base / "actor"), "critic_dir": str(base / "critic")}


def _job(tmp_path_factory, models: dict, root, phases) -> list[dict]:
    out = tmp_path_factory.mktemp("verl-engine")
    spawn(worker, {**models, "root": root, "phases": phases, "out": str(out)})
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.fixture(scope="module")
def stock(tmp_path_factory, models) -> list[dict]:
    return _job(tmp_path_factory, models, None, [STOCK_RUNS])


@pytest.fixture(scope="module")
def patched(tmp_path_factory, models) -> list[dict]:
    root = patched_root(tmp_path_factory.mktemp("verl-tree"))
    return _job(tmp_path_factory, models, str(root), [OFF_RUNS, ON_RUNS])


def _ok(ranks: list[dict], name: str) -> list[dict]:
    runs = [results["runs"][name] for results in ranks]
    for rank, one in enumerate(runs):
        assert one["ok"], f"rank {rank}, run {name}: {one['error']}\n{one['traceback']}"
    return runs


def _relative_error(call: dict) -> float:
    exact = call["x"].double() @ call["w"].double().T
    return ((call["out"].double() - exact).norm() / exact.norm()).item()


def test_each_rank_imported_the_tree_it_was_given(stock, patched):
    for results in stock:
        assert "verl-patched-" not in results["verl_file"]
    for results in patched:
        assert "verl-patched-" in results["verl_file"]


@pytest.mark.parametrize(("stock_name", "patched_name"), PAIRS)
def test_switch_off_gives_the_stock_engines_results_bit_for_bit(stock, patched, stock_name, patched_name):
    for before, after in zip(_ok(stock, stock_name), _ok(patched, patched_name), strict=True):
        assert after["instance_forwards"] == {}, "the switch is off: no head is replaced"
        assert before["head"] == after["head"] and before["module"] == after["module"]
        assert torch.equal(before["infer"], after["infer"])
        for call_before, call_after in zip(before["infer_head"], after["infer_head"], strict=True):
            assert call_after["out"].dtype == call_before["out"].dtype
            assert torch.equal(call_before["out"], call_after["out"])
        if "update" in before:
            assert before["loss"] == after["loss"]
            assert before["update"].keys() == after["update"].keys()
            for name, delta in before["update"].items():
                assert torch.equal(delta, after["update"][name]), name


def test_switch_off_never_imports_fp32patch(patched):
    for results in patched:
        assert results["modules"][0] == []
        # and the runs with the switch on did
        assert "fp32patch.runtime.heads.hf" in results["modules"][1]


def test_the_stock_heads_logits_are_bf16(stock):
    for one in _ok(stock, "actor-fsdp2"):
        calls = one["infer_head"] + one["train_head"]
        assert calls and all(call["out"].dtype == torch.bfloat16 for call in calls)
        assert set(one["infer_logits_dtypes"] + one["train_logits_dtypes"]) == {torch.bfloat16}
        # bf16's rounding of logits around |z| ~ 30: far above fp32's
        assert min(_relative_error(call) for call in calls) > 100 * FP32_TOLERANCE


@pytest.mark.parametrize("name", ["actor-fsdp2-on", "actor-fsdp1-on"])
def test_switch_on_gives_the_actor_fp32_logits_and_a_finite_step(patched, name):
    for one in _ok(patched, name):
        assert len(one["instance_forwards"]) == 1, one["instance_forwards"]
        (module,) = one["instance_forwards"]
        assert module.endswith("lm_head"), one["instance_forwards"]
        calls = one["infer_head"] + one["train_head"]
        assert len(calls) == 4  # two micro-batches, inference and training
        for call in calls:
            assert call["w"].dtype == torch.bfloat16  # mixed precision's bf16 weight, as stock
            assert call["out"].dtype == torch.float32
            assert _relative_error(call) < FP32_TOLERANCE
        assert set(one["infer_logits_dtypes"] + one["train_logits_dtypes"]) == {torch.float32}
        assert torch.isfinite(one["infer"]).all() and (one["infer"] <= 0).all()
        assert torch.isfinite(torch.as_tensor(one["loss"])).all()
        assert all(torch.isfinite(delta).all() for delta in one["update"].values())
        if name.startswith("actor-fsdp2"):
            head = [delta for key, delta in one["update"].items() if "lm_head" in key]
            assert head and all(delta.abs().sum() > 0 for delta in head), "the head's weight was not updated"
        else:  # FSDP1: one flat parameter per unit, named for none of the model's
            assert any(delta.abs().sum() > 0 for delta in one["update"].values())


def test_switch_on_moves_the_actors_log_probs_off_the_bf16_ones(stock, patched):
    """Same weights, same tokens: the fp32 head changes the log-probs by bf16's rounding of
    the logits, not by more (the model is the same)."""
    for before, after in zip(_ok(stock, "actor-fsdp2"), _ok(patched, "actor-fsdp2-on"), strict=True):
        difference = (before["infer"] - after["infer"]).abs().max().item()
        assert 0 < difference < 1.0


def test_the_reference_policy_gets_the_fp32_head(patched):
    for one in _ok(patched, "ref-fsdp2-on"):
        assert "update" not in one
        assert one["infer_head"] and all(call["out"].dtype == torch.float32 for call in one["infer_head"])
        assert all(_relative_error(call) < FP32_TOLERANCE for call in one["infer_head"])
        assert set(one["infer_logits_dtypes"]) == {torch.float32}


def test_the_critic_keeps_its_value_head(patched):
    for one in _ok(patched, "critic-fsdp2-on"):
        assert one["engine"] == "FSDPEngineWithValueHead"
        assert one["instance_forwards"] == {}
        assert all(call["out"].dtype == torch.bfloat16 for call in one["infer_head"])


def test_cpu_shims_are_only_the_two_named(stock, patched):
    """What the runs lifted for the CPU is the same on both trees, and only ever the two named
    torch checks (FSDP1's GPU-only sync check, the reference policy's pinned offload)."""
    allowed = {
        "torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states",
        "torch.Tensor.pin_memory",
    }
    for results in stock + patched:
        for name, one in results["runs"].items():
            if one["ok"]:
                assert set(one["lifted"]) <= allowed, name
