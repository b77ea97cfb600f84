"""Prime-RL's fused LM head on one GPU: its bf16 chunks against fp32patch's chunked fp32 kernel.

Prime-RL's trainer computes per-token log-probs and entropy in ``FusedOutputLinear`` (and, for
soft-capped models, ``GemmaFusedOutputLinear``). ``PrimeBf16Chunks`` here is this file's own
re-implementation of that shape, read in Prime-RL's source (main 559b447, 2026-08-21), not its
code: ``chunk`` tokens (8192, ``fused_lm_head_token_chunk_size``'s default) by 8192 vocabulary
entries; each tile's logits from a bf16 GEMM, upcast to fp32, soft-capped (Gemma), multiplied by
the inverse per-token temperature and folded into an online logsumexp and entropy; the backward
recomputes each tile, forms the fp32 gradient, casts it to bf16 and accumulates both gradients
with bf16 GEMMs into bf16 buffers.

The patched head is ``fp32patch.runtime.prime_rl.head.fused_logprobs`` (what the wired
``FusedOutputLinear`` calls): ``kernels.chunked_logprobs`` in ``fp32out`` with the head's token
chunk. Three cases: one temperature for every token, per-sample temperatures, and Gemma's
soft-cap (all three on the kernel's Triton steps since 2026-12-05; the H100 run of that day, before,
had the last two on torch tile steps: 1.15x and 1.05x Prime-RL's time at 8,192 tokens).

For each shape and way: forward time, forward + backward time (loss = sum(adv * log p)), peak
memory above the inputs, the mean |Δ log p| of sampled tokens against float64, and the relative
error of the hidden-state gradient against float64. Timing: bench/lm_head.py's ``time_ms``,
``--rounds`` interleaved rounds, medians reported.

    python bench/prime_rl_head.py --out bench/out/prime-rl-head.json      # on a CUDA machine
    python bench/prime_rl_head.py --cpu --quick                           # a smoke run of the logic
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import lm_head  # noqa: E402  (time_ms, DEVICE)
from fp32patch.runtime.prime_rl.head import fused_logprobs  # noqa: E402

# (tokens, hidden, vocabulary): a Qwen3-8B-sized head at one and four chunks of tokens
SHAPES = [(8192, 4096, 151936), (32768, 4096, 151936)]
QUICK = [(128, 256, 2048)]
CHUNK = 8192
VOCAB_CHUNK = 8192
SOFTCAP = 30.0


class PrimeBf16Chunks(torch.autograd.Function):
    """Prime-RL's fused head's arithmetic (see the module doc): bf16 tiles upcast to fp32."""

    @staticmethod
    def forward(ctx, x, w, labels, inv_t, chunk, softcap):
        n, v = x.shape[0], w.shape[0]
        logp = torch.empty(n, device=x.device, dtype=torch.float32)
        ent = torch.empty_like(logp)
        logz = torch.empty_like(logp)
        for r0 in range(0, n, chunk):
            xr, yr, tr = x[r0 : r0 + chunk], labels[r0 : r0 + chunk], inv_t[r0 : r0 + chunk, None]
            m = torch.full((xr.shape[0],), float("-inf"), device=x.device)
            s = torch.zeros_like(m)
            t = torch.zeros_like(m)
            target = torch.zeros_like(m)
            for v0 in range(0, v, VOCAB_CHUNK):
                z = _tile(xr, w[v0 : v0 + VOCAB_CHUNK], tr, softcap)
                m_new = torch.maximum(m, z.amax(-1))
                scale = torch.exp(m - m_new)
                e = torch.exp(z - m_new[:, None])
                s = s * scale + e.sum(-1)
                t = t * scale + (e * z).sum(-1)
                m = m_new
                inside = (yr >= v0) & (yr < v0 + z.shape[1])
                picked = z.gather(1, (yr - v0).clamp(0, z.shape[1] - 1)[:, None])[:, 0]
                target = torch.where(inside, picked, target)
            lz = m + torch.log(s)
            logz[r0 : r0 + chunk], logp[r0 : r0 + chunk], ent[r0 : r0 + chunk] = lz, target - lz, lz - t / s
        ctx.save_for_backward(x, w, labels, inv_t, logz)
        ctx.chunk, ctx.softcap = chunk, softcap
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        x, w, labels, inv_t, logz = ctx.saved_tensors
        dx, dw = torch.zeros_like(x), torch.zeros_like(w)
        for r0 in range(0, x.shape[0], ctx.chunk):
            xr, yr = x[r0 : r0 + ctx.chunk], labels[r0 : r0 + ctx.chunk]
            tr, g = inv_t[r0 : r0 + ctx.chunk, None], grad_logp[r0 : r0 + ctx.chunk].float()
            for v0 in range(0, w.shape[0], VOCAB_CHUNK):
                wb = w[v0 : v0 + VOCAB_CHUNK]
                raw = (xr @ wb.t()).float()
                z = _capped(raw, ctx.softcap) * tr
                grad = -g[:, None] * torch.exp(z - logz[r0 : r0 + ctx.chunk, None])
                inside = ((yr >= v0) & (yr < v0 + wb.shape[0])).float()
                grad.scatter_add_(1, (yr - v0).clamp(0, wb.shape[0] - 1)[:, None], (g * inside)[:, None])
                grad = grad * tr
                if ctx.softcap is not None:
                    grad = grad * (1 - torch.tanh(raw / ctx.softcap) ** 2)
                dx[r0 : r0 + ctx.chunk].add_(grad.to(x.dtype) @ wb)
                dw[v0 : v0 + VOCAB_CHUNK].add_(grad.to(w.dtype).t() @ xr)
        return dx, dw, None, None, None, None


def _capped(z, softcap):
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _tile(xr, wb, inv_t, softcap):
    return _capped((xr @ wb.t()).float(), softcap) * inv_t


def prime_bf16(x, w, labels, temps, softcap):
    return PrimeBf16Chunks.apply(x, w, labels, 1.0 / temps, CHUNK, softcap)


def patched(x, w, labels, temps, softcap):
    logp, ent = fused_logprobs(x[None], w, labels[None], temps[None], "fp32out", softcap, CHUNK)
    return logp[0], ent[0]


# (name, function, per-sample temperatures, soft-cap)
WAYS = [
    ("prime-rl bf16", prime_bf16, False, None),
    ("fp32patch", patched, False, None),
    ("prime-rl bf16, per-sample T", prime_bf16, True, None),
    ("fp32patch, per-sample T", patched, True, None),
    ("prime-rl bf16, Gemma cap", prime_bf16, False, SOFTCAP),
    ("fp32patch, Gemma cap", patched, False, SOFTCAP),
]


def inputs(t, h, v, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(v, h, generator=gen) * (4.0 / h**0.5)).to(device, torch.bfloat16)
    labels = torch.randint(0, v, (t,), generator=gen).to(device)
    per_sample = torch.where(torch.arange(t) // 64 % 2 == 0, 0.7, 1.0).to(device)  # samples of 64 tokens
    advantages = torch.randn(t, generator=gen).to(device)
    return x, w, labels, per_sample, advantages


def float64(x, w, labels, temps, softcap, advantages, rows=1024):
    """Log-probs and the hidden-state gradient in float64, a block of rows at a time."""
    logps, grads = [], []
    w64 = w.double()
    for r0 in range(0, x.shape[0], rows):
        xr = x[r0 : r0 + rows].double().requires_grad_()
        z = _capped(xr @ w64.t(), softcap) / temps[r0 : r0 + rows, None].double()
        lp = torch.log_softmax(z, -1).gather(1, labels[r0 : r0 + rows, None])[:, 0]
        (lp * advantages[r0 : r0 + rows].double()).sum().backward()
        logps.append(lp.detach())
        grads.append(xr.grad)
    return torch.cat(logps), torch.cat(grads)


def measure_shape(t, h, v, args) -> dict:
    device = lm_head.DEVICE
    x, w, labels, per_sample, advantages = inputs(t, h, v, device)
    one = torch.full_like(per_sample, 0.7)
    block: dict = {"shape": {"tokens": t, "hidden": h, "vocab": v}, "ways": {}}
    refs: dict = {}
    for name, fn, per, cap in WAYS:
        temps = per_sample if per else one
        key = (per, cap)
        if key not in refs:
            refs[key] = float64(x, w, labels, temps, cap, advantages)
        ref_lp, ref_dx = refs[key]
        xg = x.clone().requires_grad_()
        lp, _ = fn(xg, w, labels, temps, cap)
        (lp * advantages).sum().backward()
        err = (lp.double() - ref_lp).abs().mean().item()
        dx_err = ((xg.grad.double() - ref_dx).norm() / ref_dx.norm()).item()
        wl = w.clone().requires_grad_()

        def fwd(fn=fn, temps=temps, cap=cap):
            with torch.no_grad():
                fn(x, w, labels, temps, cap)

        def fwd_bwd(fn=fn, temps=temps, cap=cap, wl=wl):
            xl = x.clone().requires_grad_()
            lp, _ = fn(xl, wl, labels, temps, cap)
            (lp * advantages).sum().backward()
            wl.grad = None

        row = {"mean_abs_dlogp": err, "dx_rel_err": dx_err, "fwd_ms": [], "fwd_bwd_ms": []}
        for _ in range(args.rounds):
            row["fwd_ms"].append(lm_head.time_ms(fwd, args.warmup, args.iters, args.min_ms))
            row["fwd_bwd_ms"].append(lm_head.time_ms(fwd_bwd, args.warmup, args.iters, args.min_ms))
        row["peak_bytes_fwd_bwd"] = _peak(fwd_bwd)
        block["ways"][name] = row
    for name, row in block["ways"].items():
        row["fwd_ms"] = statistics.median(row["fwd_ms"])
        row["fwd_bwd_ms"] = statistics.median(row["fwd_bwd_ms"])
        base = block["ways"][name.replace("fp32patch", "prime-rl bf16")]
        row["fwd_bwd_ratio"] = row["fwd_bwd_ms"] / base["fwd_bwd_ms"]
    return block


def _peak(step) -> int | None:
    if lm_head.DEVICE != "cuda":
        return None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def table(results: dict) -> str:
    lines = [
        "| shape | way | fwd ms | fwd+bwd ms | vs bf16 | peak GiB | mean abs dlogp | dx rel err |",
        "|---" * 8 + "|",
    ]
    for block in results["shapes"]:
        s = block["shape"]
        shape = f"{s['tokens']}x{s['hidden']}x{s['vocab']}"
        for name, r in block["ways"].items():
            peak = "-" if r["peak_bytes_fwd_bwd"] is None else f"{r['peak_bytes_fwd_bwd'] / 2**30:.2f}"
            lines.append(
                f"| {shape} | {name} | {r['fwd_ms']:.1f} | {r['fwd_bwd_ms']:.1f} | {r['fwd_bwd_ratio']:.2f} | {peak} "
                f"| {r['mean_abs_dlogp']:.2e} | {r['dx_rel_err']:.2e} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/prime-rl-head.json"))
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=3, help="timed calls per timing, at least")
    parser.add_argument("--min-ms", type=float, default=300.0, help="timed milliseconds per timing, at least")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; the median is reported")
    parser.add_argument("--quick", action="store_true", help="one small shape (a smoke run)")
    parser.add_argument("--tokens", type=int, nargs="+", help="only the shapes of these token counts")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke run; times not worth reading)")
    args = parser.parse_args(argv)
    if args.cpu or not torch.cuda.is_available():
        lm_head.DEVICE = "cpu"
        args.min_ms = 0.0
    known = QUICK if args.quick else SHAPES
    shapes = [s for s in known if not args.tokens or s[0] in args.tokens]
    if not shapes:
        parser.error(f"--tokens: no shape of {args.tokens} tokens; the shapes: {known}")
    results = {
        "settings": {**{k: str(v) for k, v in vars(args).items()}, "rounds": args.rounds, "chunk": CHUNK},
        "machine": {
            "device": torch.cuda.get_device_name() if lm_head.DEVICE == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
        },
        "shapes": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for t, h, v in shapes:  # written and printed after every shape: a run cut short keeps what it measured
        results["shapes"].append(measure_shape(t, h, v, args))
        args.out.write_text(json.dumps(results, indent=2))
        print(table({"shapes": results["shapes"][-1:]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
