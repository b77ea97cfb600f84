"""The log-prob path's Triton kernels compiled for a Hopper GPU (sm_90a) on this CPU machine.

Triton's compiler and the ptxas it ships need no GPU: a kernel goes from its Python source to
PTX and to a cubin here, as on the device, in the flag combinations the runtime launches it
with. Triton's interpreter (test_chunked_triton_interpreted.py) checks what the kernels compute;
this checks that they compile, which the interpreter does not (it runs the source as Python),
so that a change made on a machine without a GPU cannot ship a kernel that fails at its first
launch. ptxas' report then says what a kernel costs in registers: the strip kernel's default
shapes spill (next to) nothing. The arguments carry the hints Triton's launcher gives real tensors (16-byte
aligned pointers, sizes and strides divisible by 16, a stride of 1 as a constant), so the code
is the one a real launch compiles."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from fp32patch.runtime.kernels import chunked_logprobs as cl  # noqa: E402
from fp32patch.runtime.kernels import fp16_scale_triton  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {"targets": "*i64", "out16": "*fp16", "plain": "*bf16", "out_scaled": "*fp16", "out_plain": "*bf16"}
FLOATS = ("temperature", "cap")
INT64 = ("stride", "s_v", "s_t", "o_v", "o_t", "out_stride", "s_m", "s_n", "o_m", "o_n", "d_m", "d_n")


def _compile(fn, values: dict, warps: int, unit: tuple[str, ...] = ()) -> dict:
    """``fn`` compiled for sm_90a with the constexprs in ``values``; the other arguments typed by
    name (pointers fp32 unless ``POINTERS`` says otherwise), hinted as a launch hints real ones,
    those in ``unit`` the constant 1 (a contiguous stride). Returns its PTX and ptxas' report."""
    names = list(fn.arg_names)
    consts = {**values, **dict.fromkeys(unit, 1)}
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in consts:
            signature[name] = "constexpr"
        elif name in FLOATS:
            signature[name] = "fp32"
        elif name in INT64:
            signature[name] = "i64"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in ("col0",):
            signature[name] = "i32"
        elif re.fullmatch(r"n_\w+|[A-Z]", name):
            signature[name] = "i32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = POINTERS.get(name, "*fp32")
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    out = triton.compile(src, target=TARGET, options={"num_warps": warps, "enable_fp_fusion": False})
    return {"ptx": out.asm["ptx"], **_ptxas(out.asm["ptx"])}


def _ptxas(ptx: str) -> dict:
    """Registers and spilled bytes as the ptxas Triton ships reports them (None: none here that
    reads this PTX version)."""
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        for name in ("ptxas-blackwell", "ptxas"):
            path = os.path.join(folder, name)
            if not os.path.exists(path):
                continue
            run = subprocess.run(
                [path, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull], capture_output=True, text=True
            )
            if run.returncode == 0:
                regs = re.search(r"Used (\d+) registers", run.stderr)
                spills = [int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", run.stderr)]
                return {"registers": int(regs.group(1)) if regs else None, "spills": sum(spills)}
    finally:
        os.unlink(f.name)
    return {"registers": None, "spills": None}


@pytest.fixture(scope="module")
def kernels():
    k = cl._TritonKernels.get()
    assert k is not None and fp16_scale_triton.load()
    return k


FLAGS = ("SCALED", "ROW_TEMPS", "CAPPED", "LOGP_GRAD", "ENTROPY_GRAD")


def _flag_sets():
    """The log-prob flags in every combination that has a gradient (LOGP_GRAD or ENTROPY_GRAD)."""
    for bits in itertools.product([False, True], repeat=len(FLAGS)):
        flags = dict(zip(FLAGS, bits, strict=True))
        if flags["LOGP_GRAD"] or flags["ENTROPY_GRAD"]:
            yield flags


@pytest.mark.parametrize("layout", ["computed", "kept"])
def test_the_strip_kernel_compiles_at_its_default_shapes_without_spills(kernels, layout):
    contiguous = layout == "computed"
    # (shape, passes) at 700 tokens (one held block of 1,024), 4,096 and 8,192 (one held block),
    # 16,384 (one held block for a light launch: one gradient, no cap, one temperature; blocks
    # read twice for the others)
    launches = set()
    for flags in _flag_sets():
        light = kernels.strip_light(
            0.7 if not flags["ROW_TEMPS"] else None, 5.0 if flags["CAPPED"] else None,
            True if flags["LOGP_GRAD"] else None, True if flags["ENTROPY_GRAD"] else None,
        )  # fmt: skip
        for n in (700, 4096, 8192, 16384):
            bv, bt, warps = kernels.strip_shape(n, tokens_contiguous=contiguous, light=light)
            launches.add((bv, bt, warps, 1 if n <= bt else 2, tuple(flags.items())))
    shapes = {launch[:4] for launch in launches}
    assert len(shapes) == (5 if contiguous else 1), shapes
    for (bv, bt, warps, phases, flags), plain in itertools.product(launches, (False, True)):
        values = {**dict(flags), "PLAIN": plain, "PHASES": phases, "BV": bv, "BT": bt}
        got = _compile(kernels._strips, values, warps, unit=("s_t", "o_t") if contiguous else ("s_v", "o_v"))
        assert "st.global" in got["ptx"]
        if got["spills"] is not None:
            # (one combination, a temperature per row with the entropy's gradient alone, spills
            # 8 bytes at 64 registers with Triton 3.9: ptxas' own choice; a blow-up spills hundreds,
            # as 16,384 tokens held do in any launch but a light one)
            assert got["spills"] <= 16, (
                f"{layout} {(bv, bt, warps, phases)} {dict(flags)} plain={plain}: {got['registers']} registers, {got['spills']} bytes spilled"
            )


def test_the_gradient_kernel_compiles_in_every_pass_the_backward_launches(kernels):
    passes = [
        dict(IN_PLACE=False, AMAX=True, FP16=False, PLAIN=False),  # fp32out's maxima
        dict(IN_PLACE=False, AMAX=False, FP16=True, PLAIN=True),  # its copies
        dict(IN_PLACE=False, AMAX=False, FP16=False, PLAIN=True),  # fp32out-bf16grad's one
        dict(IN_PLACE=True, AMAX=False, FP16=False, PLAIN=False),  # grad_tile in place
    ]
    for flags, kind in itertools.product(_flag_sets(), passes):
        values = {**flags, **kind, "BM": kernels.GRAD_BM, "BN": kernels.GRAD_BN}
        got = _compile(kernels._grad, values, kernels.GRAD_WARPS)
        assert "st.global" in got["ptx"] or "atom.global" in got["ptx"], (flags, kind)


def test_the_fold_and_fp32out_kernels_compile(kernels):
    for bits in itertools.product([False, True], repeat=4):
        flags = dict(zip(("SCALED", "ROW_TEMPS", "CAPPED", "ENTROPY"), bits, strict=True))
        _compile(kernels._fold, {**flags, "BLOCK": kernels.FOLD_BLOCK}, kernels.FOLD_WARPS)
    k = fp16_scale_triton._KERNELS
    assert _compile(k["scales"], {"BL": fp16_scale_triton._SCALES_BL}, fp16_scale_triton._SCALES_WARPS)["spills"] in (
        0,
        None,
    )
    for plain in (False, True):
        bm, bn, warps = fp16_scale_triton._CONVERT_BM, fp16_scale_triton._CONVERT_BN, fp16_scale_triton._CONVERT_WARPS
        _compile(k["convert"], {"BM": bm, "BN": bn, "PLAIN": plain}, warps, unit=("s_n", "o_n"))
    for accumulate in (False, True):
        bm, bn, warps = fp16_scale_triton._UNSCALE_BM, fp16_scale_triton._UNSCALE_BN, fp16_scale_triton._UNSCALE_WARPS
        _compile(k["unscale"], {"BM": bm, "BN": bn, "ACCUMULATE": accumulate}, warps, unit=("s_n", "d_n"))
