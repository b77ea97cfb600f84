"""slime's SGLang servers held to ``--fp32-lm-head`` at startup.

Each ``SGLangEngine`` probes its own server once ``init`` has launched it (it answers
``/health_generate``) or checked an external one: ``kit.sglang.probe_servers`` reads its
``/server_info`` and measures the grade of the log-probs one short generation returns, and a
server that would give bf16 log-probs stops slime's start, naming it. Only the server's first
node listens for HTTP (the others return at once); an encoder-only server and one that serves
embeddings or scores (``is_embedding``, a ``--sglang-config`` reward model's) compute no logits. A
prefill or decode server of a disaggregated pair cannot generate alone: its arguments are read,
not measured (said in the log).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fp32patch.runtime.kit import sglang
from fp32patch.runtime.slime.config import FLAG, STACK, requested_mode

WHERE = "SGLang rollout server"
# worker types that serve no logits, and those that cannot generate alone (PD disaggregation)
NO_LOGITS = ("encoder",)
PAIRED = ("prefill", "decode")


def probe_engine(engine: Any, *, get: Any = None, post: Any = None) -> list[Mapping[str, Any]]:
    """Probe the server ``engine`` (slime's ``SGLangEngine``, after ``init``) launched or reached,
    against ``engine.args``'s flag; returns the reports ([] where there is nothing to probe).
    ``get``/``post``: the HTTP calls (default ``requests``', with the server's API key)."""
    mode = requested_mode(getattr(engine.args, "fp32_lm_head", None))
    worker = getattr(engine, "worker_type", "regular")
    if getattr(engine, "node_rank", 0) != 0 or worker in NO_LOGITS:
        return []
    overrides = {str(k).replace("-", "_"): v for k, v in (getattr(engine, "sglang_overrides", None) or {}).items()}
    if overrides.get("is_embedding", getattr(engine.args, "sglang_is_embedding", False)):
        STACK.logger.info(
            "fp32patch (%s %s): the server serves embeddings or scores (is_embedding), no logits: not probed",
            WHERE,
            getattr(engine, "rank", "?"),
        )
        return []
    url = f"http://{engine.server_host}:{engine.server_port}"
    where = f"{WHERE} {getattr(engine, 'rank', '?')}"
    get, post = _http(getattr(engine.args, "sglang_api_key", None), get, post)
    if worker in PAIRED:
        return [_read_only(url, worker, mode, get=get, where=where)]
    return sglang.probe_servers([url], mode, get=get, post=post, where=where, key=FLAG, logger=STACK.logger)


def _read_only(url: str, worker: str, mode: str | None, *, get: Any, where: str) -> Mapping[str, Any]:
    """A disaggregated server's report from its arguments alone (it cannot generate without its pair)."""
    from fp32patch.runtime.errors import Fp32LmHeadMismatchError

    try:
        response = get(f"{url}/server_info", timeout=120)
        if getattr(response, "status_code", 200) != 200:
            raise ValueError(f"/server_info answered {response.status_code}")
        info = response.json()
    except Exception as exc:  # the client's own error type
        raise Fp32LmHeadMismatchError(
            f"fp32patch ({where}): cannot read the {worker} SGLang server's arguments at {url}: "
            f"{type(exc).__name__}: {exc}. {FLAG} asks for fp32 logits and nobody could tell what it computes",
            [],
        ) from None
    report = sglang.server_report(info, None, server=f"{url} ({worker}, arguments read, not measured)")
    STACK.logger.info(
        "fp32patch (%s): the %s server at %s cannot generate alone: its arguments are read", where, worker, url
    )
    return sglang.hold_server_reports([report], mode, where=where, key=FLAG, logger=STACK.logger)[0]


def _http(api_key: str | None, get: Any, post: Any) -> tuple[Any, Any]:
    if get is not None and post is not None:
        return get, post
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return (
        get or (lambda url, **kw: requests.get(url, headers=headers, **kw)),
        post or (lambda url, **kw: requests.post(url, headers=headers, **kw)),
    )
