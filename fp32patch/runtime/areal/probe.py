"""AReaL's rollout servers held to the actor's ``enable_fp32_lm_head`` at startup.

Once the single controller has started the rollout's servers (``controller.initialize``), each
one's address is in ``controller.server_infos``. SGLang: ``kit.sglang.probe_servers`` reads its
``/server_info`` and measures the grade of the log-probs one short generation returns. vLLM:
AReaL's own server asks its workers on the patch's route ``/fp32patch_probe_lm_head`` (AReaL's
worker extension answers, ``heads.vllm_probe``), and ``kit.probe.hold_reports`` holds them to the
key. A server that would give bf16 log-probs stops the start, naming it. The eval rollout reuses
the rollout's servers (probed once).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fp32patch.runtime.areal.config import KEY_NAME, STACK, validate_fp32_lm_head_config
from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit import probe, sglang
from fp32patch.runtime.modes import VLLM_SWITCH

ROUTE = "/fp32patch_probe_lm_head"
PROBED_ROLES = ("rollout",)


def worker_report(worker: Any) -> dict[str, Any]:
    """In a vLLM worker (AReaL's ``VLLMWorkerExtension``): the probe's report on its model."""
    from fp32patch.runtime.heads.vllm_probe import probe_vllm_model

    return probe_vllm_model(worker.model_runner.model)


def server_urls(controller: Any) -> list[str]:
    """The base URLs of the servers a rollout controller started or reached."""
    urls = []
    for info in getattr(controller, "server_infos", None) or ():
        host, port = _read(info, "host"), _read(info, "port")
        if ":" in str(host) and not str(host).startswith("["):
            host = f"[{host}]"  # an IPv6 address
        urls.append(f"http://{host}:{port}")
    return urls


def probe_rollout(
    controller: Any, config: Any, backend: str, *, role: str = "rollout", get: Any = None, post: Any = None
) -> list[Mapping[str, Any]]:
    """Probe every server ``controller`` started (``role`` "rollout"; the eval rollout's and a
    teacher's are not probed) against the actor's key; returns the reports. ``get``/``post``: the
    HTTP calls (default ``requests``')."""
    where = f"AReaL {backend} rollout servers"
    try:
        settings = validate_fp32_lm_head_config(config)
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
    if settings.mode is None or role not in PROBED_ROLES:
        return []
    key = settings.key or KEY_NAME
    urls = server_urls(controller)
    if not urls:
        from fp32patch.runtime.errors import Fp32LmHeadMismatchError

        raise Fp32LmHeadMismatchError(
            f"fp32patch ({where}): {key} is true but the rollout controller ({type(controller).__name__}) names no "
            "server to probe (no server_infos): nobody could tell what the rollout computes. Use the rollout "
            "controller of AReaL's single controller (rollout._version v1)",
            [],
        )
    get, post = _http(get, post)
    if backend == "sglang":
        return sglang.probe_servers(urls, settings.mode, get=get, post=post, where=where, key=key, logger=STACK.logger)
    how = (
        "Apply fp32patch's areal-fp32-lm-head patch in the environment the vLLM servers run in (AReaL's server "
        "then answers it)"
    )
    reports = [probe.server_reports(post, url, where=f"{where}, {url}", how_to_start=how, path=ROUTE) for url in urls]
    return probe.hold_reports(reports, settings.mode, where=where, key=key, switch=VLLM_SWITCH, logger=STACK.logger)


def _read(info: Any, name: str) -> Any:
    return info.get(name) if isinstance(info, Mapping) else getattr(info, name, None)


def _http(get: Any, post: Any) -> tuple[Any, Any]:
    if get is not None and post is not None:
        return get, post
    import requests

    return get or requests.get, post or requests.post
