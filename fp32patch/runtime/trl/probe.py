"""TRL's trainer holds vLLM's LM heads to ``fp32_lm_head`` before the first rollout.

Colocated (``vllm_mode="colocate"``), vLLM's worker runs in the trainer's process: once
``LLM(...)`` is built, and before sleep mode can discard its weights, the model TRL refits
(``llm_engine.model_executor.driver_worker.model_runner.model``) is probed in place. A server
(``vllm_mode="server"``): the trainer's main process asks every worker over HTTP
(``/collective_rpc``, vLLM's development endpoint, answered by fp32patch's worker extension that
``trl vllm-serve --fp32_lm_head`` adds); a server that cannot answer, such as one started with
``vllm serve`` without it, is refused. Either way a worker whose logits are not float32 stops
the trainer at startup, naming the worker and why.
"""

from __future__ import annotations

from typing import Any

from fp32patch.runtime.kit.probe import PROBE_EXTENSION, hold_reports, server_reports
from fp32patch.runtime.modes import VLLM_SWITCH
from fp32patch.runtime.trl.config import KEY, STACK
from fp32patch.runtime.trl.fused import marked_mode

HOW_TO_START = (
    f"Start the server with `trl vllm-serve --model ... --{KEY} true` (in an environment where "
    "`fp32patch apply` patched vLLM), or run vLLM's own server as it does: "
    f"`{VLLM_SWITCH}=1 VLLM_SERVER_DEV_MODE=1 vllm serve ... --worker-extension-cls {PROBE_EXTENSION}`"
)
# where vLLM's switch is set, for a worker that has none
WHERE_SET = f" (trl vllm-serve --{KEY} sets it for a server; the trainer sets it for a colocated vLLM)"


def probe_colocated(llm: Any, model: Any, *, where: str = "colocated vLLM") -> list[Any]:
    """Probe the vLLM model in this process (the one TRL refits) against ``model``'s mark; then
    the switch set for it stays the engine's own, and the process's environment is put back."""
    from fp32patch.runtime.heads.vllm_probe import probe_vllm_model
    from fp32patch.runtime.trl.wiring import engine_built

    try:
        engine_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
        return check_reports([probe_vllm_model(engine_model)], marked_mode(model), where=where)
    finally:
        engine_built(llm, model)  # the switch set for this engine is its own; the process's is put back


def probe_server(client: Any, model: Any, *, where: str = "vLLM server", post: Any = None) -> list[Any]:
    """Ask every worker of the server TRL's ``VLLMClient`` talks to; check them against the mark.
    ``post``: the HTTP call (default one plain ``requests.post``, a dependency of TRL's client,
    not the client's session, which retries a 500 until its answer is lost)."""
    if post is None:
        import requests

        post = requests.post
    reports = server_reports(post, client.base_url, where=where, how_to_start=HOW_TO_START)
    return check_reports(reports, marked_mode(model), where=where)


def check_reports(reports: Any, mode: str | None, *, where: str) -> list[Any]:
    """Refuse (``Fp32LmHeadMismatchError``) unless every worker computes float32 logits where
    the switch is on (``mode``), and none does where it is off. Logs one line when all agree."""
    return hold_reports(
        reports,
        mode,
        where=where,
        key=KEY,
        switch=VLLM_SWITCH,
        logger=STACK.logger,
        subject="vLLM's logits",
        hint=WHERE_SET,
    )
