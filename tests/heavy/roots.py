"""A patched import root beside a heavy test environment: a copy of one stack's package and
hardlinks of the environment's ``vllm`` where it has one (each with its ``.dist-info``), patched by
fp32patch's CLI.
Nothing of the environment changes: the patcher replaces files, never writes through a link."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SITE = Path(sysconfig.get_paths()["purelib"])
MARKER = "fp32patch"


def patched_root(package: str, patched_file: str, *, marker: str = MARKER, label: str = "") -> Path:
    """``package`` copied and vLLM linked into a temp folder under ``<envs>/patched-roots``, then
    ``fp32patch apply``; ``patched_file`` (relative to the root) must then hold ``marker``."""
    parent = Path(sys.prefix).parent / "patched-roots"
    parent.mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix=f"{Path(sys.prefix).name}-{label}", dir=parent))
    for item in [SITE / package, *SITE.glob(f"{package}-*.dist-info")]:
        shutil.copytree(item, root / item.name, ignore=shutil.ignore_patterns("__pycache__"))
    for item in [SITE / "vllm", *SITE.glob("vllm*.dist-info")]:
        if item.exists():  # an environment without vLLM (megatron's): the stack's package alone
            shutil.copytree(item, root / item.name, copy_function=os.link)
    subprocess.run(
        [sys.executable, "-m", "fp32patch", "apply", "-s", str(root)],
        check=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
    )
    assert marker in (root / patched_file).read_text()
    return root
