"""An fp32 ``tanh`` for Triton kernels, the same on a GPU and in Triton's interpreter.

The soft-capped heads (Gemma's ``final_logit_softcapping``: ``cap * tanh(z / cap)``) need a
tanh inside the log-prob kernels. ``triton.language`` has none; libdevice's runs only where
libdevice does (not in the interpreter that the tests run on the CPU). This one is written
from ``exp`` and arithmetic, so one formula runs everywhere:

- ``|u| < 0.4``: the odd Taylor series to ``u**13`` (the next term is under 5e-9 of the value);
- otherwise ``1 - 2 / (exp(2|u|) + 1)`` (no cancellation: the value is above 0.38), which
  reaches exactly 1 where ``exp`` overflows;
- the sign restored; NaN stays NaN.

3.2 units in the last place of float64's tanh at most over [-20, 20] in numpy's float32 (the
interpreter's arithmetic); the tests hold it within 4 in the interpreter
(tests/heavy/megatron/test_chunked_triton_interpreted.py) and within 8 compiled, with the GPU's
approximate ``exp`` (tests/gpu/test_chunked_logprobs_cuda.py). Imports Triton only when called.

A kernel calls it as ``triton_tanh.tanh(u)`` with this module imported at its module's top
(the attribute is made on first access): Triton's interpreter runs a kernel's source again in
its module's globals, so a kernel can reach a helper through a global and not through a
closure.
"""

from __future__ import annotations

from typing import Any

_TANH: Any = None
tl: Any = None  # triton.language, once tanh_fn has run

# tanh(u) / u = 1 + s * (c1 + s * (c2 + ...)), s = u**2: the Taylor coefficients
TAYLOR = (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075)
# below this |u| the series, above it the exponential form
SERIES_BELOW = 0.4


def tanh_fn() -> Any:
    """The ``@triton.jit`` function ``tanh(u)`` on fp32 values (made once)."""
    global _TANH, tl
    if _TANH is not None:
        return _TANH
    import triton
    import triton.language as tl  # a module global: the interpreter looks for it there

    # the literals are TAYLOR and SERIES_BELOW (a kernel reads no Python globals but constexprs)
    # fmt: off
    @triton.jit
    def tanh(u):
        a = tl.abs(u)
        s = a * a
        series = a * (1.0 + s * (-0.3333333333333333 + s * (0.13333333333333333 + s * (-0.05396825396825397
                      + s * (0.021869488536155203 + s * (-0.008863235529902197 + s * 0.003592128036572481))))))
        expo = 1.0 - tl.div_rn(2.0 + tl.zeros_like(a), tl.exp(2.0 * a) + 1.0)
        t = tl.where(a < 0.4, series, expo)
        return tl.where(u < 0, -t, t)
    # fmt: on

    _TANH = tanh
    return _TANH


def __getattr__(name: str) -> Any:
    if name == "tanh":
        return tanh_fn()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
