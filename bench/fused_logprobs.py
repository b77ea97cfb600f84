"""Fused log-prob paths on one GPU: each stack's bf16 fused path, fp32patch's chunked fp32 path,
and the unfused heads, side by side.

For every way, at each shape: the time and the peak memory above the inputs of the log-prob
pass (no grad) and of forward + backward (loss = sum(grad_logp * log p), the gradients of the
hidden states and of the head weight), the mean |Δ log p| of sampled tokens against float64,
and the relative errors of the input and weight gradients against float64. Then a sweep of
this project's tile sizes.

The stacks' paths are this file's own re-implementations of the algorithms read in their
sources (2026-12; see each class), computing in the dtypes they compute in:

* NeMo-RL (``ChunkedDistributedHiddenStatesToLogprobs``, ``use_fused_linear_logprobs``): 256
  tokens a chunk (its example configs' ``fused_linear_logprobs_chunk_size``), bf16 logits cast
  to fp32, fp32 log-softmax; backward recomputes them, dX = dlogits @ W.float() and dW = the fp32
  product of x.float() and dlogits (IEEE fp32 GEMMs: NeMo-RL sets no TF32), dW added into a bf16
  buffer after every chunk;
* verl's torch backend (``FusedLinearForPPO``, 512 tokens a chunk): bf16 logits divided by the
  temperature in bf16, then fp32 softmax / log-softmax and the entropy; backward: fp32 dlogits
  cast to bf16 and divided by the temperature in bf16, bf16 GEMMs, dX and dW accumulated in bf16
  (verl 0.9.1, without flash-attn's cross entropy);
* TRL's ``ChunkedLogProbFunction`` (TRL 1.15+): bf16 tiles of 4096 tokens x 32768 vocabulary
  entries folded into an online logsumexp in fp32 (here by this project's fold kernel, run on
  the bf16 tile as TRL's kernel is), the gradient written back into the bf16 tile, both
  gradient GEMMs accumulated in fp32 (``addmm(out_dtype=float32)``) and cast once.
* SkyRL's ``FusedLinearChunkedDistributedLogprob`` (``fused_lm_head_logprob``, torch backend;
  ``SkyrlBf16``, for bench/step.py's whole step): 1,024 tokens a chunk, the temperature folded
  into the bf16 weight, fp32 log-softmax of bf16 logits, bf16 gradient GEMMs, dW accumulated in
  fp32.

Timing: CUDA events; each timing is the median of at least ``--iters`` calls and
``--min-ms`` of timed calls after ``--warmup`` calls (bench/lm_head.py's ``time_ms``); every
way is timed ``--rounds`` times, interleaved (round r starts r ways later), and the median over
rounds is reported.

    python bench/fused_logprobs.py --out bench/fused-h200.json
    python bench/fused_logprobs.py --cpu --quick          # a smoke run of the logic
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import lm_head  # noqa: E402  (time_ms, StockLinear)
from fp32patch.runtime.kernels.chunked_logprobs import (  # noqa: E402
    DEFAULT_CHUNK_ROWS,
    DEFAULT_CHUNK_VOCAB,
    GEMM_LSE_ENV_VAR,
    RowStats,
    chunked_logprobs,
    fold_tile,
    grad_tile,
)
from fp32patch.runtime.kernels.lm_head_gemm import lm_head_linear  # noqa: E402
from fp32patch.runtime.trl.fused import TILE as TRL_TILE  # noqa: E402

DEVICE = "cuda"
HIDDEN, VOCAB = 4096, 152064  # Qwen2.5-7B's hidden size and vocabulary
TOKENS = [16384, 65536]
QUICK = {"tokens": [300], "hidden": 64, "vocab": 3000}
SWEEP_ROWS = [4096, 8192, 16384, 32768]
SWEEP_VOCAB = [8192, 16384, 32768, 0]  # 0: the whole vocabulary in one block


# ---------------------------------------------------------------- the stacks' bf16 paths


class NemoRlBf16(torch.autograd.Function):
    """NeMo-RL's fused path at TP=1 on a packed batch-1 input ([S, 1, H] is [T, H] here)."""

    CHUNK = 256

    @staticmethod
    def _log_softmax(x_chunk: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        logits = torch.matmul(x_chunk, w.t()).float()
        shifted = logits - logits.amax(dim=-1, keepdim=True)
        return shifted - shifted.exp().sum(dim=-1, keepdim=True).log()

    @staticmethod
    def forward(ctx, x, w, targets):
        out = []
        for start in range(0, x.shape[0], NemoRlBf16.CHUNK):
            rows = slice(start, start + NemoRlBf16.CHUNK)
            log_p = NemoRlBf16._log_softmax(x[rows], w)
            out.append(log_p.gather(-1, targets[rows, None])[:, 0])
        ctx.save_for_backward(x, w, targets)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad):
        x, w, targets = ctx.saved_tensors
        dw = torch.zeros_like(w)  # bf16, as upstream's zeros_like(output_weight_layer)
        dx = []
        for start in range(0, x.shape[0], NemoRlBf16.CHUNK):
            rows = slice(start, start + NemoRlBf16.CHUNK)
            probs = NemoRlBf16._log_softmax(x[rows], w).exp()
            chosen = torch.nn.functional.one_hot(targets[rows], num_classes=w.shape[0])
            dlogits = chosen.float().sub_(probs).mul_(grad[rows, None])
            dx.append(torch.matmul(dlogits, w.float()))
            dw.add_(torch.einsum("sd,sv->dv", x[rows].float(), dlogits).t().contiguous())
        return torch.cat(dx), dw, None


class VerlTorchBf16(torch.autograd.Function):
    """verl 0.9.1's ``FusedLinearForPPOFunction`` (torch backend): log-probs fp32, entropy bf16."""

    CHUNK = 512

    @staticmethod
    def forward(ctx, x, w, targets, temperature):
        log_probs = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
        entropy = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
        for start in range(0, x.shape[0], VerlTorchBf16.CHUNK):
            rows = slice(start, start + VerlTorchBf16.CHUNK)
            logits = (x[rows] @ w.t()) / temperature
            z = logits.float()
            probs = z.softmax(dim=-1)
            log_probs[rows] = z.log_softmax(dim=-1).gather(-1, targets[rows, None])[:, 0]
            entropy[rows] = (torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)).to(x.dtype)
        ctx.save_for_backward(x, w, targets)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        x, w, targets = ctx.saved_tensors
        dx = torch.zeros_like(x)
        dw = torch.zeros_like(w)
        for start in range(0, x.shape[0], VerlTorchBf16.CHUNK):
            rows = slice(start, start + VerlTorchBf16.CHUNK)
            z = ((x[rows] @ w.t()) / ctx.temperature).float()
            probs = z.softmax(dim=-1)
            dlogits = torch.zeros_like(z)
            if grad_logp is not None:
                onehot = torch.zeros_like(z).scatter_(-1, targets[rows, None], 1)
                dlogits += grad_logp[rows].float()[:, None] * (onehot - probs)
            if grad_entropy is not None:
                ent = torch.logsumexp(z, dim=-1) - (probs * z).sum(dim=-1)
                dlogits += probs * (z.log_softmax(dim=-1) + ent[:, None]) * (-grad_entropy[rows].float()[:, None])
            dlogits = dlogits.to(x.dtype) / ctx.temperature
            dx[rows] += dlogits @ w
            dw += dlogits.t() @ x[rows]
        return dx, dw, None, None


def _addmm_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with the product kept in fp32 (TRL's ``_addmm_fp32``)."""
    if acc.device.type == "cuda":
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


class TrlBf16Tiles(torch.autograd.Function):
    """TRL's ``ChunkedLogProbFunction`` (log-probs only, no bias, soft-cap or logit scale)."""

    TOKENS, VOCAB = 4096, 32768

    @staticmethod
    def _tiles(x, w):
        for t0 in range(0, x.shape[0], TrlBf16Tiles.TOKENS):
            for v0 in range(0, w.shape[0], TrlBf16Tiles.VOCAB):
                yield slice(t0, t0 + TrlBf16Tiles.TOKENS), v0, slice(v0, v0 + TrlBf16Tiles.VOCAB)

    @staticmethod
    def forward(ctx, x, w, targets, temperature):
        stats = RowStats(x.shape[0], x.device, entropy=False)
        buf = torch.empty(min(x.shape[0], TrlBf16Tiles.TOKENS), TrlBf16Tiles.VOCAB, dtype=x.dtype, device=x.device)
        for rows, v0, cols in TrlBf16Tiles._tiles(x, w):
            xr, wc = x[rows], w[cols]
            tile = buf[: xr.shape[0], : wc.shape[0]]
            torch.mm(xr, wc.t(), out=tile)
            fold_tile(tile, targets[rows], v0, temperature, stats.rows(rows.start, rows.start + xr.shape[0]))
        log_z = stats.m + torch.log(stats.s)
        ctx.save_for_backward(x, w, targets, log_z)
        ctx.temperature = temperature
        return stats.target - log_z

    @staticmethod
    def backward(ctx, grad):
        x, w, targets, log_z = ctx.saved_tensors
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        grad = grad.float().contiguous()
        buf = torch.empty(min(x.shape[0], TrlBf16Tiles.TOKENS), TrlBf16Tiles.VOCAB, dtype=x.dtype, device=x.device)
        for rows, v0, cols in TrlBf16Tiles._tiles(x, w):
            xr, wc = x[rows], w[cols]
            tile = buf[: xr.shape[0], : wc.shape[0]]
            torch.mm(xr, wc.t(), out=tile)
            grad_tile(tile, targets[rows], v0, ctx.temperature, log_z[rows], None, grad[rows], None)
            _addmm_fp32(dx[rows], tile, wc)
            _addmm_fp32(dw[cols], tile.t(), xr)
        return dx.to(x.dtype), dw.to(w.dtype), None, None


class SkyrlBf16(torch.autograd.Function):
    """SkyRL 0.4.0's fused LM-head log-probs, torch backend (``fused_lm_head_logprob``, Megatron),
    at TP=1 on a packed batch-1 input: the temperature divides the bf16 weight (a new bf16
    weight), then per chunk of ``logprobs_chunk_size`` tokens (1,024 by default) the whole
    vocabulary's bf16 logits cast to fp32 and an fp32 log-softmax; the backward recomputes them,
    forms the fp32 gradient (minus the probabilities times the upstream gradient, plus it at the
    target), casts it to bf16, and takes dX from a bf16 GEMM and dW from a bf16 GEMM accumulated
    into an fp32 [V, H] buffer, cast to bf16 once (read in its 0.4.0 wheel, 2026-12; not its code)."""

    CHUNK = 1024
    _log_softmax = NemoRlBf16._log_softmax  # the same arithmetic: bf16 logits, fp32 log-softmax

    @staticmethod
    def forward(ctx, x, w, targets):
        out = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        for start in range(0, x.shape[0], SkyrlBf16.CHUNK):
            rows = slice(start, start + SkyrlBf16.CHUNK)
            out[rows] = SkyrlBf16._log_softmax(x[rows], w).gather(-1, targets[rows, None])[:, 0]
        ctx.save_for_backward(x, w, targets)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w, targets = ctx.saved_tensors
        dx = torch.empty_like(x)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for start in range(0, x.shape[0], SkyrlBf16.CHUNK):
            rows = slice(start, start + SkyrlBf16.CHUNK)
            g = SkyrlBf16._log_softmax(x[rows], w).exp_().neg_().mul_(grad[rows, None])
            g.scatter_add_(1, targets[rows, None], grad[rows, None])
            g = g.to(w.dtype)
            dx[rows] = g @ w
            dw.add_((g.t() @ x[rows]).float())
        return dx, dw.to(w.dtype), None


def skyrl_bf16(x, w, targets, temperature):
    """SkyRL's way of applying the temperature before its op: the weight divided, in bf16."""
    return SkyrlBf16.apply(x, w / temperature if temperature != 1.0 else w, targets)


# ---------------------------------------------------------------- the ways


@dataclass
class Way:
    """One log-prob path: ``fn(x, w, targets, fused_wgrad) -> log_probs``; ``main_grad``: its
    weight gradient is read from ``w.main_grad`` (fp32) for the error, else from ``w.grad``."""

    fn: Callable
    main_grad: bool = False
    parts: tuple[str, ...] = ("logprob", "train")
    errors_only: bool = False
    notes: dict = field(default_factory=dict)


TEMPERATURE = 1.0


def _unfused(mode: str) -> Callable:
    def fn(x, w, targets, fuse=False):
        logits = lm_head_linear(x, w, None, mode, fuse_wgrad=fuse)
        if TEMPERATURE != 1.0:
            logits.div_(TEMPERATURE)
        return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]

    return fn


def _unfused_bf16(x, w, targets, fuse=False):
    logits = lm_head.StockLinear.apply(x, w).float()
    if TEMPERATURE != 1.0:
        logits.div_(TEMPERATURE)
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]


def _ours(
    mode: str, entropy: bool = False, rows: int | None = None, vocab: int | None = None, tiles: bool = False
) -> Callable:
    """``tiles``: the forward writes and folds its tiles even where the fused GEMM + logsumexp
    kernel would run (FP32PATCH_GEMM_LSE=0), as before that kernel."""

    def fn(x, w, targets, fuse=False):
        with lm_head.env_set(GEMM_LSE_ENV_VAR, "0") if tiles else contextlib.nullcontext():
            out = chunked_logprobs(
                x,
                w,
                targets,
                mode=mode,
                temperature=TEMPERATURE,
                entropy=entropy,
                fuse_wgrad=fuse,
                chunk_rows=rows,
                chunk_vocab=vocab or None,
            )
        return out[0] if entropy else out

    return fn


WAYS: dict[str, Way] = {
    "NeMo-RL bf16 (256 rows)": Way(lambda x, w, t, fuse=False: NemoRlBf16.apply(x, w, t)),
    "verl torch bf16 (512 rows)": Way(lambda x, w, t, fuse=False: VerlTorchBf16.apply(x, w, t, TEMPERATURE)[0]),
    "TRL bf16 tiles (4096x32768)": Way(lambda x, w, t, fuse=False: TrlBf16Tiles.apply(x, w, t, TEMPERATURE)),
    "fp32patch fp32out": Way(_ours("fp32out"), main_grad=True),
    "fp32patch fp32out +entropy": Way(_ours("fp32out", entropy=True), main_grad=True),
    "fp32patch fp32out, tiled forward": Way(_ours("fp32out", tiles=True), main_grad=True),
    "fp32patch fp32out, TRL's tile": Way(_ours("fp32out", rows=TRL_TILE[0], vocab=TRL_TILE[1]), main_grad=True),
    "fp32patch fp32out-bf16grad": Way(_ours("fp32out-bf16grad"), main_grad=True, parts=("train",)),
    "unfused fp32out head": Way(_unfused("fp32out"), main_grad=True),
    "unfused bf16 head": Way(_unfused_bf16),
    "unfused tf32 head": Way(_unfused("tf32"), main_grad=True, errors_only=True),
}


# ---------------------------------------------------------------- measuring


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _clean() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


def inputs(t: int, hdim: int, v: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 hidden states and head giving logits of real models' size (mean max |z| ~ 27), and
    a per-token upstream gradient (advantage-like)."""
    x, w = lm_head.inputs(t, hdim, v, seed)
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    grad = torch.randn(t, device=DEVICE, generator=gen)
    return x, w, grad


def reference(x, w, grad, chunk: int = 1024, seed: int = 2) -> dict:
    """float64: targets sampled from the model, their log-probs, and the gradients of
    sum(grad * log p) with respect to the hidden states and the weight."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w64 = w.double()
    dw = torch.zeros_like(w64)
    dx = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    targets, log_probs = [], []
    for start in range(0, x.shape[0], chunk):
        rows = slice(start, start + chunk)
        x64 = x[rows].double()
        log_p = torch.log_softmax((x64 @ w64.t()) / TEMPERATURE, dim=-1)
        p = log_p.exp()
        tk = torch.multinomial(p, 1, generator=gen)
        targets.append(tk[:, 0])
        log_probs.append(log_p.gather(1, tk)[:, 0])
        dlogits = -p.mul_(grad[rows].double()[:, None])
        dlogits.scatter_add_(1, tk, grad[rows].double()[:, None])
        dlogits /= TEMPERATURE
        dx[rows] = dlogits @ w64
        dw.addmm_(dlogits.t(), x64)
        del log_p, p, dlogits
    return {"targets": torch.cat(targets), "log_probs": torch.cat(log_probs), "dx": dx, "dw": dw}


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def errors(way: Way, x, w, grad, ref) -> dict:
    """mean/max |Δ log p| of the log-prob pass; relative dX and dW errors of a backward."""
    with torch.no_grad():
        lp = way.fn(x, w, ref["targets"])
    err = (lp.double() - ref["log_probs"]).abs()
    out = {"mean_abs_dlogp": err.mean().item(), "max_abs_dlogp": err.max().item()}
    del lp, err
    xl = x.clone().requires_grad_()
    wl = torch.nn.Parameter(w.clone())
    if way.main_grad:
        wl.main_grad = torch.zeros(wl.shape, dtype=torch.float32, device=wl.device)
    (way.fn(xl, wl, ref["targets"], way.main_grad) * grad).sum().backward()
    dw = wl.main_grad if way.main_grad else wl.grad
    out.update(
        rel_err_dx=rel(xl.grad, ref["dx"]),
        rel_err_dw=rel(dw, ref["dw"]),
        dw_delivered="main_grad fp32" if way.main_grad else f"grad {str(dw.dtype).removeprefix('torch.')}",
    )
    return out


def steps(way: Way, x, w, grad, targets) -> dict[str, Callable[[], None]]:
    xl = x.clone().requires_grad_()
    wl = torch.nn.Parameter(w.clone())

    def logprob() -> None:
        with torch.no_grad():
            way.fn(x, w, targets)

    def train() -> None:
        (way.fn(xl, wl, targets) * grad).sum().backward()
        xl.grad = None
        wl.grad = None

    return {"logprob": logprob, "train": train}


def peak_bytes(step: Callable[[], None]) -> int:
    """Peak device memory above what was allocated before ``step`` (the inputs)."""
    _clean()
    base = _allocated()
    step()
    _sync()
    return _peak() - base


def guarded(fn: Callable[[], object]) -> object:
    """``fn()``, or the error's name (an out-of-memory way is recorded, not fatal)."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        _clean()
        return "out of memory"


def measure_shape(t: int, hdim: int, v: int, args) -> dict:
    x, w, grad = inputs(t, hdim, v)
    started = time.perf_counter()
    ref = reference(x, w, grad)
    ref_s = time.perf_counter() - started
    targets = ref["targets"]
    rows = {name: {} for name in WAYS}
    for name, way in WAYS.items():
        rows[name]["errors"] = guarded(lambda way=way, ref=ref: errors(way, x, w, grad, ref))
        _clean()
        print(f"  errors {name}: {rows[name]['errors']}", flush=True)
    del ref
    _clean()
    timed = {name: way for name, way in WAYS.items() if not way.errors_only}
    for part in ("logprob", "train"):
        fns = {name: steps(way, x, w, grad, targets)[part] for name, way in timed.items() if part in way.parts}
        for name, fn in fns.items():
            rows[name][f"{part}_peak_bytes"] = guarded(lambda fn=fn: peak_bytes(fn))
        times: dict[str, list] = {name: [] for name in fns}
        names = list(fns)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                _clean()
                times[name].append(
                    guarded(lambda fn=fns[name]: lm_head.time_ms(fn, args.warmup, args.iters, args.min_ms))
                )
        for name, ms in times.items():
            ok = [m for m in ms if isinstance(m, float)]
            rows[name][f"{part}_ms"] = statistics.median(ok) if ok else ms[0]
            rows[name][f"{part}_ms_rounds"] = ms
        print(f"  timed {part}", flush=True)
    sweep = measure_sweep(x, w, grad, targets, args) if args.sweep else []
    return {
        "shape": {"tokens": t, "hidden": hdim, "vocab": v},
        "temperature": TEMPERATURE,
        "reference_seconds": ref_s,
        "ways": rows,
        "sweep": sweep,
    }


def measure_sweep(x, w, grad, targets, args) -> list[dict]:
    out = []
    for r in args.sweep_rows:
        if r > x.shape[0] and r != args.sweep_rows[0]:
            continue
        for c in args.sweep_vocab:
            way = Way(_ours("fp32out", rows=r, vocab=c or w.shape[0]))
            entry = {"chunk_rows": r, "chunk_vocab": c or w.shape[0]}
            for part, fn in steps(way, x, w, grad, targets).items():
                entry[f"{part}_peak_bytes"] = guarded(lambda fn=fn: peak_bytes(fn))
                entry[f"{part}_ms"] = guarded(lambda fn=fn: lm_head.time_ms(fn, args.warmup, args.iters, args.min_ms))
            out.append(entry)
            print(f"  sweep {entry}", flush=True)
    return out


# ---------------------------------------------------------------- report


def _gib(b) -> str:
    return f"{b / 2**30:.2f}" if isinstance(b, int) else str(b)


def _ms(m) -> str:
    return f"{m:.1f}" if isinstance(m, float) else str(m)


def _way_rows(block: dict) -> list[str]:
    s = block["shape"]
    rows = [
        f"\nT={s['tokens']} H={s['hidden']} V={s['vocab']}",
        f"{'way':<30}{'logprob ms':>11}{'GiB':>7}{'fwd+bwd ms':>11}{'GiB':>7}"
        f"{'mean|dlogp|':>12}{'err dx':>9}{'err dW':>9}  dW as",
    ]
    for name, r in block["ways"].items():
        e = r["errors"] if isinstance(r["errors"], dict) else {}
        nan = float("nan")
        rows.append(
            f"{name:<30}{_ms(r.get('logprob_ms', '-')):>11}{_gib(r.get('logprob_peak_bytes', '-')):>7}"
            f"{_ms(r.get('train_ms', '-')):>11}{_gib(r.get('train_peak_bytes', '-')):>7}"
            f"{e.get('mean_abs_dlogp', nan):>12.2e}{e.get('rel_err_dx', nan):>9.2e}{e.get('rel_err_dw', nan):>9.2e}"
            f"  {e.get('dw_delivered', r['errors'] if not e else '')}"
        )
    return rows


def _sweep_rows(block: dict) -> list[str]:
    if not block["sweep"]:
        return []
    rows = [f"{'tile rows x vocab':<30}{'logprob ms':>11}{'GiB':>7}{'fwd+bwd ms':>11}{'GiB':>7}"]
    for e in block["sweep"]:
        tile = f"{e['chunk_rows']} x {e['chunk_vocab']}"
        rows.append(
            f"{tile:<30}{_ms(e['logprob_ms']):>11}{_gib(e['logprob_peak_bytes']):>7}"
            f"{_ms(e['train_ms']):>11}{_gib(e['train_peak_bytes']):>7}"
        )
    return rows


def table(results: dict) -> str:
    return "\n".join(line for block in results["shapes"] for line in _way_rows(block) + _sweep_rows(block))


def _machine() -> dict:
    """The device and the versions the numbers depend on (Triton's too: the per-tile kernels)."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, memory_mib=props.total_memory // 2**20)
    else:
        info["gpu"] = f"none (CPU: {platform.processor() or platform.machine()})"
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    return info


def main() -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/fused.json"))
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iters", type=int, default=1, help="timed calls per timing, at least")
    parser.add_argument("--min-ms", type=float, default=300.0, help="timed milliseconds per timing, at least")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the median is reported")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the tile-size sweep")
    parser.add_argument("--sweep-rows", type=int, nargs="+", default=SWEEP_ROWS, help="tile rows to sweep")
    parser.add_argument(
        "--sweep-vocab", type=int, nargs="+", default=SWEEP_VOCAB, help="tile vocabulary entries to sweep (0: all)"
    )
    parser.add_argument("--quick", action="store_true", help="one small shape (a smoke run)")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke run; times not worth reading)")
    args = parser.parse_args()
    if args.cpu:
        DEVICE = "cpu"
        args.min_ms = 0.0
    elif not torch.cuda.is_available():
        print("bench/fused_logprobs.py needs a CUDA GPU (or --cpu --quick for a smoke run)", file=sys.stderr)
        return 2
    lm_head.DEVICE = DEVICE
    if args.quick:
        args.tokens, args.hidden, args.vocab = QUICK["tokens"], QUICK["hidden"], QUICK["vocab"]
        args.sweep_rows, args.sweep_vocab = [64, 128], [512, 0]
    torch.backends.cuda.matmul.allow_tf32 = False  # the ways set what they need themselves
    results = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "settings": {
            "warmup": args.warmup,
            "iters": args.iters,
            "min_ms": args.min_ms,
            "rounds": args.rounds,
            "default_tile": [DEFAULT_CHUNK_ROWS, DEFAULT_CHUNK_VOCAB],
        },
        "shapes": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for t in args.tokens:
        print(f"T={t} H={args.hidden} V={args.vocab}", flush=True)
        results["shapes"].append(measure_shape(t, args.hidden, args.vocab, args))
        args.out.write_text(json.dumps(results, indent=2))  # after every shape: a cut run keeps its part
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
