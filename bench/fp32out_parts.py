"""Where fp32out's time goes: the pieces of its forward and backward, one by one, on a GPU.

    python bench/fp32out_parts.py [--shape T,H,V] [--tiles] [--json out.json]

Forward: torch.mm with fp32 output against the bf16 GEMM (and bf16 + .float()), per shape.
Backward (default T=16384, H=4096, V=131072): the GEMMs, then each kernel of the backward
as the eager path runs it and as the Triton kernels of ``fp16_scale_triton`` run it, with
the bandwidth each reaches (bytes read + written over time; a device-to-device copy of the
gradient is the ceiling), then the whole backward both ways. ``--tiles`` also times the
Triton kernels over a few tile shapes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lm_head import time_ms  # noqa: E402
from fp32patch.runtime import fp16_scale_triton as kern  # noqa: E402
from fp32patch.runtime import fp32out  # noqa: E402


def ms(fn) -> float:
    return time_ms(fn, warmup=3, iters=15)


def forward() -> dict:
    out = {}
    for t, h, v in [(16384, 4096, 32768), (16384, 4096, 131072), (4096, 4096, 32768), (256, 4096, 131072)]:
        x = torch.randn(t, h, device="cuda").bfloat16()
        wt = torch.randn(v, h, device="cuda").bfloat16().t()
        base = ms(lambda x=x, wt=wt: torch.mm(x, wt))
        rows = {
            "out_dtype=fp32": ms(lambda x=x, wt=wt: torch.mm(x, wt, out_dtype=torch.float32)) / base,
            "bf16 + .float()": ms(lambda x=x, wt=wt: torch.mm(x, wt).float()) / base,
        }
        print(f"forward T={t} H={h} V={v}: bf16 {base:.2f} ms; " + ", ".join(f"{k} {r:.3f}x" for k, r in rows.items()))
        out[f"{t},{h},{v}"] = {"bf16_ms": base, **rows}
    return out


class Eager:
    """FP32PATCH_TRITON=0 for the duration: the eager path on CUDA."""

    def __enter__(self):
        self.old = os.environ.get(fp32out.TRITON_ENV_VAR)
        os.environ[fp32out.TRITON_ENV_VAR] = "0"

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(fp32out.TRITON_ENV_VAR)
        else:
            os.environ[fp32out.TRITON_ENV_VAR] = self.old


def eager(fn):
    def run():
        with Eager():
            return fn()

    return run


def backward(t: int, h: int, v: int) -> dict:
    x = torch.randn(t, h, device="cuda").bfloat16()
    w = (torch.randn(v, h, device="cuda") * 0.01).bfloat16()
    g = torch.softmax(torch.randn(t, v, device="cuda") * 4, -1) / t
    g16 = g.bfloat16()
    gb = g.numel() * 4  # bytes of the fp32 gradient
    main_grad = torch.zeros(v, h, device="cuda")
    assert fp32out._triton_kernels(g) is kern, "Triton kernels not available"
    cs = kern.column_scales(g)
    by_col, _ = kern.convert(g, cs)
    (x16, xscale), _ = fp32out._fp16_by_column(x)
    dw32 = torch.mm(by_col.t(), x16, out_dtype=torch.float32)
    dwb = dw32.numel() * 4
    ones_v, ones_h = torch.ones(v, 1, device="cuda"), torch.ones(1, h, device="cuda")  # keep dw32's values
    parts = {  # name: (fn, bytes moved or 0)
        "bf16 GEMM dx": (lambda: torch.mm(g16, w), 0),
        "bf16 GEMM dW": (lambda: torch.mm(g16.t(), x), 0),
        "fp16 GEMM dW, fp32 out": (lambda: torch.mm(by_col.t(), x16, out_dtype=torch.float32), 0),
        "bf16 GEMM dW, fp32 out": (lambda: torch.mm(g16.t(), x, out_dtype=torch.float32), 0),
        "copy of the fp32 gradient (ceiling)": (lambda: g.clone(), 2 * gb),
        "fp32 -> bf16 cast of the gradient": (lambda: g.bfloat16(), gb + gb // 2),
        "eager: column max": (lambda: torch.linalg.vector_norm(g, float("inf"), dim=0, keepdim=True), gb),
        "eager: scale + convert": (lambda: torch.mul(g, cs, out=by_col), gb + gb // 2),
        "eager: dW unscale (two passes)": (lambda: dw32.div_(ones_v).div_(ones_h), 4 * dwb),
        "triton: column scales of the gradient": (lambda: kern.column_scales(g), gb),
        "triton: bf16 copy + fp16 column-scaled copy": (lambda: kern.convert(g, cs, torch.bfloat16), 2 * gb),
        "triton: fp16 column-scaled copy only": (lambda: kern.convert(g, cs), gb + gb // 2),
        "triton: input to fp16 per column (max + convert)": (
            lambda: fp32out._fp16_by_column(x),
            3 * x.numel() * 2,
        ),
        "triton: dW unscale -> bf16": (
            lambda: kern.unscale(dw32, cs.t(), xscale, torch.bfloat16, None),
            dwb + dwb // 2,
        ),
        "triton: dW unscale + main_grad +=": (
            lambda: kern.unscale(dw32, cs.t(), xscale, torch.float32, main_grad),
            3 * dwb,
        ),
        "whole backward, bf16 GEMMs (the stock head)": (lambda: (torch.mm(g16, w), torch.mm(g16.t(), x)), 0),
        "whole backward, eager (dx bf16, dW bf16)": (
            eager(lambda: fp32out.fp16_scaled_grads(g, w, x, torch.bfloat16, torch.bfloat16)),
            0,
        ),
        "whole backward, triton (dx bf16, dW bf16)": (
            lambda: fp32out.fp16_scaled_grads(g, w, x, torch.bfloat16, torch.bfloat16),
            0,
        ),
        "whole backward, triton (dW into main_grad)": (
            lambda: fp32out.fp16_scaled_grads(g, w, x, torch.bfloat16, torch.bfloat16, main_grad),
            0,
        ),
    }
    print(f"backward pieces, T={t} H={h} V={v}:")
    out = {}
    for name, (fn, nbytes) in parts.items():
        t_ms = ms(fn)
        rate = f"{nbytes / t_ms / 1e9:>7.2f} TB/s" if nbytes else ""
        print(f"  {name:<50}{t_ms:>8.2f} ms {rate}")
        out[name] = {"ms": t_ms, "bytes": nbytes}
    return out


def tiles(t: int, v: int) -> dict:
    """The conversion kernel over a few tile shapes, at [T, V]."""
    g = torch.softmax(torch.randn(t, v, device="cuda") * 4, -1) / t
    gb = g.numel() * 4
    cs = kern.column_scales(g)
    saved = {k: getattr(kern, k) for k in dir(kern) if k.startswith("_CONVERT_")}
    out = {}
    try:
        for bm, bn, warps in [(16, 512, 8), (32, 256, 8), (64, 256, 8), (32, 128, 4), (8, 1024, 8), (16, 256, 4)]:
            kern._CONVERT_BM, kern._CONVERT_BN, kern._CONVERT_WARPS = bm, bn, warps
            t_ms = ms(lambda: kern.convert(g, cs, torch.bfloat16))
            print(f"  convert BM={bm} BN={bn} warps={warps}: {t_ms:.3f} ms {2 * gb / t_ms / 1e9:.2f} TB/s")
            out[f"convert {bm}x{bn} w{warps}"] = t_ms
    finally:
        for k, val in saved.items():
            setattr(kern, k, val)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="16384,4096,131072")
    parser.add_argument("--tiles", action="store_true")
    parser.add_argument("--no-forward", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/fp32out_parts.py needs a CUDA GPU")
    t, h, v = (int(s) for s in args.shape.split(","))
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    if not args.no_forward:
        results["forward"] = forward()
    results["backward"] = {"shape": [t, h, v], "parts": backward(t, h, v)}
    if args.tiles:
        results["tiles"] = tiles(t, v)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
