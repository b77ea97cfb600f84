"""SkyRL's driver holds every vLLM server's LM heads to ``trainer.fp32_lm_head`` before the first rollout.

Each server is vLLM's OpenAI server, run by SkyRL's ``VLLMServerActor`` with its development
endpoints on (``VLLM_SERVER_DEV_MODE=1``) and SkyRL's worker extension (``NewInferenceWorkerWrap``)
in every worker; the patch gives that extension the probe's method (``kit.probe.PROBE_RPC``), and
``build_new_inference_client`` asks each server over HTTP (``/collective_rpc``,
``kit.probe.server_reports``) once the servers are up, SkyRL's own or ``external_server_urls``.
A worker whose logits are not float32 (vLLM's ``head_dtype`` falls back to bf16 on a platform
it does not support with only a warning) stops startup, naming the server and the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fp32patch.runtime.kit.probe import fell_back, hold_units, server_reports
from fp32patch.runtime.skyrl.config import KEY, STACK, check_config

HOW_TO_START = (
    "SkyRL's own servers answer it; an external server needs VLLM_SERVER_DEV_MODE=1, "
    "--worker-extension-cls skyrl.backends.skyrl_train.inference_servers.new_inference_worker_wrap."
    "NewInferenceWorkerWrap (patched by fp32patch in that environment) and --hf-overrides "
    '\'{"head_dtype": "float32"}\''
)


def worker_report(worker: Any) -> dict[str, Any]:
    """In a vLLM worker (SkyRL's ``NewInferenceWorkerWrap``): the probe's report on its model."""
    from fp32patch.runtime.heads.vllm_probe import probe_vllm_model

    return probe_vllm_model(worker.model_runner.model)


def probe_servers(
    cfg: Any, server_urls: Any, *, where: str = "build_new_inference_client", post: Callable[..., Any] | None = None
) -> list[list[Any]]:
    """Ask every server's workers and hold them to the key; ``post`` is the HTTP client's post
    (default ``httpx.post``, which SkyRL's servers use). Returns each server's reports."""
    mode = check_config(cfg, where=where).mode
    urls = list(server_urls or ())
    if mode is None or not urls:
        return []
    if post is None:
        import httpx

        post = httpx.post
    answers = {url: server_reports(post, url, where=where, how_to_start=HOW_TO_START) for url in urls}
    return check_servers(answers, mode, where=where)


def check_servers(answers: Mapping[str, Any], mode: str | None, *, where: str) -> list[list[Any]]:
    """Every server's workers float32 where the key is on (``mode``), none where it is off; else
    refuse with one line per disagreeing worker, naming its server. Logs one line when all agree."""
    asking = f"{KEY}={mode!r}" if mode is not None else f"{KEY} is off"

    def why(label: str, index: int, report: Mapping[str, Any]) -> str:
        if mode is not None:
            return f"{label}: {fell_back(index, report, asking, 'server')}"
        worker = f"vLLM worker {index} (host {report.get('host', '?')}, pid {report.get('pid', '?')})"
        return (
            f"{label}: {worker} computes {report.get('dtype')} logits while {asking}; the way is "
            f"{report.get('way')}: {report.get('reason') or '-'}"
        )

    units = [(f"vLLM server {url}", url, reports) for url, reports in answers.items()]
    return hold_units(units, mode, why, where=where, asking=asking, unit="server", logger=STACK.logger)
