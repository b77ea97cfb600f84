"""The startup probe's verdicts, as every stack gives them.

Each vLLM worker measures its own head (``heads.vllm_probe.probe_vllm_model``, called through the
RPC ``PROBE_RPC`` that each stack's patched worker extension answers, or in process); the stack
holds the reports to one expectation (every worker float32, or none) and, where one disagrees,
stops startup with one line per worker that says which worker, what it computes, what asked for
something else, and why. Where a stack runs vLLM's own OpenAI server, which no patch of the stack
extends, ``ProbeWorkerExtension`` gives its workers the probe's method (``--worker-extension-cls
PROBE_EXTENSION``) and ``server_reports`` asks them over HTTP. Pure Python."""

from __future__ import annotations

import logging
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
            file = ", ".join(report.get("patch_files") or ()) or report.get("file")
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


def fell_back(index: int, report: Mapping[str, Any], asking: str, log: str) -> str:
    """Why worker ``index``, asked for vLLM's own ``head_dtype`` float32, computes other logits;
    ``log`` names the process whose log says more ("engine", "server")."""
    worker = f"vLLM worker {index} (host {report.get('host', '?')}, pid {report.get('pid', '?')})"
    return (
        f"{worker} computes {report.get('dtype')} logits while {asking} asked vLLM for head_dtype float32 "
        "(hf_overrides): vLLM fell back to the model's dtype (a platform without fp32 support, or a quantized "
        f"head: see the {log}'s log); the way is {report.get('way')}: {report.get('reason') or '-'}"
    )


def hold_units(
    units: list[tuple[str, str, Any]],
    mode: str | None,
    why: Callable[[str, int, Mapping[str, Any]], str],
    *,
    where: str,
    asking: str,
    unit: str,
    logger: logging.Logger,
) -> list[list[Any]]:
    """The whole check of a stack with several vLLM engines or servers (``unit``: "engine",
    "server"): ``units`` holds each one's ``(label, part, reports)``, its label leading its lines
    ("vLLM engine 0"), ``part`` added to ``where`` in an error about it ("engine 0"). Every worker
    float32 where the key is on (``mode``), none where it is off; else ``refuse`` with one line per
    disagreeing worker (``why(label, index, report)``), naming its unit. Logs one line when all
    agree; returns each unit's flat reports."""
    bad_all, flat_all = [], []
    for label, part, reports in units:

        def reason_of(index: int, report: Mapping[str, Any], label: str = label) -> str:
            return why(label, index, report)

        flat, bad = disagreeing_reports(reports, mode is not None, reason_of, where=f"{where}, {part}")
        bad_all += [(i, r, reason if reason.startswith(label) else f"{label}: {reason}") for i, r, reason in bad]
        flat_all.append(flat)
    if bad_all:
        refuse(
            bad_all,
            header=f"fp32patch ({where}): the rollout's logits do not follow {asking}:",
            footer=f"The trainer and the rollout would compute different logits. Fix the {unit}(s) above.",
        )
    ways = ", ".join(sorted({str(r.get("way")) for flat in flat_all for r in flat}))
    logger.info(
        "fp32patch (%s): %d vLLM %s(s), %d worker(s), compute %s logits (way: %s), as %s",
        where,
        len(flat_all),
        unit,
        sum(len(flat) for flat in flat_all),
        "float32" if mode is not None else "stock",
        ways,
        asking,
    )
    return flat_all


def hold_reports(
    reports: Any,
    mode: str | None,
    *,
    where: str,
    key: str,
    switch: str,
    logger: logging.Logger,
    subject: str = "the rollout's logits",
    hint: str = "",
) -> list[Any]:
    """The whole check of a stack whose workers follow one key: every worker float32 where the
    key is on (``mode``), none where it is off; else ``refuse`` with one line per worker
    (``disagreement``, ``switch`` and ``hint`` as there), headed ``subject`` "do not follow"
    the key. Logs one line when all agree; returns the flat reports."""

    def why(index: int, report: Mapping[str, Any]) -> str:
        asking = f"{key}={mode!r}" if mode is not None else f"{key} is off"
        return disagreement(
            index, report, expect_fp32=mode is not None, asking=asking, switch=switch, key=key, hint=hint
        )

    flat, bad = disagreeing_reports(reports, mode is not None, why, where=where)
    if bad:
        refuse(
            bad,
            header=f"fp32patch ({where}): {subject} do not follow {key}={mode!r}:",
            footer="The trainer and the rollout would compute different logits. Fix the worker(s) above.",
        )
    ways = ", ".join(sorted({str(r.get("way")) for r in flat}))
    logger.info(
        "fp32patch (%s): %d vLLM worker(s) compute %s logits (way: %s), as %s=%r asks",
        where,
        len(flat),
        "float32" if mode is not None else "stock",
        ways,
        key,
        mode,
    )
    return flat


class ProbeWorkerExtension:
    """The probe's method for a vLLM that a stack does not extend itself: vLLM's own OpenAI
    server (``vllm serve``) takes it as ``--worker-extension-cls`` (``PROBE_EXTENSION``) and adds
    it to every worker, whose ``collective_rpc`` then answers ``PROBE_RPC`` with the worker's
    ``heads.vllm_probe.probe_vllm_model`` report."""

    def fp32patch_probe_lm_head(self) -> dict[str, Any]:
        from fp32patch.runtime.heads.vllm_probe import probe_vllm_model

        return probe_vllm_model(self.model_runner.model)  # type: ignore[attr-defined]


PROBE_EXTENSION = f"{__name__}.{ProbeWorkerExtension.__qualname__}"


def server_reports(
    post: Callable[..., Any], base_url: str, *, where: str, how_to_start: str, path: str = "/collective_rpc"
) -> Any:
    """Every worker's probe report from a running vLLM OpenAI server, through its development
    endpoint ``/collective_rpc`` (served with ``VLLM_SERVER_DEV_MODE=1``), or a route of a stack's
    own server that asks its workers the same (``path``; it answers ``{"results": [...]}``):
    ``post(url, json=..., timeout=...)`` is the caller's HTTP client (a ``requests.Session.post``). A server that cannot
    answer (unreachable, no development endpoints, workers without the probe's method: a plain
    ``vllm serve``) is refused with ``Fp32LmHeadMismatchError``: nobody could tell whether its
    logits are fp32. ``how_to_start`` says how to start one that can."""
    url = f"{base_url.rstrip('/')}{path}"
    header = f"fp32patch ({where}): cannot probe the vLLM server's LM heads at {url}"
    try:
        response = post(url, json={"method": PROBE_RPC}, timeout=_SERVER_PROBE_TIMEOUT_S)
    except Exception as exc:  # the client's own error type, whatever it is
        raise Fp32LmHeadMismatchError(f"{header}: {type(exc).__name__}: {exc}. {how_to_start}", []) from None
    status = getattr(response, "status_code", None)
    if status == 404:
        why = (
            "the server has no /collective_rpc (vLLM serves it with VLLM_SERVER_DEV_MODE=1)"
            if path == "/collective_rpc"
            else f"the server has no {path} (its files are not patched?)"
        )
    elif status != 200:
        text = " ".join(str(getattr(response, "text", "")).split())[:_BODY_SHOWN]
        why = f"it answered {status}: {text} (its workers have no {PROBE_RPC}: a plain `vllm serve`?)"
    else:
        try:
            return response.json()["results"]
        except (ValueError, KeyError, TypeError) as exc:
            why = f"its answer holds no results ({type(exc).__name__}: {exc})"
    raise Fp32LmHeadMismatchError(
        f"{header}: {why}. The trainer's logits would be fp32 and nobody could tell whether the server's are. "
        f"{how_to_start}",
        [],
    )


# how long a server's workers may take to answer the probe (one probe row each), and how much of
# an error's body a refusal quotes
_SERVER_PROBE_TIMEOUT_S = 120
_BODY_SHOWN = 400
