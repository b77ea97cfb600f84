"""The startup probe's verdicts, as every stack gives them.

Each vLLM worker measures its own head (``heads.vllm_probe.probe_vllm_model``, called through the
RPC ``PROBE_RPC`` that each stack's patched worker extension answers, or in process); the stack
holds the reports to one expectation (every worker float32, or none) and, where one disagrees,
stops startup with one line per worker that says which worker, what it computes, what asked for
something else, and why. Pure Python."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadMismatchError

# The method each stack's patched vLLM worker extension gets; its driver or rollout server calls
# it by this name through the engine's collective_rpc.
PROBE_RPC = "fp32patch_probe_lm_head"


def disagreeing_reports(
    reports: Any, expect_fp32: bool, why: Callable[[int, Mapping[str, Any]], str], *, where: str
) -> tuple[list[Any], list[tuple[int, Any, str]]]:
    """Hold the workers' reports (as a ``collective_rpc`` returns them; nested lists, one per
    engine, flattened in order) to one expectation: every worker float32, or none. Returns the
    flat reports and ``(index, report, reason)`` for each worker that disagrees (``why`` words
    the reason of a report that came back); raises ``Fp32LmHeadMismatchError`` when no worker
    reported at all."""
    flat = _flatten(reports)
    if not flat:
        raise Fp32LmHeadMismatchError(f"fp32patch ({where}): no vLLM worker returned an LM-head probe report", [])
    bad: list[tuple[int, Any, str]] = []
    for index, report in enumerate(flat):
        if not isinstance(report, Mapping):
            bad.append((index, report, f"vLLM worker {index} returned no LM-head probe report (got {report!r})"))
        elif (report.get("dtype") == "float32") != expect_fp32:
            bad.append((index, report, why(index, report)))
    return flat, bad


def _flatten(reports: Any) -> list[Any]:
    if isinstance(reports, (list, tuple)):
        return [item for nested in reports for item in _flatten(nested)]
    return [reports]


def disagreement(
    index: int, report: Mapping[str, Any], *, expect_fp32: bool, asking: str, switch: str, key: str, hint: str = ""
) -> str:
    """Why worker ``index`` disagrees, in one line: ``asking`` is what asked for its logits as the
    user wrote it (``"actor_rollout_ref.model.fp32_lm_head='fp32out'"``); ``switch`` the name of
    vLLM's switch the stack documents, named where the worker has neither; ``key`` the trainer's
    switch; ``hint`` follows a switch found off (where to set it)."""
    host, pid, dtype = report.get("host", "?"), report.get("pid", "?"), report.get("dtype")
    env, way, reason = report.get("env"), report.get("way"), report.get("reason") or ""
    name = report.get("env_name") or switch
    worker = f"vLLM worker {index} (host {host}, pid {pid})"
    if dtype is None:
        return f"{worker} computes no logits while {asking}: {reason}"
    said = f"{worker} computes {dtype} logits while {asking}: "
    off = env is None or env.strip() in ("", "0")
    if expect_fp32:
        if off:
            state = "unset" if env is None or not env.strip() else f"{env!r}"
            return said + f"{name} is {state} in that process{hint}"
        if not report.get("patched") and way != "native":
            file = report.get("file")
            return (
                said
                + "the model file is not patched (run fp32patch apply in that venv)"
                + (f": {file}" if file else "")
            )
        return said + f"the way is {way}: {reason}"
    if not off:
        return said + f"{name}={env!r} in that process (unset it, or turn {key} on)"
    return said + f"the way is {way}: {reason}"


def refuse(bad: list[tuple[int, Any, str]], *, header: str, footer: str) -> None:
    """Stop startup: ``header``, one line per disagreeing worker, ``footer``."""
    lines = [header, *(f"  {reason}" for _, _, reason in bad), footer]
    raise Fp32LmHeadMismatchError("\n".join(lines), bad)
