"""Install torch's CPU build for development (``make install``), saying what it downloads.

fp32patch's CLI never imports torch; the runtime's tests do, on the CPU. On Linux, PyPI's
``torch`` is the CUDA build with several GB of ``nvidia-*`` packages, so the CPU build is
taken from PyTorch's CPU index (its ``+cpu`` local version sorts above PyPI's). An index
that cannot be reached must not cost minutes of pip's retries: it is probed once, with a
short timeout, and left out when it does not answer. A CPU wheel pip already finds
(``find-links``, a local index) is taken as it is.

    python tools/cpu_torch.py torch==2.13.0 [--index URL] [--dry-run]
"""

from __future__ import annotations

import argparse
import platform
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PROBE_SECONDS = 5.0


def reachable(url: str, timeout: float = PROBE_SECONDS) -> bool:
    """Whether ``url`` answers at all (any HTTP status counts) within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            return True
    except urllib.error.HTTPError:
        return True  # it answered
    except (OSError, ValueError):
        return False


def plan(requirement: str, index: str) -> tuple[list[str], str]:
    """The pip command, and the line that says what it will download."""
    pip = [sys.executable, "-m", "pip", "install", "-q", requirement]
    system = platform.system()
    if system == "Darwin":  # PyPI's macOS wheels are CPU builds already
        return pip, f"{requirement}: PyPI's macOS build (a CPU build)"
    if not index:
        return pip, f"{requirement} from pip's configured indexes (no CPU index given)"
    started = time.monotonic()
    if reachable(index):
        return [*pip, "--extra-index-url", index], f"{requirement}, CPU build, from {index} (about 200 MB)"
    waited = time.monotonic() - started
    when = f"after {waited:.1f} s" if waited >= 0.1 else "at once: no connection"
    return pip, (
        f"{requirement} from pip's configured indexes: {index} did not answer ({when}), so it is "
        "left out. A CPU wheel in them (find-links, a local index) is taken; otherwise, on Linux, PyPI's torch "
        "is the CUDA build with several GB of nvidia packages (set TORCH_INDEX to a CPU index you can reach)"
    )


def installed_torch() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "not installed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("requirement", help="e.g. torch==2.13.0")
    parser.add_argument("--index", default=CPU_INDEX, help="PyTorch's CPU index (empty: none)")
    parser.add_argument("--dry-run", action="store_true", help="say what would run, install nothing")
    args = parser.parse_args()
    command, what = plan(args.requirement, args.index)
    print(f"torch for the runtime's tests (the CLI never imports it): {what}", flush=True)
    print("  " + shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    code = subprocess.run(command).returncode
    print(f"torch: {installed_torch()}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
