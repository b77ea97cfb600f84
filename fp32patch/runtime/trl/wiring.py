"""TRL's trainers, colocated vLLM and ``trl vllm-serve`` get the fp32 LM head where ``fp32_lm_head`` asks.

``check_trainer``: the guard, once a TRL trainer's ``Trainer.__init__`` has run (every TRL
trainer: an unwired one is refused). ``wire_trainer``: GRPO's and RLOO's policy (under PEFT its
base model) and reference model, once built: TRL 1.15+'s chunked log-probs marked for
``fused.ChunkedLogProbs``, earlier releases' head through ``heads.hf``; the mark also tells
``VLLMGeneration`` the switch is on. ``set_vllm_env``: vLLM's switch in the trainer's process
before a colocated ``LLM(...)`` is built. ``serve_command``: ``trl vllm-serve``'s command line
and environment for a server with fp32 heads and the probe's method on every worker.
"""

from __future__ import annotations

import os
import shlex
import sys
import weakref
from collections.abc import MutableMapping
from typing import Any

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.kit import rollout
from fp32patch.runtime.kit.probe import PROBE_EXTENSION
from fp32patch.runtime.modes import VLLM_SWITCH, VLLM_SWITCHES
from fp32patch.runtime.trl.config import KEY, STACK, TrlSettings, check_config, requested_mode
from fp32patch.runtime.trl.fused import MARK, mark, marked_mode

# vLLM's option that adds a class's methods to every worker
WORKER_EXTENSION_FLAG = "--worker-extension-cls"


def check_trainer(trainer: Any, path: str) -> TrlSettings:
    """The guard for ``trainer`` (any TRL trainer, its ``args`` and ``model`` set), whose release
    computes log-probs along ``path`` ("fused" or "logits")."""
    model = getattr(trainer, "model", None)
    _settle_unbuilt_engines()
    return check_config(
        trainer.args,
        trainer=type(trainer),
        path=path,
        where=type(trainer).__name__,
        model_dtype=getattr(model, "dtype", None),
    )


def wire_trainer(trainer: Any, path: str) -> Any:
    """Give GRPO's or RLOO's policy and reference model the fp32 head in the switch's mode:
    ``path`` "fused" marks them for fp32patch's chunked log-probs (TRL 1.15+, after TRL's own
    ``add_fused_lm_head``), "logits" converts their head module. Returns ``trainer``."""
    mode = requested_mode(getattr(trainer.args, KEY, None))
    if mode is None:
        return trainer
    policy = trainer.model
    base = policy.get_base_model() if callable(getattr(policy, "get_base_model", None)) else policy
    models = [("policy", base)]
    if getattr(trainer, "ref_model", None) is not None:
        models.append(("reference model", trainer.ref_model))
    for role, model in models:
        if path == "fused":
            mark(model, mode, role=role)
            STACK.logger.info(
                "fp32patch: the %s's chunked log-probs are fp32 (mode %r): %s", role, mode, type(model).__name__
            )
        else:
            STACK.wire(model, mode, trainer="hf", role=role)
            mark_rollout(model, mode)
    if base is not policy:
        mark_rollout(policy, mode)  # VLLMGeneration holds the PEFT model
    return trainer


def mark_rollout(model: Any, mode: str) -> None:
    """Tell ``VLLMGeneration`` (which reads the mark off the model it is handed) that the switch is on."""
    if marked_mode(model) != mode:
        setattr(model, MARK, mode)


# What each colocated engine's switch was before ``set_vllm_env`` set it, by the trainer's model
# (weakly: gone with the model): ``engine_built`` hands the value to the engine and puts this back.
_SET_FOR: weakref.WeakKeyDictionary[Any, dict[str, str | None]] = weakref.WeakKeyDictionary()


def set_vllm_env(model: Any, *, where: str, environ: MutableMapping[str, str] | None = None) -> str | None:
    """vLLM's switch in this process (the trainer's, whose colocated vLLM is about to be built)
    from the mark the trainer's wiring left on ``model``; refuses an on switch without the mark
    (the trainer's head would stay bf16). See ``kit.rollout.set_vllm_env``. What it sets is for
    that engine only: ``engine_built`` hands it to the engine and puts the process's back."""
    target = os.environ if environ is None else environ
    before = {name: target.get(name) for name in VLLM_SWITCHES}
    value = rollout.set_vllm_env(marked_mode(model), key=KEY, where=where, logger=STACK.logger, environ=environ)
    if environ is None and any(target.get(name) != was for name, was in before.items()):
        _SET_FOR[model] = before
    return value


def _settle_unbuilt_engines() -> None:
    """Put back a switch set for a colocated engine whose build never reached ``engine_built``
    (``LLM(...)`` raised): it belonged to no engine, and is not the next trainer's."""
    from fp32patch.runtime.heads import vllm_engine_switch

    for model in list(_SET_FOR):
        vllm_engine_switch.put_back(os.environ, _SET_FOR.pop(model))


def engine_built(llm: Any, model: Any) -> None:
    """Once the colocated ``LLM(...)`` for ``model``'s trainer is built (or failed to be): the
    switch ``set_vllm_env`` set becomes the engine's own (``heads.vllm_engine_switch.hold``: it
    computes every later logits with it) and this process's environment is as it was, so the
    next trainer built here gets what its own switch asks. A switch the user set is left alone."""
    before = _SET_FOR.pop(model, None)
    if before is None:
        return
    from fp32patch.runtime.heads import vllm_engine_switch

    try:
        if llm is not None:
            engine_model = llm.llm_engine.model_executor.driver_worker.model_runner.model
            vllm_engine_switch.hold(engine_model, {name: os.environ.get(name) for name in VLLM_SWITCHES})
    finally:
        vllm_engine_switch.put_back(os.environ, before)


def serve_command(
    script_args: Any, command: list[str], env: MutableMapping[str, str], *, where: str = "trl vllm-serve"
) -> list[str]:
    """``trl vllm-serve``'s ``vllm serve`` command line and environment (changed in place) for
    ``--fp32_lm_head``: vLLM's switch in the server's environment, and fp32patch's probe method on
    every worker (``--worker-extension-cls``), which the trainer calls at startup. Refuses a
    switch in the environment without the flag, and a worker extension of the user's own."""
    try:
        mode = requested_mode(getattr(script_args, KEY, None))
    except Fp32LmHeadConfigError as exc:
        raise Fp32LmHeadConfigError(f"fp32patch ({where}): {exc}") from None
    value = rollout.set_vllm_env(mode, key=f"--{KEY}", where=where, logger=STACK.logger, environ=env)
    if mode is None:
        return command
    given = [arg for arg in command if arg == WORKER_EXTENSION_FLAG or arg.startswith(WORKER_EXTENSION_FLAG + "=")]
    if given:
        raise Fp32LmHeadConfigError(
            f"fp32patch ({where}): --{KEY} {mode} needs fp32patch's probe on every vLLM worker "
            f"({WORKER_EXTENSION_FLAG} {PROBE_EXTENSION}), but the command already names a worker extension "
            f"({' '.join(given)}): vLLM takes one. Give your extension a method fp32patch_probe_lm_head that "
            "returns fp32patch.runtime.heads.vllm_probe.probe_vllm_model(self.model_runner.model), and run vLLM "
            f"directly, or drop --{KEY}"
        )
    command = [*command, WORKER_EXTENSION_FLAG, PROBE_EXTENSION]
    directly = shlex.join(["vllm", *command[command.index("serve") :]])
    # trl vllm-serve is a command line that configures no logging: said on stderr, as TRL says its own notice
    print(
        f"fp32patch ({where}): --{KEY} {mode}: fp32 logits in every vLLM worker, and fp32patch's probe on each; "
        f"without trl vllm-serve: {VLLM_SWITCH}={value} VLLM_SERVER_DEV_MODE=1 {directly}",
        file=sys.stderr,
    )
    return command
