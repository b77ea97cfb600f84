"""A whole training step's peak memory and host work, way by way, at the real shapes, counted
on the CPU from fake tensors: what bench/step.py measures on a GPU, without one.

Each way's step (bench/step.py's: the model's forward, the log-probs and entropy, the loss, the
backward, the fused AdamW step) runs under torch's ``FakeTensorMode``: every tensor has its
shape, dtype and lifetime and no data, so a 7B model's step at 64k tokens takes seconds on a
laptop CPU. Recorded per step:

* **peak memory**: the largest sum of live tensors' storages over the step (torch's
  ``MemTracker``), with the model, its gradients and AdamW's state, as the CUDA allocator's
  ``max_memory_allocated`` counts them. What it cannot see: the memory a kernel allocates
  inside itself (a cuBLAS workspace; the [T, V] temporary of ATen's own ``logsumexp`` on
  CUDA), and the allocator's rounding;
* **aten operations** the step dispatches (after autograd, so the backward's count; views and
  allocations included) and **Triton launches**: the work a host-bound short step issues one
  after another. The model's part is the same for every way, and a little off a real run's
  (transformers' mask code asks whether a mask is all ones; a fake tensor cannot answer, and
  it takes its other branch): the ways' differences are what the count is for.

The CUDA path is what is counted: every choice between a Triton path and the eager one takes
the Triton one (``fp32out.TRITON_DEVICE_TYPES``), fp32out's GEMMs are the ``out_dtype`` GEMMs
CUDA dispatches, the fused GEMM + logsumexp forward is used where a Hopper GPU uses it, and a
Triton launch is counted, not run (a fake tensor has nothing to compute on; no choice in these
paths depends on a value).

The model: transformers' Qwen2 (``--impl hf``, what bench/step.py times on the GPU), or
bench/step.py's own (``--impl torch``) for long sequences: under fake tensors transformers'
mask code cannot ask whether its causal mask may be left to sdpa, and builds the [T, T] mask
(8 GiB at 64k tokens) that a GPU run never holds; bench/step.py's model passes ``is_causal``.

Checked against the H200 (bench/RESULTS.md, "Peak memory from fake tensors"): the stock,
recomputing and unfused ways' peaks of ``step-grid-h200.json`` (0.5B tied and 1.5B untied, 1k
and 4k tokens, entropy off and on) within 0.16 GiB, except the stock way with the entropy,
which the H200 holds one [T, V] fp32 tensor higher (``logsumexp``'s own temporary): this
undercounts stock there, never fp32patch.

    python bench/step_counts.py --tokens 1024 4096 --out short.json       # transformers' model
    python bench/step_counts.py --tokens 16384 65536 --impl torch --out long.json
    python bench/step_counts.py --models tiny-tied --tokens 40          # a smoke run

Needs Triton (imported, never run) and transformers for the transformers model (else
bench/step.py's own); no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import step  # noqa: E402
from fp32patch.runtime.kernels import chunked_logprobs as cl  # noqa: E402
from fp32patch.runtime.kernels import fp32out, gemm_lse_triton  # noqa: E402

WAYS = [
    "stock",
    "fp32patch",
    "fp32patch-keep",
    "fp32patch-recompute",
    "verl-fused",
    "trl-chunked",
    "fp32patch-trl",
    "nemo-fused",
    "prime-rl-fused",
    "fp32patch-prime-rl",
]
MODELS = ["0.5B-tied", "1.5B-untied", "3B-tied", "7B-untied"]
TOKENS = [1024, 4096, 16384, 65536]
# operations are counted up to this many tokens: where a step is host-bound (bench/step.py)
COUNT_UPTO = 4096


class Counts(TorchDispatchMode):
    """aten operations dispatched while on, by name; Triton launches are added by ``fakes``."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.launches: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not name.startswith("prim."):  # a fake tensor's metadata queries (prim.device): no work on a GPU
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


_COUNTING: list[Counts] = []


@contextlib.contextmanager
def fakes() -> Iterator[None]:
    """The CUDA path on fake CPU tensors (see the top), everything changed put back after."""
    from unittest import mock

    from triton.runtime.jit import KernelInterface
    from triton.tools import tensor_descriptor

    def launch(kernel, grid):
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "fn", None), "__name__", "kernel")

        def counted(*args, **kwargs):
            if _COUNTING:
                _COUNTING[-1].launches[name] += 1

        return counted

    class Descriptor:  # what the fused forward's launch would take; never read
        @staticmethod
        def from_tensor(tensor, block):
            return None

    sixteen = ("bfloat16", "float16")
    with contextlib.ExitStack() as stack:
        for target, name, value in (
            (KernelInterface, "__getitem__", launch),
            (fp32out, "TRITON_DEVICE_TYPES", {*fp32out.TRITON_DEVICE_TYPES, "cpu"}),
            (gemm_lse_triton, "usable", lambda x, w: x.dtype == w.dtype and x.dtype in (torch.bfloat16, torch.float16)),
            (tensor_descriptor, "TensorDescriptor", Descriptor),
        ):
            stack.enter_context(mock.patch.object(target, name, value))
        stack.enter_context(mock.patch.dict(fp32out._SUPPORT, {("cpu", d): True for d in sixteen}))
        stack.enter_context(mock.patch.dict(cl._ADDMM_SUPPORT, {("cpu", f"torch.{d}"): True for d in sixteen}))
        yield


def _fake_model(name: str, impl: str) -> torch.nn.Module:
    """bench/step.py's model built from fake tensors in bf16 (random initialisation skipped: a
    fake tensor has no values, and its generator would want the device)."""
    skipped = {n: getattr(torch.Tensor, n) for n in ("uniform_", "normal_")}
    for n in skipped:
        setattr(torch.Tensor, n, lambda self, *args, **kwargs: self)
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        return step.build_model(name, impl)
    finally:
        torch.set_default_dtype(dtype)
        for n, fn in skipped.items():
            setattr(torch.Tensor, n, fn)


class _Batch(step.Cell):
    """bench/step.py's Cell without values: the ids, the targets and the advantages as fake
    tensors (a generator would want values); its step is the Cell's."""

    def __init__(self, model: torch.nn.Module, tokens: int) -> None:
        self.model = model
        self.ids = torch.empty((1, tokens), dtype=torch.long)
        self.targets = torch.empty((1, tokens), dtype=torch.long)
        self.adv = torch.empty((1, tokens))


def measure(model: torch.nn.Module, opt, batch: _Batch, name: str, entropy: bool, count: bool = True) -> dict:
    """A step of way ``name``: its peak memory (GiB), and with ``count`` its aten operations and
    Triton launches."""
    from torch.distributed._tools.mem_tracker import MemTracker

    fn, _ = step.way(name)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        batch.step(fn, entropy, opt)
    peak = tracker.get_tracker_snapshot("peak")
    got = {"peak_gib": sum(per_device.get("Total", 0) for per_device in peak.values()) / 2**30}
    if count:
        # a step of its own: the tracker's module hooks dispatch operations of their own
        counts = Counts()
        _COUNTING.append(counts)
        try:
            with counts:
                batch.step(fn, entropy, opt)
        finally:
            _COUNTING.pop()
        got.update(
            aten_ops=sum(counts.ops.values()),
            triton_launches=sum(counts.launches.values()),
            launches=dict(counts.launches),
        )
    return got


def run(
    models: list[str],
    tokens: list[int],
    ways: list[str],
    entropies: list[bool],
    out: str | None = None,
    count_upto: int = COUNT_UPTO,
    impl: str | None = None,
) -> dict:
    """Every (model, tokens, entropy) cell's ways, operations counted up to ``count_upto`` tokens;
    the JSON written after every cell."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = step.DEVICE
    step.DEVICE = "cpu"
    impl = impl or step._impl()
    results = {"machine": step._machine(), "date": step._now(), "impl": impl, "cells": []}
    try:
        with fakes(), FakeTensorMode():
            for model_name in models:
                model = _fake_model(model_name, impl)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=True)
                _Batch(model, 16).step(step.way("stock")[0], False, opt)  # AdamW's state, as after warm-up
                for n in tokens:
                    batch = _Batch(model, n)
                    for entropy in entropies:
                        row = {"model": model_name, "tokens": n, "entropy": entropy, "impl": impl, "ways": {}}
                        for name in ways:
                            if entropy and not step.way(name)[1]:
                                continue
                            t0 = time.perf_counter()
                            got = row["ways"][name] = measure(model, opt, batch, name, entropy, n <= count_upto)
                            ops = (
                                f", {got['aten_ops']} aten ops, {got['triton_launches']} launches"
                                if "aten_ops" in got
                                else ""
                            )
                            print(
                                f"{model_name} {n} entropy={'on' if entropy else 'off'} {name}: "
                                f"peak {got['peak_gib']:.2f} GiB{ops} ({time.perf_counter() - t0:.0f} s)",
                                flush=True,
                            )
                        results["cells"].append(row)
                        if out:
                            Path(out).write_text(json.dumps(results, indent=1) + "\n")
                del model, opt
    finally:
        step.DEVICE = device
    return results


def table(results: dict) -> str:
    """Markdown: per stack pair, model, tokens and entropy, the two ways' peaks (marked where
    fp32patch's is over), operations and launches per step."""

    def row(a: dict, b: dict) -> list[str]:
        mark = " **over**" if b["peak_gib"] > a["peak_gib"] + 0.005 else ""
        ops = launches = "—"
        if "aten_ops" in a and "aten_ops" in b:
            added = b["aten_ops"] - a["aten_ops"]
            ops = f"{a['aten_ops']:,} → {b['aten_ops']:,} ({added:+,}, {added / a['aten_ops']:+.1%})"
            launches = f"{a['triton_launches']} → {b['triton_launches']}"
        return [f"{a['peak_gib']:.2f} → {b['peak_gib']:.2f}{mark}", ops, launches]

    columns = ["peak GiB: theirs → fp32patch", "aten ops: theirs → fp32patch (added)", "Triton launches"]
    return step.pair_tables(results, columns, row)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=MODELS, choices=list(step.MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    ap.add_argument("--ways", nargs="+", default=WAYS)
    ap.add_argument("--entropy", nargs="+", choices=["off", "on"], default=["off", "on"])
    ap.add_argument("--out", help="write the results here (JSON), after every cell")
    ap.add_argument("--count-upto", type=int, default=COUNT_UPTO, help="count operations up to this many tokens")
    ap.add_argument(
        "--impl",
        choices=["hf", "torch"],
        default=None,
        help="the model: transformers' (default where installed) or bench/step.py's",
    )
    args = ap.parse_args(argv)
    for name in args.ways:
        step.way(name)
    try:
        import triton  # noqa: F401
    except ImportError:
        raise SystemExit("bench/step_counts.py: needs Triton (imported, never run)") from None
    entropies = [e == "on" for e in args.entropy]
    results = run(args.models, args.tokens, args.ways, entropies, args.out, args.count_upto, args.impl)
    print()
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
