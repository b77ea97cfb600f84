"""fp32out's recomputed backward tile, two passes against the strip kernel, on a GPU.

    python bench/strips.py [--shape ROWS,HIDDEN,ENTRIES ...] [--config BV,BT,WARPS ...] [--json out.json]

A recomputed tile's backward in mode fp32out (``chunked_logprobs._tile_backward``) turns the
tile's fp32 logits into two 16-bit copies of their gradient: fp16 scaled per vocabulary entry
for the weight gradient, bf16 for the input gradient. The scales need each entry's largest
gradient before any copy is written, so the kernels read the tile twice: one pass over the
whole tile for the maxima (atomics across row blocks), one more for the copies (``passes``).
The strip kernel computes the tile transposed and gives each program whole strips of entries:
it reads its strips twice itself, soon after, or holds them in one block of tokens when a tile
has few enough (``STRIP_ONE_BLOCK``; ``STRIP_LIGHT_BLOCK`` for a light launch, one gradient, no
cap, one temperature, as here), and writes the scales with the copies (``strips BV,BT,WARPS``:
entries a program, tokens a block, warps; ``FP32PATCH_STRIPS=1`` every tile, ``0`` none, unset
the runtime's choice: ``default``).

For each shape (a tile of ROWS tokens by ENTRIES vocabulary entries of a HIDDEN-wide head;
the defaults are TRL's tiles at 0.5B/4k, 8k and 16k, 1.5B/4k, and the default tile of a 7B head),
it times, with CUDA events (median of 20 calls after 3):

- ``convert``: the copies alone from a computed tile, each way, and the bandwidth it reaches
  (the bytes each way must move: passes 12 a logit, strips 8, bf16grad's one pass 6);
- ``tile``: the whole tile's backward as the call runs it (its GEMM again, the copies, the
  input gradient's GEMM, the weight gradient's GEMM and unscale), each way, and in mode
  ``fp32out-bf16grad`` (the floor: one pass, no scales).

Every strip configuration's copies are checked bit for bit against the passes' first. On the
CPU (``--smoke``, under ``TRITON_INTERPRET=1``) it runs a tiny shape once to check its logic.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import lm_head  # noqa: E402
from fp32patch.runtime.kernels import chunked_logprobs as cl  # noqa: E402
from fp32patch.runtime.kernels import fp32out  # noqa: E402
from fp32patch.runtime.trl.fused import tile as trl_tile  # noqa: E402

TEMPERATURE = 0.7
# (rows, hidden, entries): TRL's tiles of a 0.5B head (896 x 151,936) at 4k and 16k tokens, of a
# 1.5B head (1536) at 4k, of the 0.5B head at 8k, and choose_tiles' tile of a 7B head (3584 x 152,064) at 16k
SHAPES = [
    (4096, 896, trl_tile(4096, 151936, 896)[1]),
    (16384, 896, trl_tile(16384, 151936, 896)[1]),
    (4096, 1536, trl_tile(4096, 151936, 1536)[1]),
    (8192, 896, trl_tile(8192, 151936, 896)[1]),
    (cl.choose_tiles(16384, 152064, 3584)[0], 3584, cl.choose_tiles(16384, 152064, 3584)[1]),
]
# (entries a program, tokens a block, warps): one held block (a tile of at most BT tokens),
# strips read twice in blocks for taller ones
CONFIGS = [
    (1, 4096, 8), (2, 4096, 16), (1, 8192, 16), (1, 16384, 32), (1, 16384, 16),
    (4, 1024, 8), (8, 512, 8), (4, 2048, 8),
]  # fmt: skip
# the same for a kept row-major tile: entries a program (a contiguous segment of each row), tokens a block
ROW_CONFIGS = [(16, 128, 4), (32, 128, 8), (32, 256, 8), (64, 64, 8), (64, 128, 8), (128, 64, 8)]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


WARMUP = 3


def time_ms(fn, iters: int = 20) -> float:
    """bench/lm_head.py's timer (CUDA events; wall time on the CPU), after ``WARMUP`` calls."""
    return lm_head.time_ms(fn, warmup=WARMUP, iters=iters)


class Problem:
    """One tile's operands and the per-token statistics its gradient needs."""

    def __init__(self, rows: int, hidden: int, entries: int, dtype: torch.dtype, seed: int = 0) -> None:
        dev = _device()
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.x = torch.randn(rows, hidden, device=dev, generator=gen).to(dtype)
        self.w = (torch.randn(entries, hidden, device=dev, generator=gen) * (2.0 / hidden**0.5)).to(dtype)
        self.tile = fp32out.mm(self.x, self.w.t())
        z = self.tile / TEMPERATURE
        # the tile's own log Z plus a constant: the rest of the vocabulary's share
        log_z = torch.logsumexp(z, dim=1) + 2.0
        targets = torch.randint(0, entries * 2, (rows,), device=dev, generator=gen)
        grad_logp = torch.randn(rows, device=dev, generator=gen) / rows
        self.rows = cl._RowGrads(targets, 0, TEMPERATURE, log_z, None, grad_logp, None)
        self.plan = cl._Plan("fp32out", TEMPERATURE, False, None, 0, False, False, rows, entries)
        self.args = (targets, 0, TEMPERATURE, log_z, None, grad_logp, None)


def passes_convert(k, p: Problem, plain_dtype):
    """The two passes' copies as the backward makes them (``chunked_logprobs.pass_copies``)."""
    return cl.pass_copies(k, p.tile, p.args, True, plain_dtype)


def strips_convert(k, p: Problem, tile_t, plain_dtype):
    """The strips' copies, laid out as ``tile_t`` is (``chunked_logprobs.strip_copies``)."""
    return cl.strip_copies(k, tile_t, p.args, plain_dtype)


def bf16grad_convert(k, p: Problem, plain_dtype):
    """fp32out-bf16grad's one pass (the plain copy alone)."""
    return cl.pass_copies(k, p.tile, p.args, False, plain_dtype)[2]


def tile_backward(p: Problem, mode: str = "fp32out", kept: bool = False):
    plan = dataclasses.replace(p.plan, mode=mode, keep=kept)
    dx = torch.zeros(p.x.shape, dtype=torch.float32, device=p.x.device)
    with cl._precision(plan.mode, p.x.device):
        return cl._tile_backward(plan, p.x, p.w, p.rows, dx, True, None, p.w.dtype, p.tile if kept else None, {})


class Env:
    """Environment variables set (None: unset) within, as they were after."""

    def __init__(self, **env: str | None) -> None:
        self.env, self.old = env, {}

    def __enter__(self):
        for key, value in self.env.items():
            self.old[key] = os.environ.get(key)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def __exit__(self, *exc):
        for key, value in self.old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_shape(rows: int, hidden: int, entries: int, configs: dict[str, list], iters: int) -> dict:
    """Both layouts of one shape: ``computed`` (the backward computes the tile again, transposed
    for the strips) and ``kept`` (the forward's row-major tile, read through its view)."""
    dtype = torch.bfloat16 if _device() == "cuda" else torch.float16  # (the interpreter stores no bf16)
    p = Problem(rows, hidden, entries, dtype)
    k = cl._TritonKernels.get()
    assert k is not None, "the Triton kernels are not available"
    gb = rows * entries / 1e9
    ms = time_ms(lambda: passes_convert(k, p, dtype), iters=iters)
    convert = {"passes": {"ms": ms, "GB/s": 12 * gb / ms * 1e3}}
    ms = time_ms(lambda: bf16grad_convert(k, p, dtype), iters=iters)
    convert["bf16grad"] = {"ms": ms, "GB/s": 6 * gb / ms * 1e3}
    out: dict = {"shape": [rows, hidden, entries]}
    try:
        for layout in ("computed", "kept"):
            out[layout] = run_layout(k, p, layout == "kept", configs[layout], dict(convert), iters)
    finally:
        k.__dict__.pop("strip_shape", None)  # the class's again
    return out


def run_layout(k, p: Problem, kept: bool, configs: list, convert: dict, iters: int) -> dict:
    rows, entries = p.tile.shape
    dtype, gb = p.x.dtype, rows * entries / 1e9
    ref = passes_convert(k, p, dtype)
    tile_t = p.tile.t() if kept else p.tile.t().contiguous()
    tile: dict = {}
    with Env(FP32PATCH_STRIPS="0"):
        tile["passes"] = {"ms": time_ms(lambda: tile_backward(p, kept=kept), iters=iters)}
    tile["bf16grad"] = {"ms": time_ms(lambda: tile_backward(p, "fp32out-bf16grad", kept), iters=iters)}
    for bv, bt, warps in configs:
        name = f"strips {bv},{bt},{warps}"
        k.strip_shape = lambda n, tokens_contiguous=True, light=False, c=(bv, bt, warps): c
        got = strips_convert(k, p, tile_t, dtype)
        if not all(torch.equal(a, b) for a, b in zip(got, (ref[0], ref[1].t(), ref[2].t()), strict=True)):
            raise SystemExit(
                f"bench/strips.py: {name}, {'kept' if kept else 'computed'} {rows}x{entries}: not the passes' copies"
            )
        ms = time_ms(lambda: strips_convert(k, p, tile_t, dtype), iters=iters)
        convert[name] = {"ms": ms, "GB/s": 8 * gb / ms * 1e3, "one_block": bt >= rows}
        with Env(FP32PATCH_STRIPS="1"):
            tile[name] = {"ms": time_ms(lambda: tile_backward(p, kept=kept), iters=iters)}
    del k.strip_shape
    with Env(FP32PATCH_STRIPS="1"):
        ms = time_ms(lambda: tile_backward(p, kept=kept), iters=iters)
    r = p.rows
    light = k.strip_light(r.temperature, p.plan.softcap, r.grad_logp, r.grad_entropy)
    tile["strips (shape table)"] = {"ms": ms, "config": k.strip_shape(rows, tokens_contiguous=not kept, light=light)}
    with Env(FP32PATCH_STRIPS=None):  # the runtime's choice, whatever the caller's environment says
        strip = cl.strips(k, rows, kept, p.plan, r)
        tile["default"] = {"ms": time_ms(lambda: tile_backward(p, kept=kept), iters=iters), "strips": strip}
    return {"convert": convert, "tile": tile}


def report(results: dict) -> str:
    lines = []
    for r in results["shapes"]:
        rows, hidden, entries = r["shape"]
        for layout in ("computed", "kept"):
            part = r[layout]
            lines.append(f"\n{rows} tokens x {entries} entries, hidden {hidden}: the tile {layout}")
            base_c, base_t = part["convert"]["passes"]["ms"], part["tile"]["passes"]["ms"]
            lines.append(f"  {'way':<24} {'copies ms':>10} {'x passes':>9} {'GB/s':>7} {'tile ms':>9} {'x passes':>9}")
            for name in part["tile"]:
                c = part["convert"].get(name, {})
                t = part["tile"][name]["ms"]
                copies = "" if "ms" not in c else f"{c['ms']:.3f}"
                ratio = "" if "ms" not in c else f"{c['ms'] / base_c:.3f}"
                rate = "" if "GB/s" not in c else f"{c['GB/s']:.0f}"
                if name == "default":
                    name = f"default ({'strips' if part['tile'][name]['strips'] else 'passes'})"
                lines.append(f"  {name:<24} {copies:>10} {ratio:>9} {rate:>7} {t:>9.3f} {t / base_t:>9.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", help="ROWS,HIDDEN,ENTRIES (repeatable)")
    ap.add_argument("--config", action="append", help="BV,BT,WARPS for a computed tile (repeatable)")
    ap.add_argument("--row-config", action="append", help="BV,BT,WARPS for a kept row-major tile (repeatable)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="a tiny shape, once (the CPU, under TRITON_INTERPRET=1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    def parse(values):
        return [tuple(int(v) for v in c.split(",")) for c in values]

    shapes = parse(args.shape) if args.shape else SHAPES
    configs = {
        "computed": parse(args.config) if args.config else CONFIGS,
        "kept": parse(args.row_config) if args.row_config else ROW_CONFIGS,
    }
    iters = args.iters
    lm_head.DEVICE = _device()
    if args.smoke:
        global WARMUP
        shapes, iters, WARMUP = [(40, 32, 300)], 1, 0
        configs = {"computed": [(8, 64, 4), (16, 16, 4)], "kept": [(64, 16, 4)]}
        fp32out.TRITON_DEVICE_TYPES = {"cuda", "cpu"}
    machine = {"python": platform.python_version(), "torch": torch.__version__}
    machine["gpu"] = torch.cuda.get_device_name(0) if _device() == "cuda" else "none (the Triton interpreter)"
    try:
        import triton

        machine["triton"] = triton.__version__
    except ImportError:
        machine["triton"] = None
    results = {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine,
        "shapes": [run_shape(*s, configs, iters) for s in shapes],
    }
    print(f"bench/strips.py, {results['date']}, {machine['gpu']}", report(results), sep="\n")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
