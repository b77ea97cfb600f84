"""Build (or reuse) the heavy test environments: real vLLM, megatron-core, transformers.

Each environment is a virtualenv under ``$FP32PATCH_TEST_CACHE`` (default
``~/.cache/fp32patch-tests``), outside the repository, built from a recipe below. A
recipe's hash is stored in the environment; a changed recipe rebuilds it. The tests
that need one run with its interpreter (``make test`` does this) and put the
repository on ``PYTHONPATH``; fp32patch itself is never installed into them.

    python tests/envs/build.py [NAME ...]     # default: every recipe
    python tests/envs/build.py --path NAME    # print the interpreter's path
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

# Test dependencies every heavy environment needs to run pytest over our tests.
_TEST_DEPS = ["pytest>=8", "libcst>=1.1", "typer>=0.12", "rich>=13", "packaging>=23"]

# name -> list of pip argument lists, run in order with the environment's pip.
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
    # fp32patch's own dependencies at the lowest versions pyproject.toml allows (the main
    # suite's .venv has the newest), with what the main suite needs to run.
    "lowest": [
        ["install", "torch==2.13.0"],
        ["install", "pytest>=8,<9", "hypothesis>=6.100", "fastapi>=0.110", "httpx>=0.27"],
        # last, so that nothing installed after them moves them up
        ["install", "libcst==1.1.0", "typer==0.16.0", "rich==13.0.0", "packaging==23.0"],
    ],
}
# Recipes that pin fp32patch's own dependencies take no shared test dependencies after them.
_OWN_PINS: dict[str, list[str]] = {"lowest": []}


def cache_root() -> Path:
    return Path(os.environ.get("FP32PATCH_TEST_CACHE", Path.home() / ".cache" / "fp32patch-tests"))


def env_dir(name: str) -> Path:
    return cache_root() / "envs" / name


def env_python(name: str) -> Path:
    return env_dir(name) / "bin" / "python"


def _recipe_hash(name: str) -> str:
    blob = json.dumps({"recipe": RECIPES[name], "test": _OWN_PINS.get(name, _TEST_DEPS), "py": sys.version_info[:2]})
    return hashlib.sha256(blob.encode()).hexdigest()


def is_ready(name: str) -> bool:
    stamp = env_dir(name) / ".fp32patch-recipe"
    return env_python(name).exists() and stamp.exists() and stamp.read_text() == _recipe_hash(name)


def build(name: str) -> Path:
    if name not in RECIPES:
        raise SystemExit(f"unknown test environment {name!r}; known: {', '.join(sorted(RECIPES))}")
    if is_ready(name):
        print(f"[envs] {name}: ready at {env_dir(name)}", flush=True)
        return env_python(name)
    target = env_dir(name)
    # The stamp is written last: an environment without it is a half-built one.
    shutil.rmtree(target, ignore_errors=True)
    print(f"[envs] {name}: building in {target}", flush=True)
    venv.EnvBuilder(with_pip=True, symlinks=True).create(target)
    pip = [str(target / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "-q", "--upgrade", "pip"], check=True)
    for args in RECIPES[name]:
        print(f"[envs] {name}: pip {' '.join(args)}", flush=True)
        subprocess.run([*pip, *args], check=True)
    extra = _OWN_PINS.get(name, _TEST_DEPS)
    if extra:
        subprocess.run([*pip, "install", "-q", *extra], check=True)
    (target / ".fp32patch-recipe").write_text(_recipe_hash(name))
    print(f"[envs] {name}: ready at {target}", flush=True)
    return env_python(name)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--path"]:
        print(env_python(argv[1]))
        return 0
    for name in argv or sorted(RECIPES):
        build(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
