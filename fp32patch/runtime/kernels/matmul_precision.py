"""Allow or forbid TF32 for CUDA fp32 GEMMs for the duration of a block, then restore.

torch has two switches for this: the legacy ``torch.backends.cuda.matmul.allow_tf32``
and, since 2.9, ``torch.backends.cuda.matmul.fp32_precision``. Once a process has set the
new one, reading the legacy one raises ("mix of the legacy and new APIs"), so a library
must not pick one on its own: this module reads which one the process uses and speaks
that one, so the trainer's own later reads keep working. The flag is process-wide (not
per thread or per device) and has no effect on CPU GEMMs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def cuda_tf32(enabled: bool) -> Iterator[None]:
    """Within the block, CUDA fp32 GEMMs may use TF32 iff ``enabled``; restored afterwards."""
    import torch

    matmul = torch.backends.cuda.matmul
    try:
        before = matmul.allow_tf32
    except RuntimeError:
        # The process uses the fp32_precision API; the legacy read refuses.
        before = matmul.fp32_precision
        wanted = "tf32" if enabled else "ieee"
        if before == wanted:
            yield
            return
        matmul.fp32_precision = wanted
        try:
            yield
        finally:
            matmul.fp32_precision = before
        return
    if before == enabled:
        yield
        return
    matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        matmul.allow_tf32 = before
