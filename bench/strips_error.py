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

from bench import lm_head  # noqa: E402
from fp32patch.runtime.kernels.chunked_logprobs import STRIPS_ENV_VAR, chunked_logprobs  # noqa: E402
from fp32patch.runtime.kernels.fp32out import TRITON_ENV_VAR  # noqa: E402

T, H, V = 1000, 1024, 32768


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def problem(seed=1):
    x, w = lm_head.inputs(T, H, V, seed)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    log_p64 = torch.log_softmax(x.double() @ w.double().t(), -1)
    targets = torch.multinomial(log_p64.exp(), 1, generator=gen)[:, 0]
    return x, w, targets, torch.randn(T, device="cuda", generator=gen)


def grads64(x, w, targets, grad, temperature, softcap):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    z = x64 @ w64.t()
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    t = temperature.double()[:, None] if torch.is_tensor(temperature) else temperature
    log_p = torch.log_softmax(z / t, -1)
    lp, ent = log_p.gather(1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)
    ((lp * grad.double()).sum() + (ent * grad.double() * 0.1).sum()).backward()
    return x64.grad, w64.grad


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
    x, w, targets, grad = problem()
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
        dx64, dw64 = grads64(x, w, targets, grad, temperature, softcap)
        for mode in ("fp32out", "fp32out-bf16grad"):
            kw = dict(mode=mode, temperature=temperature, softcap=softcap)
            d = call(x, w, targets, grad, {}, **kw)
            p = call(x, w, targets, grad, {STRIPS_ENV_VAR: "0"}, **kw)
            e = call(x, w, targets, grad, {TRITON_ENV_VAR: "0"}, **kw)

            def eq(a, b):
                return f"{(a == b).float().mean().item():.1%}"

            print(
                f"| {mode} | {name} | {rel(d[0], e[0]):.2e} ({eq(d[0], e[0])}) | {rel(p[0], e[0]):.2e} ({eq(p[0], e[0])}) "
                f"| {rel(d[0], dx64):.3e} / {rel(p[0], dx64):.3e} / {rel(e[0], dx64):.3e} "
                f"| {rel(d[1], dw64):.3e} / {rel(p[1], dw64):.3e} / {rel(e[1], dw64):.3e} |",
                flush=True,
            )
    print(f"(the float64 input gradient's own bf16 rounding: {rel(dx64.bfloat16(), dx64):.3e})")


if __name__ == "__main__":
    main()
