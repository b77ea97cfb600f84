"""chunked_logprobs' forward statistics with the logits never leaving the GPU's registers.

One Triton kernel computes [BM, BN] blocks of ``x @ weight.T`` with 16-bit operands and an
fp32 accumulator (the grade of fp32out's ``torch.mm(out_dtype=float32)``: exact products of
the same operands, summed in fp32), caps each (Gemma's soft-cap, where a call has one),
divides it by the temperature (one, or each row's) in fp32 and reduces it in registers to each
row's statistics over the block's columns: the maximum, the sum of
exponentials relative to it, for the entropy the exp-weighted sum of logits, and the target's
logit where the block holds it. Only those vectors are written, [V / BN, T] of each; a small
torch pass then merges the blocks' statistics per row (an exact logsumexp merge in fp32).

Why: a chunked head's log-prob pass is one GEMM. Written as an fp32 tile and read back, each
logit costs 8 bytes of memory traffic that the GEMM itself does not need (4 more than a bf16
tile), ~2 ms per 16k tokens at V=152064 on an H200. Here it costs none and no tile is held.

The kernel is persistent (one program per SM, walking the output blocks in groups of GROUP_M
row blocks that share the weight's blocks through L2) and loads both operands with Hopper's
tensor memory accelerator (host-side tensor descriptors), so it runs on sm_90 and newer; the
loop over blocks is flattened so that a block's epilogue overlaps the next block's loads.
Measured on an H200 at T=16384, H=4096, V=152064 (bench/RESULTS.md): 29.0 ms, against 29.4
for cuBLAS's bf16 GEMM alone writing its tiles and 33.8 for the fp32 tiles folded by a second
kernel. Elsewhere (older GPUs, rows whose byte stride TMA cannot take) chunked_logprobs keeps
its tiles.

Nothing here imports torch or Triton at import time.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from fp32patch.runtime.kernels import triton_logits  # noqa: F401  (read by the kernel: triton_logits.logits)

if TYPE_CHECKING:
    import torch

# The block and pipeline, measured on an H200 (bench/fused_logprobs.py, bench/RESULTS.md).
CONFIG = {"BM": 128, "BN": 256, "BK": 64, "GROUP_M": 16, "num_warps": 8, "num_stages": 3}

_KERNEL: Any = None


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def gemm_lse_kernel(
        x_desc, w_desc, targets, m_out, s_out, zs_out, tz_out, n_rows, n_cols, hdim, temperature, temps, cap,
        SCALED: tl.constexpr, ROW_TEMPS: tl.constexpr, CAPPED: tl.constexpr, ENTROPY: tl.constexpr,
        NUM_SMS: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ):  # fmt: skip
        num_m = tl.cdiv(n_rows, BM)
        num_n = tl.cdiv(n_cols, BN)
        k_steps = tl.cdiv(hdim, BK)
        in_group = GROUP_M * num_n
        for block in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
            first_m = (block // in_group) * GROUP_M
            size_m = min(num_m - first_m, GROUP_M)
            pid_m = first_m + (block % in_group) % size_m
            pid_n = (block % in_group) // size_m
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k in range(k_steps):
                # out of bounds, TMA reads zeros
                a = x_desc.load([pid_m * BM, k * BK])
                b = w_desc.load([pid_n * BN, k * BK])
                acc = tl.dot(a, b.T, acc)
            rm = pid_m * BM + tl.arange(0, BM)
            rn = pid_n * BN + tl.arange(0, BN)
            row_ok = rm < n_rows
            col_ok = rn < n_cols
            row_t = 1.0
            if ROW_TEMPS:
                row_t = tl.load(temps + rm, mask=row_ok, other=1.0)[:, None]
            z, _ = triton_logits.logits(acc, cap, temperature, row_t, CAPPED, SCALED, ROW_TEMPS)
            z = tl.where(col_ok[None, :], z, -float("inf"))
            m = tl.max(z, axis=1)
            e = tl.exp(z - m[:, None])
            out = pid_n.to(tl.int64) * n_rows + rm
            tl.store(m_out + out, m, mask=row_ok)
            tl.store(s_out + out, tl.sum(e, axis=1), mask=row_ok)
            if ENTROPY:
                tl.store(zs_out + out, tl.sum(tl.where(col_ok[None, :], e * z, 0.0), axis=1), mask=row_ok)
            target = tl.load(targets + rm, mask=row_ok, other=-1)
            held = row_ok & (target >= pid_n * BN) & (target < pid_n * BN + BN) & (target < n_cols)
            picked = tl.sum(tl.where(rn[None, :] == target[:, None], z, 0.0), axis=1)
            tl.store(tz_out + rm, picked, mask=held)

    _KERNEL = gemm_lse_kernel
    return _KERNEL


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel runs for these operands: CUDA on sm_90 or newer (TMA), 16-bit
    operands of one dtype with unit column stride and 16-byte aligned rows, Triton with host
    tensor descriptors importable."""
    import torch

    from fp32patch.runtime.kernels.fp32out import triton_device

    if not triton_device(x) or weight.dtype not in (torch.bfloat16, torch.float16) or x.dtype != weight.dtype:
        return False
    if x.device.type == "cuda" and torch.cuda.get_device_capability(x.device) < (9, 0):
        return False
    for t in (x, weight):
        if t.stride(1) != 1 or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    try:
        _kernel()
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def _programs(device: torch.device) -> int:
    """The persistent kernel's program count: one per SM on CUDA; elsewhere (Triton's
    interpreter, which tests run on the CPU) a few, so that programs still share the blocks."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return INTERPRETER_PROGRAMS


# programs of the persistent kernel off CUDA (the interpreter): more than one, fewer than the blocks
INTERPRETER_PROGRAMS = 3


def kernel_temperature(temperature: Any, filler: Any) -> tuple[float, Any, bool]:
    """A kernel's temperature arguments (this file's and ``chunked_logprobs``' fold and gradient
    kernels'): (the scalar, the per-row tensor, whether per row); ``filler`` takes the tensor's
    place when the temperature is one number."""
    if isinstance(temperature, (int, float)):
        return float(temperature), filler, False
    return 1.0, temperature, True


def block_stats(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float | torch.Tensor,
    entropy: bool,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-row statistics of ``z / temperature`` over all of ``weight``'s rows, ``z`` = ``x @
    weight.T`` capped at ``softcap * tanh(z / softcap)`` where a cap is given, ``temperature`` a
    number or fp32 [R] per row: (max, sum exp(z - max), sum exp(z - max) * z or None, the
    target's logit or 0), fp32 [R].
    ``x`` [R, H] and ``weight`` [V, H] as ``usable`` accepts; ``targets`` [R] ids counted from
    the weight's first row (one outside [0, V) gives 0)."""
    import torch
    import triton
    from triton.tools.tensor_descriptor import TensorDescriptor

    cfg = CONFIG
    rows, hdim = x.shape
    cols = weight.shape[0]
    device = x.device
    tz = torch.zeros(rows, dtype=torch.float32, device=device)
    if not rows or not cols:
        top = torch.full((rows,), -float("inf"), dtype=torch.float32, device=device)
        zero = torch.zeros(rows, dtype=torch.float32, device=device)
        return top, zero, (zero.clone() if entropy else None), tz
    blocks = triton.cdiv(cols, cfg["BN"])
    m = torch.empty((blocks, rows), dtype=torch.float32, device=device)
    s = torch.empty_like(m)
    zs = torch.empty_like(m) if entropy else s
    tiles = triton.cdiv(rows, cfg["BM"]) * blocks
    sms = _programs(device)
    scalar, temps, per_row = kernel_temperature(temperature, tz)
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _kernel()[(min(sms, tiles),)](
            TensorDescriptor.from_tensor(x, [cfg["BM"], cfg["BK"]]),
            TensorDescriptor.from_tensor(weight, [cfg["BN"], cfg["BK"]]),
            targets.contiguous(), m, s, zs, tz, rows, cols, hdim, scalar,
            temps.contiguous(), 1.0 if softcap is None else float(softcap),
            SCALED=scalar != 1.0, ROW_TEMPS=per_row, CAPPED=softcap is not None, ENTROPY=entropy, NUM_SMS=sms,
            BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP_M=cfg["GROUP_M"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], enable_fp_fusion=False,
        )  # fmt: skip
    top = m.amax(dim=0)
    rescale = m.sub_(top).exp_()  # in place: the pass holds the blocks' statistics and no more
    weighted = zs.mul_(rescale).sum(dim=0) if entropy else None
    total = s.mul_(rescale).sum(dim=0)
    return top, total, weighted, tz
