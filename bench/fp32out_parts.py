"""Where fp32out's time goes: the pieces of its forward and backward, one by one, on a GPU.

    python bench/fp32out_parts.py

Forward: torch.mm with fp32 output against the bf16 GEMM (and bf16 + .float()), per shape.
Backward (T=16384, H=4096, V=131072): the GEMMs, the row/column maxima of the fp32 gradient,
the scale-and-convert passes and the rescaling that fp32out.fp16_scaled_mm is made of.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lm_head import time_ms  # noqa: E402
from fp32patch.runtime import fp32out  # noqa: E402


def ms(fn) -> float:
    return time_ms(fn, warmup=2, iters=10)


def forward() -> None:
    for t, h, v in [(16384, 4096, 32768), (16384, 4096, 131072), (4096, 4096, 32768), (256, 4096, 131072)]:
        x = torch.randn(t, h, device="cuda").bfloat16()
        wt = torch.randn(v, h, device="cuda").bfloat16().t()
        base = ms(lambda x=x, wt=wt: torch.mm(x, wt))
        rows = {
            "out_dtype=fp32": ms(lambda x=x, wt=wt: torch.mm(x, wt, out_dtype=torch.float32)),
            "bf16 + .float()": ms(lambda x=x, wt=wt: torch.mm(x, wt).float()),
        }
        print(
            f"forward T={t} H={h} V={v}: bf16 {base:.2f} ms; "
            + ", ".join(f"{k} {r / base:.3f}x" for k, r in rows.items())
        )


def backward() -> None:
    t, h, v = 16384, 4096, 131072
    x = torch.randn(t, h, device="cuda").bfloat16()
    w = (torch.randn(v, h, device="cuda") * 0.01).bfloat16()
    g = torch.softmax(torch.randn(t, v, device="cuda") * 4, -1) / t
    g16 = g.bfloat16()
    out16 = torch.empty_like(g, dtype=torch.float16)
    rows, cols = torch.ones(t, 1, device="cuda"), torch.ones(1, v, device="cuda")
    dw = torch.empty(v, h, device="cuda")
    inv_v, inv_h = torch.ones(v, 1, device="cuda"), torch.ones(1, h, device="cuda")
    w16, x16 = w.half(), x.half()
    parts = {
        "bf16 GEMM dx": lambda: torch.mm(g16, w),
        "bf16 GEMM dW": lambda: torch.mm(g16.t(), x),
        "fp16 GEMM dx, fp32 out": lambda: torch.mm(out16, w16, out_dtype=torch.float32),
        "fp16 GEMM dW, fp32 out": lambda: torch.mm(out16.t(), x16, out_dtype=torch.float32),
        "row max of the fp32 gradient": lambda: torch.linalg.vector_norm(g, float("inf"), dim=1, keepdim=True),
        "column max": lambda: torch.linalg.vector_norm(g, float("inf"), dim=0, keepdim=True),
        "scale rows + convert to fp16": lambda: torch.mul(g, rows, out=out16),
        "scale columns + convert to fp16": lambda: torch.mul(g, cols, out=out16),
        "plain fp32 -> bf16 cast (for comparison)": lambda: g.bfloat16(),
        "weight to fp16, per-column scale": lambda: fp32out._fp16_scaled(w, 0),
        "dW rescale (two passes)": lambda: dw.div_(inv_v).div_(inv_h),
        "whole fp16_scaled_mm, dx": lambda: fp32out.fp16_scaled_mm(g, w),
        "whole fp16_scaled_mm, dW": lambda: fp32out.fp16_scaled_mm(g.t(), x),
    }
    print(f"backward pieces, T={t} H={h} V={v}:")
    for name, fn in parts.items():
        print(f"  {name:<42}{ms(fn):>8.2f} ms")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp32out_parts.py needs a CUDA GPU")
    forward()
    backward()
