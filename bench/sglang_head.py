"""SGLang's fp32 LM head (--enable-fp32-lm-head), timed three ways on one GPU.

* "bf16": SGLang's stock head, ``torch.matmul(hidden.to(weight.dtype), weight.T)`` (bf16 logits);
* "sglang 0.5.3-0.5.17": the flag's head on those releases, ``torch.matmul(hidden.to(float32),
  weight.to(float32).T)``: an fp32 copy of the whole weight and an IEEE fp32 GEMM on every call;
* "fp32out (patched)": the same flag on those releases once ``sglang-fp32-lm-head`` is applied,
  ``fp32patch.runtime.heads.sglang.fp32_logits`` (``torch.mm(..., out_dtype=torch.float32)`` on
  bf16 operands), which is also SGLang 0.5.18+'s own product.

SGLang itself is not needed: its two products are written here as the formulas its
``LogitsProcessor`` computes, and ours is fp32patch's runtime function. Shapes are
``bench/lm_head.py``'s (prefill-sized) plus decode-sized batches of a Qwen-sized vocabulary (the
flag pays the weight copy on every decode step). Timing, rounds and ratios are
``bench/lm_head.py``'s (``time_rounds``: each way next to a bf16 timing of its own, interleaved;
a ratio is the median over rounds of the paired ratios); also each way's extra device memory
beyond its logits and the mean |Δ log p| of sampled tokens against float64.

    python bench/sglang_head.py --out bench/out/sglang-head.json [--quick] [--cpu]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import lm_head  # noqa: E402  (its timing helpers, shapes and inputs)
from fp32patch.runtime.heads.sglang import fp32_logits  # noqa: E402

# (tokens, hidden, vocab): bench/lm_head.py's shapes, then decode batches (Qwen's vocabulary)
DECODE = [(64, 4096, 151936), (512, 4096, 151936)]
SHAPES = [*lm_head.SHAPES, *DECODE]
QUICK = [(256, 512, 4096)]
WAYS = {
    "bf16": lambda h, w: torch.matmul(h.to(w.dtype), w.T),
    "sglang 0.5.3-0.5.17": lambda h, w: torch.matmul(h.to(torch.float32), w.to(torch.float32).T),
    "fp32out (patched)": fp32_logits,
}


def bench_shape(shape, warmup: int, iters: int, rounds: int, min_ms: float) -> dict:
    t, hdim, v = shape
    h, w = lm_head.inputs(t, hdim, v)
    ref = lm_head.reference64(h, w)
    tokens = lm_head.sampled_tokens(ref)
    ref_lp = lm_head.token_logp(ref, tokens)
    del ref
    rows: dict[str, dict] = {}
    outputs = {}
    for way, fn in WAYS.items():
        lm_head._sync()
        lm_head._reset_peak()
        base = lm_head._allocated()
        out = fn(h, w)
        lm_head._sync()
        extra = lm_head._peak() - base - out.numel() * out.element_size()
        err = (lm_head.token_logp(out, tokens) - ref_lp).abs()
        rows[way] = {
            "logits_dtype": str(out.dtype).removeprefix("torch."),
            "extra_bytes_transient": max(extra, 0),
            "mean_abs_dlogp": err.mean().item(),
            "max_abs_dlogp": err.max().item(),
        }
        outputs[way] = out
    # ours is SGLang 0.5.18+'s own product (torch.mm with out_dtype) on CUDA: the same bits
    if lm_head.DEVICE == "cuda":
        native = torch.mm(h, w.T, out_dtype=torch.float32)
        rows["fp32out (patched)"]["bits_equal_torch_mm_out_dtype"] = bool(
            torch.equal(outputs["fp32out (patched)"], native)
        )
        del native
    del outputs
    times, paired = lm_head.time_rounds(
        {way: (lambda fn=fn: fn(h, w)) for way, fn in WAYS.items()}, warmup, iters, rounds, min_ms
    )
    lm_head._add_times(rows, times, paired)
    return {"shape": {"tokens": t, "hidden": hdim, "vocab": v}, "ways": rows}


def table(results: dict) -> str:
    lines = [f"{'tokens x hidden x vocab':>26}  {'way':<22} {'ms':>9} {'x bf16':>8}  {'extra MiB':>9}  {'|dlogp|':>9}"]
    for entry in results["shapes"]:
        s = entry["shape"]
        for way, row in entry["ways"].items():
            lines.append(
                f"{s['tokens']:>8} x {s['hidden']:>5} x {s['vocab']:>6}  {way:<22} {row['ms']:>9.3f} "
                f"{row['ratio']:>8.3f}  {row['extra_bytes_transient'] / 2**20:>9.1f}  {row['mean_abs_dlogp']:>9.2e}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/sglang-head.json"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=6, help="timed calls per measurement, at least")
    parser.add_argument("--min-ms", type=float, default=300.0, help="timed milliseconds per measurement, at least")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; a ratio is the median over rounds")
    parser.add_argument("--quick", action="store_true", help="one small shape (a smoke run)")
    parser.add_argument(
        "--cpu", action="store_true", help="a smoke run of the logic on the CPU (times not worth reading)"
    )
    args = parser.parse_args(argv)
    if args.cpu:
        lm_head.DEVICE = "cpu"
        args.min_ms = 0.0
    elif not torch.cuda.is_available():
        print(
            "bench/sglang_head.py needs a CUDA GPU (or --cpu --quick for a smoke run); none is visible", file=sys.stderr
        )
        return 2
    else:
        lm_head.DEVICE = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # SGLang's default: an IEEE fp32 GEMM for the flag's upcast
    results = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "gpu": torch.cuda.get_device_name(0) if lm_head.DEVICE == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "host": platform.node(),
        },
        "settings": {"warmup": args.warmup, "iters": args.iters, "min_ms": args.min_ms, "rounds": args.rounds},
        "shapes": [
            bench_shape(s, args.warmup, args.iters, args.rounds, args.min_ms) for s in (QUICK if args.quick else SHAPES)
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
