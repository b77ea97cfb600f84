"""A vLLM server built the way SkyRL 0.4.0 builds one, in a process of its own:

    python -m tests.heavy.skyrl.server_run SETTINGS_JSON OUT_DIR

SkyRL's config from its own overrides (``SkyRLTrainConfig.from_cli_overrides``: the model, bf16,
``generator.inference_engine.engine_init_kwargs`` for the CPU engine, and ``trainer.fp32_lm_head``
where the settings turn it on, which the stock config refuses as an unknown field), its
``validate_cfg`` (the patched one runs fp32patch's guard), its ``build_vllm_cli_args`` (the patched
one asks vLLM for ``head_dtype`` float32), then what ``VLLMServerActor`` does in its Ray actor:
``VLLM_SERVER_DEV_MODE=1`` and the other variables its ``__init__`` sets, its host and port, and
``_build_and_serve_vllm_server`` (vLLM's OpenAI app and ``AsyncLLMEngine``, SkyRL's endpoints, its
worker extension in every worker). The port goes to ``OUT_DIR/port`` once chosen; the server runs
until it is killed. Not run: Ray (the actor, its placement group), vLLM's router.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

# the CPU engine: its worker class (SkyRL's server path forces the CUDA one where it reads "auto"),
# a fixed KV cache, no CUDA graphs, the suite's context
ENGINE_INIT_KWARGS = {
    "worker_cls": "vllm.v1.worker.cpu_worker.CPUWorker",
    "kv_cache_memory_bytes": 64 << 20,
    "max_model_len": 96,
    "served_model_name": ["tiny"],
}


def overrides(model: str, switch: str | None) -> list[str]:
    """SkyRL's command-line overrides for the run."""
    args = [
        f"trainer.policy.model.path={model}",
        "generator.inference_engine.model_dtype=bfloat16",
        "generator.inference_engine.enforce_eager=true",
        "generator.inference_engine.enable_prefix_caching=false",
        "generator.inference_engine.weight_sync_backend=nccl",
        f"generator.inference_engine.engine_init_kwargs={json.dumps(ENGINE_INIT_KWARGS)}",
        "trainer.placement.colocate_all=false",
        "trainer.seed=0",
        "trainer.logger=console",
    ]
    if switch is not None:
        args.append(f"trainer.fp32_lm_head={switch}")
    return args


def main(settings_path: str, out_dir: str) -> None:
    from tests.heavy.skyrl.py311 import allow_skyrl

    allow_skyrl()
    from skyrl.backends.skyrl_train.inference_servers import utils, vllm_server_actor
    from skyrl.train.config import SkyRLTrainConfig
    from skyrl.train.utils import validate_cfg

    settings = json.loads(Path(settings_path).read_text())
    cfg = SkyRLTrainConfig.from_cli_overrides(overrides(settings["model"], settings["switch"]))
    validate_cfg(cfg)
    args = utils.build_vllm_cli_args(cfg)
    # what VLLMServerActor.__init__ sets before its server starts
    os.environ.update(VLLM_SERVER_DEV_MODE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="1",
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1")  # fmt: skip
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args.host, args.port = "127.0.0.1", port
    (Path(out_dir) / "args.json").write_text(
        json.dumps({"hf_overrides": getattr(args, "hf_overrides", None), "fp32patch": "fp32patch" in sys.modules})
    )
    (Path(out_dir) / "port").write_text(str(port))
    asyncio.run(vllm_server_actor._build_and_serve_vllm_server(args))


if __name__ == "__main__":
    main(*sys.argv[1:])
