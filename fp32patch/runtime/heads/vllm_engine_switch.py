"""vLLM's switch held by one in-process engine, not by the process.

The patched vLLM files read the switch (``FP32PATCH_VLLM_LM_HEAD`` / ``NRL_VLLM_FP32_LM_HEAD``)
from the process environment, before 0.26 on every ``compute_logits`` call. A worker process of
its own keeps what it was started with; an engine that runs in the trainer's own process (TRL's
colocated vLLM, ``external_launcher``) shares the trainer's environment with every other engine
that process builds later. So a stack that sets the variable for such an engine hands it to the
engine with ``hold(model, values)`` once the engine is built: from then on the model's
``compute_logits`` runs with those values in the environment and the process's own environment
is put back, so a second trainer in that process gets what its own switch asks, and the first
engine keeps fp32 logits for as long as it lives.

Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

from fp32patch.runtime.modes import VLLM_SWITCHES

# Where the held values live on the model (an instance attribute, gone with the engine).
HELD = "_fp32patch_vllm_switch"


def _entry(model: Any) -> Any:
    """The module whose ``compute_logits`` the engine's runner calls, looked through vLLM's
    wrappers (``unwrap()``) to the innermost one, which every wrapper reaches."""
    for _ in range(16):
        inner = model.unwrap() if callable(getattr(model, "unwrap", None)) else model
        if inner is model:
            break
        model = inner
    return model


def held(model: Any) -> dict[str, str | None] | None:
    """The switch's values held by ``model`` (None: it holds none; the process's environment rules)."""
    return getattr(_entry(model), HELD, None)


@contextlib.contextmanager
def applied(values: Mapping[str, str | None] | None, environ: MutableMapping[str, str] | None = None) -> Iterator[None]:
    """``environ`` (default ``os.environ``) with the switch's names at ``values`` (None: unset)
    inside the block, and as it was after it."""
    if not values:
        yield
        return
    environ = os.environ if environ is None else environ
    saved = {name: environ.get(name) for name in values}
    _put(environ, values)
    try:
        yield
    finally:
        _put(environ, saved)


def _put(environ: MutableMapping[str, str], values: Mapping[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def hold(model: Any, values: Mapping[str, str | None]) -> None:
    """Let the in-process engine's ``model`` compute its logits with vLLM's switch at ``values``
    (each of ``VLLM_SWITCHES``: a value, or None for unset), whatever the process's environment
    says later. Holding again replaces the values."""
    unknown = set(values) - set(VLLM_SWITCHES)
    if unknown:
        raise ValueError(f"not vLLM's switch: {sorted(unknown)} (its names: {', '.join(VLLM_SWITCHES)})")
    entry = _entry(model)
    full = {name: values.get(name) for name in VLLM_SWITCHES}
    first = getattr(entry, HELD, None) is None
    object.__setattr__(entry, HELD, full)  # a plain attribute, whatever the module's __setattr__ does
    if not first:
        return
    compute = entry.compute_logits

    @functools.wraps(compute)
    def compute_logits(*args: Any, **kwargs: Any) -> Any:
        with applied(getattr(entry, HELD, None)):
            return compute(*args, **kwargs)

    object.__setattr__(entry, "compute_logits", compute_logits)


def put_back(environ: MutableMapping[str, str], before: Mapping[str, str | None]) -> None:
    """The switch's names in ``environ`` as they were (``before``: name -> value or None)."""
    _put(environ, {name: before.get(name) for name in VLLM_SWITCHES})
