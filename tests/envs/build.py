"""Build (or reuse) the heavy test environments: real vLLM, real megatron-core, real transformers, real verl.

Each environment is a virtualenv under ``$FP32PATCH_TEST_CACHE`` (default
``~/.cache/fp32patch-tests``), outside the repository, installed from a lock kept beside
this file (``locks/<name>.txt``: every distribution at an exact version, as ``pip freeze``
wrote it on the day the lock was refreshed), so a new upstream release cannot change what a
fresh machine tests. The lock's hash is stored in the environment; a changed lock rebuilds it.
The tests that need one run with its interpreter (``make test`` does this) and put the
repository on ``PYTHONPATH``; fp32patch itself is never installed into them.

A lock is refreshed from its recipe below (what the environment is for, unpinned where the
recipe says so), resolved anew on that day, and the environment is rebuilt from it:

    python tests/envs/build.py [NAME ...]          # build from the locks (default: every one)
    python tests/envs/build.py --path NAME         # print the interpreter's path
    python tests/envs/build.py --refresh NAME ...  # resolve the recipe today, write the lock
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

LOCKS = Path(__file__).resolve().parent / "locks"

# Test dependencies every heavy environment needs to run pytest over our tests.
_TEST_DEPS = ["pytest>=8", "pytest-xdist>=3", "libcst>=1.1", "typer>=0.16", "rich>=13", "packaging>=23"]

# name -> list of pip argument lists, run in order with the environment's pip when a lock is
# refreshed. Building from a lock runs none of them.
RECIPES: dict[str, list[list[str]]] = {
    # The newest vLLM, whole, as an image would hold it (its CUDA torch runs on the CPU).
    "vllm-0.33": [["install", "vllm==0.33.0"]],
    # The release NeMo-RL pins, from before vLLM had its own fp32 head (head_dtype, 0.26).
    "vllm-0.25": [["install", "vllm==0.25.1"]],
    # Real megatron-core on the CPU torch this machine carries; megatron-core 0.19 declares
    # a newer Python than some of ours, which it does not need.
    "megatron": [
        ["install", "torch==2.13.0", "triton"],
        ["install", "--ignore-requires-python", "megatron-core==0.19.2", "numpy<2.5"],
    ],
    # Hugging Face transformers at the release NeMo-RL pins (5.5), on the CPU torch this machine
    # carries: the PyTorch/HF head under FSDP2 and tensor parallelism (gloo); peft for the real
    # LoRA head the runtime refuses
    "transformers": [
        ["install", "torch==2.13.0"],
        ["install", "transformers==5.5.4", "peft==0.21.2"],
    ],
    # verl's newest release, whole (no vLLM or SGLang: the suite runs its FSDP engine and config
    # on the CPU), at the transformers release NeMo-RL pins (verl 0.9.1 allows 5.5.3-5.10); the
    # verl-core extra and pytest-asyncio are what verl's own CPU tests (from its sdist) import
    "verl-0.9.1": [
        ["install", "torch==2.13.0"],
        ["install", "verl[verl-core]==0.9.1", "transformers==5.5.4", "torch==2.13.0", "pytest-asyncio"],
    ],
    # verl 0.7.1: the last release with the legacy FSDP workers beside the engine, whose rmpad
    # path divides the logits in place. It pins numpy<2, which pyarrow 26 needs without declaring
    # it (import pyarrow fails), hence pyarrow<26
    "verl-0.7.1": [
        ["install", "torch==2.13.0"],
        ["install", "verl==0.7.1", "transformers==5.5.4", "pyarrow<26", "torch==2.13.0", "pytest-asyncio"],
    ],
    # fp32patch's own dependencies at the lowest versions pyproject.toml allows (the main
    # suite's .venv has the newest), with what the main suite needs to run.
    "lowest": [
        ["install", "torch==2.13.0"],
        ["install", "pytest>=8,<9", "pytest-xdist>=3", "hypothesis>=6.100", "fastapi>=0.110", "httpx>=0.27"],
        # last, so that nothing installed after them moves them up
        ["install", "libcst==1.1.0", "typer==0.16.0", "rich==13.0.0", "packaging==23.0"],
    ],
}
# Recipes that pin fp32patch's own dependencies take no shared test dependencies after them.
_OWN_PINS: dict[str, list[str]] = {"lowest": []}
# Flags of a recipe's pip steps that installing its lock needs again (megatron-core declares a
# newer Python than it needs); the rest only steer resolution, which a lock has done already.
_LOCK_FLAGS = ("--ignore-requires-python",)


def lock_flags(name: str) -> list[str]:
    """The pip flags the build from ``name``'s lock takes over from its recipe."""
    return [flag for flag in _LOCK_FLAGS if any(flag in step for step in RECIPES[name])]


def cache_root() -> Path:
    return Path(os.environ.get("FP32PATCH_TEST_CACHE", Path.home() / ".cache" / "fp32patch-tests"))


def env_dir(name: str) -> Path:
    return cache_root() / "envs" / name


def env_python(name: str) -> Path:
    return env_dir(name) / "bin" / "python"


def lock_path(name: str) -> Path:
    return LOCKS / f"{name}.txt"


def _stamp(name: str) -> str:
    """What an environment built from today's lock is stamped with."""
    lock = lock_path(name).read_bytes()
    return hashlib.sha256(lock + repr(sys.version_info[:2]).encode()).hexdigest()


def is_ready(name: str) -> bool:
    stamp = env_dir(name) / ".fp32patch-lock"
    return env_python(name).exists() and stamp.exists() and stamp.read_text() == _stamp(name)


def _known(name: str) -> None:
    if name not in RECIPES:
        raise SystemExit(f"unknown test environment {name!r}; known: {', '.join(sorted(RECIPES))}")


def _fresh_venv(target: Path) -> list[str]:
    shutil.rmtree(target, ignore_errors=True)
    venv.EnvBuilder(with_pip=True, symlinks=True).create(target)
    pip = [str(target / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "-q", "--upgrade", "pip"], check=True)
    return pip


def build(name: str) -> Path:
    """The environment ``name``, installed from its lock (rebuilt when the lock changed)."""
    _known(name)
    lock = lock_path(name)
    if not lock.is_file():
        raise SystemExit(f"no lock for test environment {name!r} at {lock}; write one with: {_refresh_command(name)}")
    if is_ready(name):
        print(f"[envs] {name}: ready at {env_dir(name)}", flush=True)
        return env_python(name)
    target = env_dir(name)
    print(f"[envs] {name}: building from {lock.relative_to(LOCKS.parent.parent.parent)} in {target}", flush=True)
    # The stamp is written last: an environment without it is a half-built one.
    pip = _fresh_venv(target)
    # Every distribution is in the lock at its version: nothing is resolved, nothing newer arrives.
    subprocess.run([*pip, "install", "-q", "--no-deps", *lock_flags(name), "-r", str(lock)], check=True)
    subprocess.run([*pip, "check"], check=True, stdout=subprocess.DEVNULL)
    (target / ".fp32patch-lock").write_text(_stamp(name))
    print(f"[envs] {name}: ready at {target}", flush=True)
    return env_python(name)


def refresh(name: str) -> Path:
    """Resolve ``name``'s recipe today, write its lock from what was installed, and keep that
    environment as the one built from the new lock."""
    _known(name)
    target = env_dir(name)
    print(f"[envs] {name}: resolving the recipe in {target}", flush=True)
    pip = _fresh_venv(target)
    for args in RECIPES[name]:
        print(f"[envs] {name}: pip {' '.join(args)}", flush=True)
        subprocess.run([*pip, *args], check=True)
    extra = _OWN_PINS.get(name, _TEST_DEPS)
    if extra:
        subprocess.run([*pip, "install", "-q", *extra], check=True)
    # --all: setuptools too (torch 2.14 requires a newer one than a fresh venv carries), but
    # not pip, which every build upgrades on its own
    frozen = subprocess.run([*pip, "freeze", "--all"], check=True, capture_output=True, text=True).stdout
    frozen = "".join(line for line in frozen.splitlines(keepends=True) if not line.lower().startswith("pip=="))
    header = (
        f"# The {name} test environment, as resolved from its recipe in tests/envs/build.py.\n"
        f"# Refresh with: {_refresh_command(name)}\n"
    )
    LOCKS.mkdir(exist_ok=True)
    lock = lock_path(name)
    with tempfile.NamedTemporaryFile("w", dir=LOCKS, delete=False, suffix=".tmp") as handle:
        handle.write(header + "".join(sorted(frozen.splitlines(keepends=True), key=str.lower)))
    os.replace(handle.name, lock)
    (target / ".fp32patch-lock").write_text(_stamp(name))
    print(f"[envs] {name}: wrote {lock}", flush=True)
    return env_python(name)


def _refresh_command(name: str) -> str:
    return f"python tests/envs/build.py --refresh {name}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--path"]:
        print(env_python(argv[1]))
        return 0
    if argv[:1] == ["--refresh"]:
        for name in argv[1:] or sorted(RECIPES):
            refresh(name)
        return 0
    for name in argv or sorted(RECIPES):
        build(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
