"""LM-head benchmark: every way of getting fp32 logits, side by side, on one GPU.

Everything runs through the project's own runtime functions:

* inference (the vLLM side): ``fp32patch.runtime.vllm_lm_head.compute_logits`` on a model
  whose head and logits processor have vLLM's shapes, with ``NRL_VLLM_FP32_LM_HEAD`` set to
  each way (``0`` is vLLM's stock bf16 GEMM; "tf32 copy" is the ``copy`` way with TF32
  allowed, the original design's fast variant);
* training (the Megatron side): ``fp32patch.runtime.lm_head_gemm.lm_head_linear``, the GEMM
  ``apply_fp32_lm_head`` installs in Megatron's output layer, forward and backward, against
  the stock bf16 ``x @ W.T``;
* the PyTorch/HF head (NeMo-RL's DTensor workers): an ``nn.Linear`` converted by
  ``fp32patch.runtime.hf_lm_head.apply_fp32_lm_head``, under bf16 autocast, handed fp32
  hidden states as FSDP2's ``output_dtype=float32`` hands them, against the same stock
  ``nn.Linear`` whose bf16 logits the trainer casts to fp32: the log-prob pass (no grad) and
  forward + backward, on untied heads and a tied one (Qwen2.5-1.5B's).

Each shape is measured in one run: CUDA-event times (median over at least ``--iters``
calls and ``--min-ms`` of timed calls, after ``--warmup``) as a ratio to the bf16 GEMM,
extra device memory, and the mean |Δ log p| of sampled tokens against a float64
reference. The ways of a shape are timed ``--rounds`` times, interleaved (each round
starts one way later), each time next to a bf16 timing of its own, and each ratio is the
median over rounds of the way's time over that paired bf16 time. The train/generation
agreement puts the same hidden states through both sides and reports mean exp(|Δ log p|)
between them: one head's rounding alone (bf16 against bf16 is 1 by construction); two
engines whose hidden states differ are measured by bench/agreement.py.

    python bench/lm_head.py --out bench/out/results.json [--plot bench/out/plot.png] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp32patch.runtime import fp32out, hf_lm_head, vllm_lm_head  # noqa: E402
from fp32patch.runtime.lm_head_gemm import lm_head_linear  # noqa: E402
from fp32patch.runtime.matmul_precision import cuda_tf32  # noqa: E402

SHAPES = [  # (tokens, hidden, vocab)
    (16384, 4096, 131072),
    (16384, 4096, 32768),  # one rank of a 131072 vocabulary under TP=4
    (16384, 8192, 131072),
]
QUICK = [(2048, 1024, 8192)]
INFER_WAYS = ["bf16", "bf16+float", "fp32 copy", "tf32 copy", "fp32out", "fp32out generic"]
# "fp32out" is the NemotronH patch's route (compute_logits); "fp32out generic" the
# vllm-fp32-logits patch's, as the patched LogitsProcessor._get_logits runs it (vLLM <= 0.25)
# "bf16" is the GEMM alone; "bf16+casts" is the stock head as a trainer runs it: the loss
# upcasts the bf16 logits to fp32 and the gradient comes back cast to bf16
TRAIN_WAYS = ["bf16", "bf16+casts", "fp32", "tf32", "fp32out", "fp32out-hilo", "fp32out-bf16grad"]
# the PyTorch/HF head: (tokens, hidden, vocab, tied to the embeddings)
HF_SHAPES = [(16384, 4096, 131072, False), (16384, 4096, 32768, False), (16384, 1536, 151936, True)]
HF_QUICK = [(2048, 1024, 8192, False), (2048, 512, 8192, True)]
# "bf16" is the stock nn.Linear under autocast, its logits cast to fp32 by the trainer
HF_WAYS = ["bf16", "fp32out", "fp32out-bf16grad"]


# ---------------------------------------------------------------- vLLM-shaped stand-ins


class UnquantizedEmbeddingMethod:
    """vLLM's unquantized head method (the runtime reads the class name): a bf16 GEMM."""

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(x, layer.weight, bias)


class LmHead(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.quant_method = UnquantizedEmbeddingMethod()


class LogitsProcessor:
    """vLLM's processor reduced to what a TP=1 head with no padding, scale or cap does."""

    def __call__(self, lm_head, hidden_states):
        return lm_head.quant_method.apply(lm_head, hidden_states)


class PatchedLogitsProcessor:
    """vLLM 0.25's LogitsProcessor._get_logits as vllm-fp32-logits patches it, at TP=1."""

    def __call__(self, lm_head, hidden_states):
        lm_head = vllm_lm_head.fp32_head(self, lm_head, hidden_states)
        return lm_head.quant_method.apply(lm_head, hidden_states, bias=None)


class Model(torch.nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.lm_head = LmHead(weight)
        self.logits_processor = LogitsProcessor()
        self.generic_processor = PatchedLogitsProcessor()


@contextlib.contextmanager
def env_set(name: str, value: str):
    """The environment variable ``name`` set to ``value`` inside, as it was after."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def env_way(value: str):
    return env_set(vllm_lm_head.ENV, value)


def infer(way: str, model: Model, h: torch.Tensor) -> torch.Tensor:
    if way == "bf16":
        with env_way("0"):
            return vllm_lm_head.compute_logits(model, h)
    if way == "bf16+float":
        with env_way("0"):
            return vllm_lm_head.compute_logits(model, h).float()
    if way in ("fp32 copy", "tf32 copy"):
        with env_way("copy"), cuda_tf32(way == "tf32 copy"):
            return vllm_lm_head.compute_logits(model, h)
    if way == "fp32out generic":
        with env_way("fp32out"):
            return model.generic_processor(model.lm_head, h)
    with env_way("fp32out"):
        return vllm_lm_head.compute_logits(model, h)


# ---------------------------------------------------------------- measuring


DEVICE = "cuda"


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _allocated() -> int:
    return torch.cuda.memory_allocated() if DEVICE == "cuda" else 0


def _peak() -> int:
    return torch.cuda.max_memory_allocated() if DEVICE == "cuda" else 0


def _reset_peak() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def time_ms(fn, warmup: int, iters: int, min_ms: float = 0.0) -> float:
    """Median time of one call of ``fn``, in ms, over at least ``iters`` calls and at least
    ``min_ms`` of timed calls (so that a fast way is not judged on a few milliseconds)."""
    for _ in range(warmup):
        fn()
    _sync()
    times: list[float] = []
    while len(times) < iters or (sum(times) < min_ms and len(times) < 1000):
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:  # a CPU smoke run checks the logic, not the speed
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sampled_tokens(ref_logits64: torch.Tensor, seed: int = 0, chunk: int = 2048) -> torch.Tensor:
    gen = torch.Generator(device=ref_logits64.device).manual_seed(seed)
    out = []
    for i in range(0, ref_logits64.shape[0], chunk):
        probs = torch.softmax(ref_logits64[i : i + chunk], dim=-1)
        out.append(torch.multinomial(probs, 1, generator=gen).squeeze(1))
    return torch.cat(out)


def token_logp(logits: torch.Tensor, tokens: torch.Tensor, chunk: int = 2048) -> torch.Tensor:
    """log p(token) per row, computed in float64 from ``logits`` as they are."""
    out = []
    for i in range(0, logits.shape[0], chunk):
        lp = torch.log_softmax(logits[i : i + chunk].double(), dim=-1)
        out.append(lp.gather(1, tokens[i : i + chunk, None]).squeeze(1))
    return torch.cat(out)


def reference64(h: torch.Tensor, w: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    w64 = w.double()
    return torch.cat([h[i : i + chunk].double() @ w64.t() for i in range(0, h.shape[0], chunk)])


def inputs(t: int, hdim: int, v: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states and a head that give logits of the size real models have (|z| ~ 15-30)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    h = torch.randn(t, hdim, device=DEVICE, generator=gen).bfloat16()
    w = (torch.randn(v, hdim, device=DEVICE, generator=gen) * (6.0 / hdim**0.5)).bfloat16()
    return h, w


def bench_inference(shape, warmup, iters, rounds: int = 1, min_ms: float = 0.0) -> dict:
    t, hdim, v = shape
    h, w = inputs(t, hdim, v)
    model = Model(w)
    ref = reference64(h, w)
    tokens = sampled_tokens(ref)
    ref_lp = token_logp(ref, tokens)
    logits_max = ref.abs().amax(dim=-1).mean().item()
    del ref
    rows = {}
    for way in INFER_WAYS:
        _sync()
        _reset_peak()
        base = _allocated()
        out = infer(way, model, h)  # also builds the copy of the copy ways
        out_bytes = out.numel() * out.element_size()
        del out
        _sync()
        persistent = _allocated() - base  # what the way keeps between calls
        _reset_peak()
        base2 = _allocated()
        out = infer(way, model, h)
        _sync()
        transient = _peak() - base2 - out_bytes
        err = (token_logp(out, tokens) - ref_lp).abs()
        rows[way] = {
            "extra_bytes_persistent": persistent,
            "extra_bytes_transient": max(transient, 0),
            "logits_dtype": str(out.dtype).removeprefix("torch."),
            "mean_abs_dlogp": err.mean().item(),
            "max_abs_dlogp": err.max().item(),
        }
        del out
        if way.endswith("copy"):
            vllm_lm_head_reset(model)
    # timed after the memory figures, interleaved (the copy ways rebuild their copy during
    # their warm-up when another way dropped it)
    times, paired = time_rounds(
        {way: (lambda way=way: infer(way, model, h)) for way in INFER_WAYS}, warmup, iters, rounds, min_ms
    )
    vllm_lm_head_reset(model)
    _add_times(rows, times, paired)
    return {"shape": {"tokens": t, "hidden": hdim, "vocab": v}, "mean_max_abs_logit": logits_max, "ways": rows}


def _add_times(rows: dict, times: dict[str, list[float]], paired: dict[str, list[float]]) -> None:
    """Each way's median time and its ratio to bf16: the median over rounds of the way's
    time over the bf16 time taken next to it (``time_rounds``), with the smallest and
    largest of those."""
    for way, row in rows.items():
        ratios = [ms / base for ms, base in zip(times[way], paired[way], strict=True)]
        row.update(
            ms=statistics.median(times[way]),
            ratio=statistics.median(ratios),
            ratio_min=min(ratios),
            ratio_max=max(ratios),
            ms_rounds=times[way],
        )


def vllm_lm_head_reset(model: Model) -> None:
    """Drop the runtime's state (and its fp32 copy) so the next way starts clean."""
    model.lm_head.__dict__.pop("_fp32patch_state", None)
    _reset_peak()


class StockLinear(torch.autograd.Function):
    """Megatron-Core's output layer as it runs without fp32patch (one GPU, no wgrad fusion):
    ``x @ W.T`` forward; ``g @ W`` and ``g.T @ x`` backward, each one bf16 GEMM, the weight
    gradient made in W's layout (as ``LinearWithGradAccumulationAndAsyncCommunication``
    does), rather than whatever autograd's ``matmul`` backward chooses."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return g.matmul(w), g.t().matmul(x)


def train_step(way: str, x: torch.Tensor, w: torch.Tensor, grad32: torch.Tensor, grad16: torch.Tensor) -> None:
    if way == "bf16":  # Megatron's stock output layer: bf16 GEMMs, bf16 logits and gradient
        logits = StockLinear.apply(x, w)
        logits.backward(grad16)
    elif way == "bf16+casts":
        logits = StockLinear.apply(x, w).float()
        logits.backward(grad32)
    else:
        logits = lm_head_linear(x, w, None, way)
        logits.backward(grad32)
    x.grad = None
    w.grad = None


BASELINE = "bf16"


def time_rounds(
    fns: dict, warmup: int, iters: int, rounds: int, min_ms: float = 0.0
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``time_ms`` of every function, ``rounds`` times over, interleaved, each against a bf16
    time of its own: returns (times, paired), where ``paired[name][r]`` is the bf16 time
    taken next to ``times[name][r]``.

    Round r starts at the r-th function, so that no way always follows the same one, and
    times each way right after a fresh bf16 run (right before it in odd rounds): a GPU's
    clocks follow its recent power draw, so a way timed after the fp32 GEMMs reads slower
    than the same way timed cool, and its ratio is only fair against a bf16 time taken in
    the same state. ``times[BASELINE]`` holds every bf16 time taken."""
    names = [name for name in fns if name != BASELINE]
    times: dict[str, list[float]] = {BASELINE: [], **{name: [] for name in names}}
    paired: dict[str, list[float]] = {name: [] for name in names}

    def timed(name: str) -> float:
        _sync()
        t = time_ms(fns[name], warmup, iters, min_ms)
        times[name].append(t)
        return t

    for r in range(rounds):
        k = r % max(len(names), 1)
        for name in names[k:] + names[:k]:
            if r % 2 == 0:
                paired[name].append(timed(BASELINE))
                timed(name)
            else:
                timed(name)
                paired[name].append(timed(BASELINE))
    paired[BASELINE] = times[BASELINE]
    return times, paired


def bench_training(shape, warmup, iters, ways=TRAIN_WAYS, rounds: int = 1, min_ms: float = 0.0) -> dict:
    t, hdim, v = shape
    h, w0 = inputs(t, hdim, v, seed=1)
    x = h.clone().requires_grad_(True)
    w = w0.clone().requires_grad_(True)
    # dLoss/dlogits of a cross entropy: softmax minus one-hot, over the tokens
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    grad32 = torch.softmax(torch.randn(t, v, device=DEVICE, generator=gen) * 4, dim=-1)
    grad32[torch.arange(t, device=DEVICE), torch.randint(0, v, (t,), device=DEVICE, generator=gen)] -= 1.0
    grad32 /= t
    grad16 = grad32.bfloat16()
    # float64 reference gradients, to report each way's backward error
    dx64 = torch.cat([grad32[i : i + 4096].double() @ w0.double() for i in range(0, t, 4096)])
    dw64 = grad32.double().t() @ h.double()
    rows = {}
    for way in ways:
        # errors as a trainer with gradient-accumulation fusion sees them: the input
        # gradient in bf16, the weight gradient accumulated in fp32 (main_grad)
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        if way in ("bf16", "bf16+casts"):  # Megatron's fused wgrad: bf16 operands, fp32 accumulation
            StockLinear.apply(x, w).backward(grad16, inputs=[x])
            w.main_grad += fp32out.mm(grad16.t().contiguous(), x.detach())
        else:
            lm_head_linear(x, w, None, way, fuse_wgrad=True).backward(grad32)
        dx_err = ((x.grad.double() - dx64).norm() / dx64.norm()).item()
        dw_err = ((w.main_grad.double() - dw64).norm() / dw64.norm()).item()
        x.grad = None
        w.grad = None
        del w.main_grad
        rows[way] = {"rel_err_dx": dx_err, "rel_err_dw_main_grad": dw_err}
    del dx64, dw64
    _reset_peak()
    times, paired = time_rounds(
        {way: (lambda way=way: train_step(way, x, w, grad32, grad16)) for way in ways}, warmup, iters, rounds, min_ms
    )
    _add_times(rows, times, paired)
    return {"shape": {"tokens": t, "hidden": hdim, "vocab": v}, "rounds": rounds, "ways": rows}


class HfCausalLM(torch.nn.Module):
    """The two modules of a Hugging Face causal LM that the head touches: the embedding (tied
    to the head when ``tied``) and ``lm_head``, found through ``get_output_embeddings()``."""

    def __init__(self, weight: torch.Tensor, tied: bool) -> None:
        super().__init__()
        v, hdim = weight.shape
        self.embed_tokens = torch.nn.Embedding(v, hdim, device=weight.device, dtype=weight.dtype)
        self.lm_head = torch.nn.Linear(hdim, v, bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.lm_head.weight.copy_(weight)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight
            with torch.no_grad():
                self.embed_tokens.weight.copy_(weight)

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


def hf_logits(model: HfCausalLM, h: torch.Tensor) -> torch.Tensor:
    """The head as NeMo-RL's DTensor worker runs it: under bf16 autocast, then fp32 logits
    (the stock head's bf16 ones cast, as the log-prob and loss code does)."""
    with torch.autocast(device_type=DEVICE, dtype=torch.bfloat16):
        logits = model.lm_head(h)
    return logits.float()


def bench_hf_head(shape, warmup, iters, ways=HF_WAYS, rounds: int = 1, min_ms: float = 0.0) -> dict:
    """Each way of the PyTorch/HF head: the log-prob pass (no grad) and forward + backward,
    timed as ``bench_training`` times its ways; the fp32 ways keep 0 bytes between calls."""
    t, hdim, v, tied = shape
    h16, w = inputs(t, hdim, v, seed=5)
    h = h16.float()  # what FSDP2's output_dtype=float32 hands the head
    models = {way: HfCausalLM(w, tied) for way in ways}
    for way, model in models.items():
        hf_lm_head.apply_fp32_lm_head(model, None if way == BASELINE else way)
    ref = reference64(h16, w)
    tokens = sampled_tokens(ref, seed=6)
    ref_lp = token_logp(ref, tokens)
    del ref
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    grad = torch.softmax(torch.randn(t, v, device=DEVICE, generator=gen) * 4, dim=-1) / t
    x = h.clone().requires_grad_(True)
    rows = {}
    for way, model in models.items():
        _sync()
        _reset_peak()
        base = _allocated()
        with torch.no_grad():
            out = hf_logits(model, h)
        err = (token_logp(out, tokens) - ref_lp).abs()
        rows[way] = {"mean_abs_dlogp": err.mean().item(), "max_abs_dlogp": err.max().item()}
        del out, err
        _sync()
        rows[way]["extra_bytes_persistent"] = _allocated() - base  # what the way keeps between calls

    def infer_step(model: HfCausalLM) -> None:
        with torch.no_grad():
            hf_logits(model, h)

    def train_step_hf(model: HfCausalLM) -> None:
        hf_logits(model, x).backward(grad)
        x.grad = None
        model.lm_head.weight.grad = None

    out: dict = {"shape": {"tokens": t, "hidden": hdim, "vocab": v, "tied": tied}, "rounds": rounds}
    for part, step in (("inference", infer_step), ("training", train_step_hf)):
        times, paired = time_rounds(
            {way: (lambda model=model, step=step: step(model)) for way, model in models.items()},
            warmup,
            iters,
            rounds,
            min_ms,
        )
        part_rows = {way: dict(rows[way]) for way in ways}
        _add_times(part_rows, times, paired)
        out[part] = part_rows
    return out


def agreement(shape, decode_rows: int = 512) -> dict:
    """Same hidden states through the vLLM side (in decode-sized batches) and the Megatron
    side (the whole sequence): mean exp(|Δ log p|) of sampled tokens between them."""
    t, hdim, v = shape
    h, w = inputs(t, hdim, v, seed=3)
    model = Model(w)
    ref = reference64(h, w)
    tokens = sampled_tokens(ref, seed=4)
    del ref

    def vllm_side(way: str) -> torch.Tensor:
        return torch.cat([infer(way, model, h[i : i + decode_rows]) for i in range(0, t, decode_rows)])

    def megatron_side(mode: str) -> torch.Tensor:
        with torch.no_grad():
            if mode == "bf16":
                return torch.matmul(h, w.t())
            return lm_head_linear(h, w, None, mode)

    pairs = {
        "bf16 / bf16": ("bf16", "bf16"),
        "fp32out / fp32out": ("fp32out", "fp32out"),
        "fp32out / fp32": ("fp32out", "fp32"),
        "fp32out / bf16 (one side only)": ("fp32out", "bf16"),
        "bf16 / fp32out (one side only)": ("bf16", "fp32out"),
    }
    out = {}
    for name, (gen_way, train_mode) in pairs.items():
        a = token_logp(vllm_side(gen_way), tokens)
        b = token_logp(megatron_side(train_mode), tokens)
        out[name] = {
            "mean_exp_abs_dlogp": torch.exp((a - b).abs()).mean().item(),
            "max_abs_dlogp": (a - b).abs().max().item(),
        }
    vllm_lm_head_reset(model)
    return {"shape": {"tokens": t, "hidden": hdim, "vocab": v}, "decode_rows": decode_rows, "pairs": out}


def pyplot(path: Path):
    """matplotlib's pyplot on the file backend, or None (with a line saying so) where
    matplotlib is not installed: the plot for ``path`` is then skipped."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(results: dict, path: Path) -> None:
    plt = pyplot(path)
    if plt is None:
        return

    first = results["inference"][0]
    train = results["training"][0] if results["training"] else None
    fig, axes = plt.subplots(1, 2 if train else 1, figsize=(13 if train else 7, 4.5), squeeze=False)
    ax = axes[0][0]
    _points(ax, [(way, row["ratio"], row["mean_abs_dlogp"]) for way, row in first["ways"].items()])
    ax.set_xscale("log")
    ax.set_yscale("log")
    s = first["shape"]
    ax.set_xlabel("time / bf16 GEMM time")
    ax.set_ylabel("mean |Δ log p| vs float64 (sampled tokens)")
    ax.set_title(f"logits on {results['machine']['gpu']}: T={s['tokens']}, H={s['hidden']}, V={s['vocab']}")
    ax.grid(True, which="both", alpha=0.3)
    if train:
        ax = axes[0][1]
        _points(ax, [(way, row["ratio"], row["rel_err_dw_main_grad"]) for way, row in train["ways"].items()])
        ax.set_xscale("log")
        ax.set_yscale("log")
        s = train["shape"]
        ax.set_xlabel("forward + backward time / bf16 GEMMs")
        ax.set_ylabel("weight-gradient error vs float64 (main_grad)")
        ax.set_title(f"training: T={s['tokens']}, H={s['hidden']}, V={s['vocab']}")
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_hf(results: dict, path: Path) -> None:
    """The PyTorch/HF head's ratios to the stock head, per shape, log-prob pass and forward +
    backward, with the issue's targets (1.10, 1.15) drawn across."""
    plt = pyplot(path)
    if plt is None:
        return

    blocks = results["hf"]
    ways = [way for way in blocks[0]["inference"] if way != BASELINE]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), squeeze=False)
    for ax, (part, title, target) in zip(
        axes[0], (("inference", "log-prob pass (no grad)", 1.10), ("training", "forward + backward", 1.15)), strict=True
    ):
        width = 0.8 / len(ways)
        for i, way in enumerate(ways):
            xs = [j + (i - (len(ways) - 1) / 2) * width for j in range(len(blocks))]
            ratios = [b[part][way]["ratio"] for b in blocks]
            low = [r - b[part][way]["ratio_min"] for r, b in zip(ratios, blocks, strict=True)]
            high = [b[part][way]["ratio_max"] - r for r, b in zip(ratios, blocks, strict=True)]
            ax.bar(xs, ratios, width, yerr=[low, high], capsize=3, label=way)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target {target:.2f}")
        labels = []
        for b in blocks:
            s = b["shape"]
            labels.append(f"H={s['hidden']}\nV={s['vocab']}" + ("\ntied" if s["tied"] else ""))
        ax.set_xticks(range(len(blocks)), labels)
        ax.set_ylabel("time / the stock HF head (as NeMo-RL runs it)")
        ax.set_title(f"PyTorch/HF head, {title}, T={blocks[0]['shape']['tokens']}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(loc="lower right")
    fig.suptitle(f"{results['machine']['gpu']}, {results['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _points(ax, points: list[tuple[str, float, float]]) -> None:
    """Scatter (name, x, y) on log axes, each label below the labels of points already drawn
    close to it (ways with the same error sit on top of each other)."""
    import math

    drawn: list[tuple[float, float]] = []
    for name, x, y in points:
        lx, ly = math.log10(x), math.log10(y)
        near = sum(abs(lx - dx) < 0.15 and abs(ly - dy) < 0.15 for dx, dy in drawn)
        drawn.append((lx, ly))
        ax.scatter(x, y, s=60)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(6, 4 - 12 * near))


def table(results: dict) -> str:
    lines = []
    for block in results["inference"]:
        s = block["shape"]
        lines.append(f"\ninference T={s['tokens']} H={s['hidden']} V={s['vocab']}")
        lines.append(
            f"{'way':<16}{'ms':>9}{'ratio':>8}{'rounds min-max':>16}{'extra MiB':>11}{'transient MiB':>15}"
            f"{'mean|dlogp|':>13}"
        )
        for way, r in block["ways"].items():
            spread = f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}"
            lines.append(
                f"{way:<16}{r['ms']:>9.2f}{r['ratio']:>8.3f}{spread:>16}{r['extra_bytes_persistent'] / 2**20:>11.1f}"
                f"{r['extra_bytes_transient'] / 2**20:>15.1f}{r['mean_abs_dlogp']:>13.2e}"
            )
    for block in results["training"]:
        s = block["shape"]
        lines.append(f"\ntraining fwd+bwd T={s['tokens']} H={s['hidden']} V={s['vocab']}")
        lines.append(f"{'mode':<18}{'ms':>9}{'ratio':>8}{'rounds min-max':>16}{'err dx':>11}{'err dW(main_grad)':>19}")
        for way, r in block["ways"].items():
            spread = f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}"
            lines.append(
                f"{way:<18}{r['ms']:>9.2f}{r['ratio']:>8.3f}{spread:>16}{r['rel_err_dx']:>11.2e}"
                f"{r['rel_err_dw_main_grad']:>19.2e}"
            )
    for block in results.get("hf", []):
        s = block["shape"]
        tied = ", tied" if s["tied"] else ""
        for part in ("inference", "training"):
            lines.append(f"\nPyTorch/HF head, {part}, T={s['tokens']} H={s['hidden']} V={s['vocab']}{tied}")
            lines.append(f"{'way':<18}{'ms':>9}{'ratio':>8}{'rounds min-max':>16}{'extra MiB':>11}{'mean|dlogp|':>13}")
            for way, r in block[part].items():
                spread = f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}"
                lines.append(
                    f"{way:<18}{r['ms']:>9.2f}{r['ratio']:>8.3f}{spread:>16}"
                    f"{r['extra_bytes_persistent'] / 2**20:>11.1f}{r['mean_abs_dlogp']:>13.2e}"
                )
    for block in results["agreement"]:
        lines.append(f"\ntrain/generation agreement (vLLM side in batches of {block['decode_rows']} rows)")
        for name, r in block["pairs"].items():
            lines.append(
                f"{name:<34} mean exp|dlogp| {r['mean_exp_abs_dlogp']:.6f}   max |dlogp| {r['max_abs_dlogp']:.2e}"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/out/results.json"))
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument(
        "--replot", type=Path, default=None, help="draw --plot from an earlier run's JSON (no GPU needed), then stop"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=6, help="timed calls per measurement, at least")
    parser.add_argument(
        "--min-ms",
        type=float,
        default=300.0,
        help="timed milliseconds per measurement, at least (more calls if needed)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="time every way this many times, interleaved; a ratio is the median over rounds",
    )
    parser.add_argument("--quick", action="store_true", help="one small shape (a smoke run)")
    parser.add_argument(
        "--cpu", action="store_true", help="a smoke run of the logic on the CPU (no timings worth reading)"
    )
    parser.add_argument(
        "--only", action="append", choices=["inference", "training", "hf", "agreement"], help="measure only these parts"
    )
    parser.add_argument("--train-ways", default=",".join(TRAIN_WAYS), help="comma-separated training ways")
    args = parser.parse_args()
    if args.replot is not None:
        if args.plot is None:
            parser.error("--replot needs --plot PATH")
        earlier = json.loads(args.replot.read_text())
        draw(earlier, args.plot)
        return 0
    global DEVICE
    if args.cpu:
        DEVICE = "cpu"
        args.min_ms = 0.0  # a smoke run's times are not read
    elif not torch.cuda.is_available():
        print("bench/lm_head.py needs a CUDA GPU (or --cpu --quick for a smoke run); none is visible", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the ways set what they need themselves
    shapes = QUICK if args.quick else SHAPES
    results = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "host": platform.node(),
        },
        "settings": {"warmup": args.warmup, "iters": args.iters, "min_ms": args.min_ms, "rounds": args.rounds},
    }
    parts = args.only or ["inference", "training", "hf", "agreement"]
    ways = args.train_ways.split(",")
    unknown = sorted(set(ways) - set(TRAIN_WAYS))
    if unknown or BASELINE not in ways:
        parser.error(f"--train-ways: unknown {unknown} (the ratios need bf16); known: {', '.join(TRAIN_WAYS)}")
    results["inference"] = (
        [bench_inference(s, args.warmup, args.iters, args.rounds, args.min_ms) for s in shapes]
        if "inference" in parts
        else []
    )
    results["training"] = (
        [bench_training(s, args.warmup, args.iters, ways, args.rounds, args.min_ms) for s in shapes]
        if "training" in parts
        else []
    )
    hf_shapes = HF_QUICK if args.quick else HF_SHAPES
    results["hf"] = (
        [bench_hf_head(s, args.warmup, args.iters, HF_WAYS, args.rounds, args.min_ms) for s in hf_shapes]
        if "hf" in parts
        else []
    )
    results["agreement"] = [agreement(shapes[0])] if "agreement" in parts else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(table(results))
    if args.plot:
        draw(results, args.plot)
    return 0


def draw(results: dict, path: Path) -> None:
    """The plot of a run: the inference/training one where the run measured them, else the HF head's."""
    if results["inference"]:
        plot(results, path)
    elif results.get("hf"):
        plot_hf(results, path)


if __name__ == "__main__":
    raise SystemExit(main())
