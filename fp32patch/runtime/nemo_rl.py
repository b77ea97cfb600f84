"""What NeMo-RL's patched files call: one config turns the fp32 LM head on in both engines.

- ``check_config(cfg, where=...)``: the config guard, run in the driver before any worker
  starts and again in each Megatron worker. ``validate_fp32_lm_head_config`` (both engines on
  or both off, valid values, near-miss keys) plus ``megatron_cfg.fp32_residual_connection``
  (a boolean, not also set in ``megatron_cfg.model_overrides``). Takes the master config or
  the policy section, as a dict or a pydantic model (NeMo-RL's ``MasterConfig`` is pydantic
  with ``extra="allow"``: it keeps a misspelt key without a word, so this check is the one
  that sees it).
- ``wire_megatron(model, megatron_cfg)``: the fp32 output layer on every model chunk that
  ``get_model`` returned (every virtual-pipeline chunk, through DDP / Float16Module / PEFT /
  VL nesting).
- ``probe_vllm_model(model)``: run inside each vLLM worker once the model is loaded; computes
  the logits of one probe row through the model's own ``compute_logits`` and reports their
  dtype, the runtime's way and why, the switch as that process sees it, and whether the
  model's files carry fp32patch's edits.
- ``check_probe_reports(reports, settings, where=...)``: in the driver, refuses to go on when
  a vLLM worker's logits disagree with Megatron's, naming the worker and the reason.

Importing this module imports neither torch, vLLM nor Megatron.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
from collections.abc import Mapping
from typing import Any

from fp32patch.runtime.config import Fp32LmHeadConfigError, Fp32LmHeadSettings, validate_fp32_lm_head_config
from fp32patch.runtime.modes import VLLM_ENV_VAR, megatron_mode

__all__ = [
    "PROBE_RPC",
    "VLLM_ENV_VAR",
    "Fp32LmHeadConfigError",
    "Fp32LmHeadMismatchError",
    "Fp32LmHeadSettings",
    "check_config",
    "check_probe_reports",
    "probe_vllm_model",
    "wire_megatron",
]

# The method NeMo-RL's patched vLLM worker extension gets; the driver calls it by this name
# through NeMo-RL's collective_rpc.
PROBE_RPC = "fp32patch_probe_lm_head"

MEGATRON_KEY = "policy.megatron_cfg.fp32_lm_head"
RESIDUAL = "fp32_residual_connection"
MARKER = "# fp32patch:"

# A child of NeMo-RL's logger, so these lines go where NeMo-RL's own go.
logger = logging.getLogger("nemo_rl.fp32patch")


class Fp32LmHeadMismatchError(RuntimeError):
    """A vLLM worker's logits disagree with Megatron's fp32 LM-head setting.

    ``disagreements`` holds ``(index, report, reason)`` for each worker that disagrees.
    """

    def __init__(self, message: str, disagreements: list[tuple[int, Any, str]]) -> None:
        super().__init__(message)
        self.disagreements = disagreements


# ---------------------------------------------------------------- the config guard


def check_config(cfg: Any, *, where: str, environ: Mapping[str, str] | None = None) -> Fp32LmHeadSettings:
    """Refuse a NeMo-RL config that would give fp32 logits to one engine only, or a bad value.

    ``cfg`` is the master config or its ``policy`` section: a dict, any Mapping, or a pydantic
    model. ``where`` names the caller in messages ("driver", "megatron worker rank 3").
    ``environ`` stands for this process's environment (default ``os.environ``). Returns what
    the config asks for; raises ``Fp32LmHeadConfigError``.
    """
    try:
        policy = _policy(cfg)
        # Validated as part of a master config, so every message names the full YAML path.
        settings = validate_fp32_lm_head_config({"policy": policy}, environ=environ)
        _check_residual(policy)
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
    return settings


def _plain(value: Any) -> Any:
    """Mappings and pydantic models as plain dicts (pydantic keeps extra keys in its dump)."""
    if isinstance(value, Mapping):
        return {key: _plain(item) for key, item in value.items()}
    dump = getattr(value, "model_dump", None)  # pydantic 2
    if callable(dump) and not isinstance(value, type):
        return _plain(dump())
    legacy = getattr(value, "dict", None)  # pydantic 1
    if callable(legacy) and hasattr(value, "__fields__") and not isinstance(value, type):
        return _plain(legacy())
    return value


def _policy(cfg: Any) -> dict[str, Any]:
    plain = _plain(cfg)
    if not isinstance(plain, dict):
        raise Fp32LmHeadConfigError(
            f"expected NeMo-RL's master config or its policy section (a mapping or a pydantic model), "
            f"got {type(cfg).__name__}"
        )
    if "megatron_cfg" not in plain and "generation" not in plain and "policy" in plain:
        policy = plain["policy"]
        if not isinstance(policy, dict):
            raise Fp32LmHeadConfigError(f"policy must be a mapping, not {type(policy).__name__} ({policy!r})")
        return policy
    return plain


def _check_residual(policy: Mapping[str, Any]) -> None:
    megatron = policy.get("megatron_cfg")
    if not isinstance(megatron, Mapping) or RESIDUAL not in megatron:
        return
    key = f"policy.megatron_cfg.{RESIDUAL}"
    value = megatron[RESIDUAL]
    if not isinstance(value, bool):
        hint = " (a quoted string is not a boolean)" if isinstance(value, str) else ""
        raise Fp32LmHeadConfigError(
            f"{key} = {value!r} is not valid{hint}: write true or false without quotes, or leave the key out"
        )
    overrides = megatron.get("model_overrides")
    if isinstance(overrides, Mapping) and RESIDUAL in overrides:
        raise Fp32LmHeadConfigError(
            f"{key} = {value!r} and policy.megatron_cfg.model_overrides.{RESIDUAL} = "
            f"{overrides[RESIDUAL]!r} both set Megatron's {RESIDUAL}: keep {key} and remove it "
            "from model_overrides"
        )


# ---------------------------------------------------------------- Megatron


def wire_megatron(model: Any, megatron_cfg: Any) -> Any:
    """Give ``model`` (the chunk list from ``get_model``, or one module) fp32 logits when
    ``megatron_cfg.fp32_lm_head`` asks for them; returns ``model``.

    ``megatron_cfg`` is NeMo-RL's ``policy.megatron_cfg`` (a mapping or pydantic model; the
    whole policy section is accepted too). Off (false, null, missing) leaves ``model`` as it
    is. Idempotent: wiring the same model twice with the same mode changes nothing, with a
    different mode raises.
    """
    section = _plain(megatron_cfg)
    if not isinstance(section, dict):
        raise TypeError(
            "wire_megatron expects NeMo-RL's policy.megatron_cfg (a mapping), got "
            f"{type(megatron_cfg).__module__}.{type(megatron_cfg).__name__}"
        )
    if "fp32_lm_head" not in section and isinstance(section.get("megatron_cfg"), dict):
        section = section["megatron_cfg"]  # the policy section was passed
    raw = section.get("fp32_lm_head")
    try:
        mode = megatron_mode(raw)
    except ValueError as exc:
        raise Fp32LmHeadConfigError(f"{MEGATRON_KEY}: {exc}") from None
    if mode is None:
        return model
    from fp32patch.runtime.megatron_lm_head import apply_fp32_lm_head

    layers = apply_fp32_lm_head(model, mode)
    chunks = len(model) if isinstance(model, (list, tuple)) else 1
    logger.info(
        "fp32patch: Megatron output layer in fp32 (mode %r): %d of %d model chunk(s) hold the last "
        "pipeline stage's head",
        mode,
        len(layers),
        chunks,
    )
    return model


# ---------------------------------------------------------------- the vLLM probe


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
    why) or "off" (the variable is unset or 0 here); ``env`` is ``NRL_VLLM_FP32_LM_HEAD`` in
    this process; ``patched`` says whether the model's files (``files``: its classes' and its
    logits processor's; ``file``: that of the class that owns the head) carry fp32patch's
    edits. An error inside ``compute_logits`` is reported (``dtype`` None), not raised.
    Refuses to run inside CUDA-graph capture; leaves the model as its first real call would.
    """
    import torch

    from fp32patch.runtime import vllm_lm_head

    owner = vllm_lm_head.resolve_heads(model)[0]
    head = owner.lm_head
    weight = getattr(head, "weight", None)
    device = weight.device if weight is not None else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("fp32patch: the LM-head probe must not run during CUDA-graph capture")
    env = os.environ.get(VLLM_ENV_VAR)
    files = _source_files(model, owner)
    patched = any(_has_marker(path) for path in files)
    report: dict[str, Any] = {
        "dtype": None,
        "gathered": None,
        "way": "stock",
        "reason": "",
        "env": env,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "patched": patched,
        "model": type(owner).__name__,
        "file": _file_of(owner),
        "files": files,
    }
    row = _probe_row(owner, head, device)
    try:
        report["dtype"], report["gathered"] = _logits_dtype(model, owner, row)
    except Exception as exc:  # reported with this worker's name by check_probe_reports
        report["reason"] = f"compute_logits raised {type(exc).__name__}: {exc}"
        return report
    report["way"], report["reason"] = _way(model, env, report["dtype"], patched, report["file"])
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

    from fp32patch.runtime import vllm_lm_head

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


def _way(model: Any, env: str | None, dtype: str, patched: bool, file: str | None) -> tuple[str, str]:
    from fp32patch.runtime import vllm_lm_head

    try:
        requested = vllm_lm_head.requested_way()
    except ValueError as exc:
        return "stock", str(exc)
    if requested is None:
        state = "unset" if env is None or not env.strip() else f"{env!r}"
        if dtype == "float32":
            return "native", f"{_NATIVE}, although {VLLM_ENV_VAR} is {state} in this process"
        return "off", f"{VLLM_ENV_VAR} is {state} in this process"
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


# ---------------------------------------------------------------- the driver's check


def check_probe_reports(
    reports: Any, settings_or_mode: Any, *, where: str = "driver", asked_by: str | None = None
) -> None:
    """Refuse to go on when any vLLM worker's logits disagree with Megatron's setting.

    ``reports`` is what NeMo-RL's collective_rpc of ``PROBE_RPC`` returns: one report per
    worker (nested lists, one per engine, are flattened in order). ``settings_or_mode`` is the
    ``Fp32LmHeadSettings`` from ``check_config`` or a ``megatron_cfg.fp32_lm_head`` value.
    Megatron fp32: every worker must compute float32 logits. Megatron off: none may. Raises
    ``Fp32LmHeadMismatchError`` naming each disagreeing worker (index, host, pid) and why;
    logs one INFO line when all agree.

    A caller that knows only the vLLM switch (NeMo-RL's driver holds the generation config,
    and the config guard holds Megatron's key to that switch) passes any mode for "on" and
    names the switch in ``asked_by`` (``"NRL_VLLM_FP32_LM_HEAD='1' in ..."``): the messages
    then say what asked, not a Megatron mode the caller does not know.
    """
    if isinstance(settings_or_mode, Fp32LmHeadSettings):
        mode = settings_or_mode.megatron
    else:
        try:
            mode = megatron_mode(settings_or_mode)
        except ValueError as exc:
            raise Fp32LmHeadConfigError(f"fp32patch ({where}): {MEGATRON_KEY}: {exc}") from None
    flat = _flatten(reports)
    if not flat:
        raise Fp32LmHeadMismatchError(f"fp32patch ({where}): no vLLM worker returned an LM-head probe report", [])
    bad: list[tuple[int, Any, str]] = []
    for index, report in enumerate(flat):
        if not isinstance(report, Mapping):
            bad.append((index, report, f"vLLM worker {index} returned no LM-head probe report (got {report!r})"))
            continue
        dtype = report.get("dtype")
        if (mode is not None and dtype != "float32") or (mode is None and dtype == "float32"):
            bad.append((index, report, _disagreement(index, report, mode, asked_by)))
    if bad:
        if mode is not None:
            why = (
                "Megatron would train on fp32 logits and vLLM generate from bf16 ones, which makes "
                "the train/generation mismatch worse than both off"
            )
        else:
            why = (
                "vLLM would generate from fp32 logits and Megatron train on bf16 ones, which makes "
                "the train/generation mismatch worse than both off"
            )
        lines = [f"fp32patch ({where}): the fp32 LM head is not on in both engines alike:"]
        lines += [f"  {reason}" for _, _, reason in bad]
        lines.append(f"{why}. Fix the worker(s) above, or turn both switches off.")
        raise Fp32LmHeadMismatchError("\n".join(lines), bad)
    ways = ", ".join(sorted({str(r.get("way")) for r in flat}))
    dtypes = ", ".join(sorted({str(r.get("dtype")) for r in flat}))
    if asked_by is not None:
        logger.info(
            "fp32patch (%s): LM head fp32 %s in every vLLM worker, as %s asks: %d vLLM worker(s) compute %s "
            "logits (%s); the config guard holds %s to the same switch",
            where,
            "on" if mode is not None else "off",
            asked_by,
            len(flat),
            dtypes,
            "way: " + ways if mode is not None else "stock",
            MEGATRON_KEY,
        )
    elif mode is not None:
        logger.info(
            "fp32patch (%s): LM head fp32 in both engines: Megatron fp32_lm_head=%r, %d vLLM worker(s) "
            "compute float32 logits (way: %s)",
            where,
            mode,
            len(flat),
            ways,
        )
    else:
        logger.info(
            "fp32patch (%s): LM head fp32 off in both engines: %d vLLM worker(s) compute %s logits",
            where,
            len(flat),
            dtypes,
        )


def _flatten(reports: Any) -> list[Any]:
    if isinstance(reports, (list, tuple)):
        return [item for nested in reports for item in _flatten(nested)]
    return [reports]


def _disagreement(index: int, report: Mapping[str, Any], mode: str | None, asked_by: str | None) -> str:
    host, pid, dtype = report.get("host", "?"), report.get("pid", "?"), report.get("dtype")
    env, way, reason = report.get("env"), report.get("way"), report.get("reason") or ""
    worker = f"vLLM worker {index} (host {host}, pid {pid})"
    # what asked for this worker's logits, as the messages name it
    if asked_by is not None:
        asking = asked_by
    else:
        asking = f"{MEGATRON_KEY}={mode!r}" if mode is not None else f"{MEGATRON_KEY} is off"
    if dtype is None:
        return f"{worker} computes no logits while {asking}: {reason}"
    if mode is not None:
        said = f"{worker} computes {dtype} logits while {asking}: "
        if env is None or env.strip() in ("", "0"):
            state = "unset" if env is None or not env.strip() else f"{env!r}"
            return said + (
                f"{VLLM_ENV_VAR} is {state} in that process (set it in "
                "policy.generation.vllm_cfg.env_vars, not only in the driver's environment)"
            )
        if not report.get("patched") and way != "native":
            file = report.get("file")
            return (
                said
                + "the model file is not patched (run fp32patch apply in that venv)"
                + (f": {file}" if file else "")
            )
        return said + f"the way is {way}: {reason}"
    said = f"{worker} computes float32 logits while {asking}: "
    if env is not None and env.strip() not in ("", "0"):
        return said + f"{VLLM_ENV_VAR}={env!r} in that process (unset it, or turn {MEGATRON_KEY} on)"
    return said + f"the way is {way}: {reason}"
