"""Shared fixtures for the main suite (runs in .venv)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest
from typer.testing import CliRunner

# tests/heavy/<dir>/ run under their own interpreters (see Makefile, tests/envs/build.py);
# a run that names them explicitly still collects them.
collect_ignore = [] if os.environ.get("FP32PATCH_HEAVY") else ["heavy"]
# tests/recipes (the docs' recipes in their stacks' layouts: make test-recipes) and tests/images
# (podman builds: make test-images) have targets of their own, as the heavy suites do
collect_ignore += [suite for suite in ("recipes", "images") if not os.environ.get(f"FP32PATCH_{suite.upper()}")]

NEMOTRON = "vllm/model_executor/models/nemotron_h.py"
LOGITS_PROCESSOR = "vllm/model_executor/layers/logits_processor.py"


class Cli:
    """Runs the fp32patch CLI in-process, the way a user's shell would see it."""

    def __init__(self) -> None:
        self.runner = CliRunner()

    def __call__(self, *args: str, env: dict | None = None):
        from fp32patch.cli import app

        result = self.runner.invoke(app, [str(a) for a in args], env=env, catch_exceptions=False)
        return result

    def json(self, *args: str):
        result = self(*args, "--json")
        return result.exit_code, json.loads(result.stdout)


@pytest.fixture
def cli() -> Cli:
    return Cli()


@pytest.fixture(scope="session")
def vllm_stock(tmp_path_factory) -> Path:
    """vLLM 0.25.1's two target files and its dist-info from its wheel, as pip lays them out (never written)."""
    from tests.support.pypi import import_root_from_members

    return import_root_from_members("vllm", "0.25.1", [NEMOTRON, LOGITS_PROCESSOR], tmp_path_factory.mktemp("s") / "sp")


@pytest.fixture
def vllm_root(vllm_stock, tmp_path) -> Path:
    """A copy of ``vllm_stock`` for one test to change."""
    import shutil

    dest = tmp_path / "sp"
    shutil.copytree(vllm_stock, dest)
    return dest


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (symlinks by target), for "nothing changed" checks."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "-> " + os.readlink(path)
        elif path.is_file():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            out[rel] = "dir"
    return out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def default_sigint() -> None:
    """A CLI process's ``preexec_fn``: Ctrl-C as a terminal delivers it. An ignored SIGINT is inherited
    (a shell's background job, ``nohup``, an xdist worker after earlier tests pass SIG_IGN on), Python
    then never raises KeyboardInterrupt, and the CLI rightly keeps an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
