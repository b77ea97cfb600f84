"""The startup probe's measurement, run inside a vLLM worker: what the loaded model does
with its LM head.

``probe_vllm_model(model)`` computes the logits of one probe row through the model's own
``compute_logits`` (vLLM's own logits processor and gather) and reports their dtype, the
runtime's way and why, the switch as that process sees it, and whether the model's files
carry fp32patch's edits. Any RL stack's vLLM worker can call it; each stack holds the reports
to its own config through the kit's verdicts (``fp32patch.runtime.kit.probe``).

Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import inspect
import os
import socket
from typing import Any

from fp32patch.runtime.modes import VLLM_SWITCHES

MARKER = "# fp32patch:"


def probe_vllm_model(model: Any) -> dict[str, Any]:
    """What the loaded vLLM ``model`` does with its LM head, measured: run in each vLLM worker.

    Computes the logits of one probe row (a hidden state of the model's hidden size and dtype,
    on the head's device) through the model's own ``compute_logits``, with vLLM's own logits
    processor and gather, and returns a JSON-able report::

        {"dtype": "float32", "way": "fp32out", "reason": "...", "env": "1", "pid": 4242,
         "host": "node-3", "patched": True, "model": "NemotronHForCausalLM",
         "file": ".../nemotron_h.py", "files": [...]}

    ``dtype`` is that of this rank's logits (measured before the tensor-parallel gather on a
    rank that receives none: ``gathered`` False); ``way`` is "fp32out", "copy" or "native"
    (fp32 logits), "stock" (the bf16 path although the variable asks for fp32, ``reason`` says
    why) or "off" (vLLM's switch is unset or 0 here); ``env`` is the switch's value in this process
    and ``env_name`` the name it is set by (``FP32PATCH_VLLM_LM_HEAD`` or ``NRL_VLLM_FP32_LM_HEAD``;
    None where neither is set); ``patched`` says whether the model's files (``files``: its classes' and its
    logits processor's; ``file``: that of the class that owns the head) carry fp32patch's
    edits; ``patch_files`` are the files fp32patch's vLLM patches edit for this model that carry
    no edit (vLLM's ``layers/logits_processor.py``; NemotronH's own file), which a refusal names. An error inside ``compute_logits`` is reported (``dtype`` None), not raised.
    Refuses to run inside CUDA-graph capture; leaves the model as its first real call would.
    An in-process engine that holds its own switch (``vllm_engine_switch.hold``) is measured,
    and its switch reported, with those values.
    """
    from fp32patch.runtime.heads import vllm_engine_switch

    with vllm_engine_switch.applied(vllm_engine_switch.held(model)):
        return _probe(model)


def _probe(model: Any) -> dict[str, Any]:
    import torch

    from fp32patch.runtime.heads import vllm as vllm_lm_head

    owner = vllm_lm_head.resolve_heads(model)[0]
    head = owner.lm_head
    weight = getattr(head, "weight", None)
    device = weight.device if weight is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fp32patch: the LM-head probe must not run during CUDA-graph capture")
    env_name = next((name for name in VLLM_SWITCHES if os.environ.get(name, "").strip()), None)
    env = os.environ.get(env_name) if env_name is not None else None
    files = _source_files(model, owner)
    patched = any(_has_marker(path) for path in files)
    report: dict[str, Any] = {
        "dtype": None,
        "gathered": None,
        "way": "stock",
        "reason": "",
        "env": env,
        "env_name": env_name,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "patched": patched,
        "model": type(owner).__name__,
        "file": _file_of(owner),
        "files": files,
        "patch_files": _patch_files(owner),
    }
    row = _probe_row(owner, head, device)
    try:
        report["dtype"], report["gathered"] = _logits_dtype(model, owner, row)
    except Exception as exc:  # reported with this worker's name by check_probe_reports
        report["reason"] = f"compute_logits raised {type(exc).__name__}: {exc}"
        return report
    report["way"], report["reason"] = _way(
        model, env_name, env, report["dtype"], patched, ", ".join(report["patch_files"]) or report["file"]
    )
    return report


def _source_files(model: Any, owner: Any) -> list[str]:
    """The files of the model's classes and its logits processor's, base classes included
    (a subclass reaches a patched ``compute_logits`` through ``super()``)."""
    files: list[str] = []
    for obj in (model, owner, getattr(owner, "logits_processor", None)):
        for cls in type(obj).__mro__:
            if cls.__module__.split(".")[0] in ("builtins", "torch", "typing", "abc"):
                continue
            try:
                path = inspect.getsourcefile(cls)
            except TypeError:  # a builtin type
                path = None
            if path and path not in files:
                files.append(path)
    return files


# Model classes with a patch of their own besides the logits processor's (nemotron-h-fp32-lm-head).
_OWN_PATCH = ("NemotronHForCausalLM",)


def _patch_files(owner: Any) -> list[str]:
    """The files fp32patch's vLLM patches edit for this model and that carry no edit: vLLM's
    ``LogitsProcessor`` (every model's logits pass it: ``vllm-fp32-logits``), and the model's own
    file where a patch of its own targets it; the files a refusal names."""
    classes = []
    processor = getattr(owner, "logits_processor", None)
    if processor is not None:
        mro = type(processor).__mro__
        classes.append(next((c for c in mro if c.__name__ == "LogitsProcessor"), type(processor)))
    classes += [c for c in type(owner).__mro__ if c.__name__ in _OWN_PATCH][:1]
    files = []
    for cls in classes:
        try:
            path = inspect.getsourcefile(cls)
        except TypeError:
            path = None
        if path and path not in files and not _has_marker(path):
            files.append(path)
    return files


def _file_of(obj: Any) -> str | None:
    try:
        return inspect.getsourcefile(type(obj))
    except TypeError:
        return None


def _has_marker(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as handle:
            return MARKER in handle.read()
    except OSError:
        return False


def _probe_row(owner: Any, head: Any, device: Any) -> Any:
    """One hidden state of the model's hidden size and activation dtype, deterministic."""
    import torch

    size = getattr(head, "embedding_dim", None) or head.weight.shape[-1]
    floats = (torch.bfloat16, torch.float16, torch.float32)
    dtype = next(
        (p.dtype for name, p in owner.named_parameters() if p.dtype in floats and not name.startswith("lm_head.")),
        None,
    )
    if dtype is None:
        weight = getattr(head, "weight", None)
        dtype = weight.dtype if weight is not None and weight.dtype in floats else torch.bfloat16
    row = torch.linspace(-2.0, 2.0, size, device=device, dtype=torch.float32)
    return row.reshape(1, size).to(dtype)


def _logits_dtype(model: Any, owner: Any, row: Any) -> tuple[str, bool]:
    """The dtype of this rank's logits from ``compute_logits`` for ``row``, and whether this
    rank received the gathered logits (False: measured on its own shard)."""
    import torch

    from fp32patch.runtime.heads import vllm as vllm_lm_head

    target = model if callable(getattr(model, "compute_logits", None)) else vllm_lm_head._unwrap(model)
    compute = target.compute_logits
    extra = _extra_required_args(compute)
    processor = owner.logits_processor
    seen: list[Any] = []
    shadowed = "_gather_logits" in processor.__dict__
    original = getattr(processor, "_gather_logits", None)
    if callable(original):
        # A rank that receives no gathered logits (None) still shows its own shard's dtype.
        def gather(logits: Any, *args: Any, **kwargs: Any) -> Any:
            seen.append(logits.dtype)
            return original(logits, *args, **kwargs)

        processor.__dict__["_gather_logits"] = gather
    try:
        # no_grad, not inference_mode: an fp32 copy built here must stay writable by later refits
        with torch.no_grad():
            logits = compute(row, *([None] * extra))
    finally:
        if callable(original):
            if shadowed:
                processor.__dict__["_gather_logits"] = original
            else:
                del processor.__dict__["_gather_logits"]
    dtype = logits.dtype if logits is not None else (seen[0] if seen else None)
    if dtype is None:
        raise RuntimeError("compute_logits returned no logits and no local logits were seen")
    return str(dtype).removeprefix("torch."), logits is not None


def _extra_required_args(function: Any) -> int:
    """How many required positional arguments ``compute_logits`` takes after the hidden states
    (vLLM before 0.11: ``sampling_metadata``, which None skips)."""
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return 0
    required = [
        p
        for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is inspect.Parameter.empty
    ]
    return max(0, len(required) - 1)


def _way(model: Any, name: str | None, env: str | None, dtype: str, patched: bool, file: str | None) -> tuple[str, str]:
    from fp32patch.runtime.heads import vllm as vllm_lm_head

    try:
        requested = vllm_lm_head.requested_way()
    except ValueError as exc:
        return "stock", str(exc)
    if requested is None:
        state = f"{name} is {env!r}" if name is not None else f"vLLM's switch ({' or '.join(VLLM_SWITCHES)}) is unset"
        if dtype == "float32":
            return "native", f"{_NATIVE}, although {state} in this process"
        return "off", f"{state} in this process"
    info = vllm_lm_head.describe(model)[0]
    way = info.get("way")
    if way in (None, "stock") and not patched and dtype != "float32":
        return "stock", f"the model file is not patched (run fp32patch apply in that venv): {file}"
    if way is not None:
        return way, info.get("reason") or _WAY_REASONS.get(way, way)
    if dtype == "float32":
        return "native", _NATIVE
    if not patched:
        return "stock", f"the model file is not patched (run fp32patch apply in that venv): {file}"
    return "stock", "the model's compute_logits did not call fp32patch's runtime"


_NATIVE = (
    "the logits are float32 without fp32patch's runtime (vLLM computes this head in fp32 itself: "
    "head_dtype=float32, or a float32 model)"
)
_WAY_REASONS = {
    "fp32out": "fp32 logits by fp32out: bf16 operands, fp32 output",
    "copy": "fp32 logits by copy: an fp32 copy of the head's weight",
    "native": "vLLM computes this head in fp32 itself (head_dtype=float32)",
    "stock": "the runtime kept vLLM's stock bf16 path",
}
