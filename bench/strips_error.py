"""The input and weight gradients of a whole fp32out call three ways, against float64 (CUDA).

The strips (the default for a recomputed fp32out tile they hold) compute the tile again
transposed, a GEMM with its own fp32 summation order, so their 16-bit copies may round a few
entries the other way from the two passes' (``FP32PATCH_STRIPS=0``). This prints how far each
path's gradients are from each other and from float64, on the CUDA test's problem (1,000 tokens,
H=1024, V=32768, 300-token tiles, the entropy's gradient at 0.1):

    python bench/strips_error.py

Columns: the default against the eager path (``FP32PATCH_TRITON=0``), norm-relative, and the
share of bf16 input-gradient entries equal; the passes against the eager path; each path's
norm-relative error against float64 (input gradient, then main_grad).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fp32patch.runtime.kernels.chunked_logprobs import STRIPS_ENV_VAR, chunked_logprobs  # noqa: E402
from fp32patch.runtime.kernels.fp32out import TRITON_ENV_VAR  # noqa: E402
from tests.gpu.test_chunked_logprobs_cuda import T, _float64, _problem, _rel  # noqa: E402  (the test's problem)


def call(x, w, targets, grad, env, **kw):
    for name in (TRITON_ENV_VAR, STRIPS_ENV_VAR):
        os.environ.pop(name, None)
    os.environ.update(env)
    xl, wl = x.clone().requires_grad_(), torch.nn.Parameter(w.clone())
    wl.main_grad = torch.zeros(wl.shape, device="cuda")
    lp, ent = chunked_logprobs(xl, wl, targets, entropy=True, chunk_rows=300, chunk_vocab=5000, fuse_wgrad=True, **kw)
    ((lp * grad).sum() + (ent * grad * 0.1).sum()).backward()
    return xl.grad, wl.main_grad


def main() -> None:
    x, w, targets, grad = _problem(1)
    temps = 0.5 + torch.rand(T, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))
    print(
        "| mode | temperature, cap | dx default-eager (equal) | dx passes-eager (equal) | dx vs float64: default / passes / eager | main_grad vs float64: default / passes / eager |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for temperature, softcap, name in (
        (1.0, None, "1.0"),
        (0.7, None, "0.7"),
        (temps, None, "per token"),
        (temps, 10.0, "per token, cap 10"),
    ):
        _, _, dx64, dw64 = _float64(x, w, targets, grad, temperature, softcap, entropy_weight=0.1)
        for mode in ("fp32out", "fp32out-bf16grad"):
            kw = dict(mode=mode, temperature=temperature, softcap=softcap)
            d = call(x, w, targets, grad, {}, **kw)
            p = call(x, w, targets, grad, {STRIPS_ENV_VAR: "0"}, **kw)
            e = call(x, w, targets, grad, {TRITON_ENV_VAR: "0"}, **kw)

            def eq(a, b):
                return f"{(a == b).float().mean().item():.1%}"

            print(
                f"| {mode} | {name} | {_rel(d[0], e[0]):.2e} ({eq(d[0], e[0])}) | {_rel(p[0], e[0]):.2e} ({eq(p[0], e[0])}) "
                f"| {_rel(d[0], dx64):.3e} / {_rel(p[0], dx64):.3e} / {_rel(e[0], dx64):.3e} "
                f"| {_rel(d[1], dw64):.3e} / {_rel(p[1], dw64):.3e} / {_rel(e[1], dw64):.3e} |",
                flush=True,
            )
    print(f"(the float64 input gradient's own bf16 rounding: {_rel(dx64.bfloat16(), dx64):.3e})")


if __name__ == "__main__":
    main()
