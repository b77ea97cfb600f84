"""The heavy vLLM suite: runs under a test environment that holds a whole vLLM release.

At collection it builds a patched import root next to the environment: hardlinks of the
installed ``vllm`` package and its ``.dist-info`` (so nothing is copied and the
environment itself is never modified: our writes replace files, never write through
links), patched with ``fp32patch apply``, and put first on ``sys.path``. Every test then
imports the patched vLLM, exactly as an image patched at build time would.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.pop("NRL_VLLM_FP32_LM_HEAD", None)

REPO = Path(__file__).resolve().parents[3]
NEMOTRON = "vllm/model_executor/models/nemotron_h.py"
SITE = Path(sysconfig.get_paths()["purelib"])


def _patched_root() -> Path:
    parent = Path(sys.prefix).parent / "patched-roots"
    parent.mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"{Path(sys.prefix).name}-", dir=parent))
    for item in [SITE / "vllm", *SITE.glob("vllm-*.dist-info")]:
        shutil.copytree(item, root / item.name, copy_function=os.link)
    subprocess.run([sys.executable, "-m", "fp32patch", "apply", "-s", str(root)], check=True, cwd=REPO)
    return root


PATCHED_ROOT: Path | None = None


def pytest_configure(config):
    """Each process that runs tests patches a root of its own (a pytest-xdist controller,
    which runs none, patches nothing)."""
    global PATCHED_ROOT
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    PATCHED_ROOT = _patched_root()
    sys.path.insert(0, str(PATCHED_ROOT))


def pytest_unconfigure(config):
    if PATCHED_ROOT is not None:
        shutil.rmtree(PATCHED_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def vllm_runtime():
    """vLLM's distributed state (gloo, world size 1) and a builder of tiny NemotronH models."""
    from tests.heavy.vllm import tiny
    from tests.support.rendezvous import file_store

    with file_store() as init_method, tiny.session(init_method) as builder:
        yield builder


@pytest.fixture
def env(monkeypatch):
    """Set (a value) or unset (None) NRL_VLLM_FP32_LM_HEAD for one test."""

    def set_way(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv("NRL_VLLM_FP32_LM_HEAD", raising=False)
        else:
            monkeypatch.setenv("NRL_VLLM_FP32_LM_HEAD", value)

    return set_way


@pytest.fixture
def decisions():
    """The runtime's log lines (vLLM's logger may not propagate to the root logger)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.fp32patch")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


@pytest.fixture(scope="session")
def stock_processor_class():
    """The environment's unpatched LogitsProcessor, loaded under another module name."""
    import vllm.model_executor.layers.logits_processor  # noqa: F401  (the patched one registers first)
    from vllm.model_executor import custom_op

    registry = custom_op.op_registry  # vLLM registers the class by name and refuses a second one
    path = Path(sysconfig.get_paths()["purelib"]) / "vllm/model_executor/layers/logits_processor.py"
    spec = importlib.util.spec_from_file_location("stock_logits_processor", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["stock_logits_processor"] = module
    kept = registry.pop("logits_processor")
    try:
        spec.loader.exec_module(module)
    finally:
        registry["logits_processor"] = kept
    assert not hasattr(module, "_fp32patch_lm_head_runtime")
    return module.LogitsProcessor
