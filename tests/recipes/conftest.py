"""The recipe suite: README's and docs/*.md's recipes, read out of the Markdown
(tests/support/recipes.py), run word for word in the layout each stack's image has.

    make test-recipes      (FP32PATCH_RECIPES=1 python -m pytest tests/recipes)

The wheel every recipe installs is the one ``make dist`` writes, built in a copy of this
working tree (so that ``make dist`` in a recipe writes there, never in the checkout under test).
Each layout is a folder ``root`` that stands for the image's ``/``: a recipe's absolute paths
(``/opt/``, ``/tmp/``, an image's site-packages) are substituted with folders under it, and
nothing else of its text changes. The commands run under ``/bin/sh -c`` as a Dockerfile's RUN
does, with the layout's own ``bin`` folders first on PATH and no PYTHONPATH, so ``fp32patch``
is the wheel's, in the layout's Python.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import recipes
from tests.support.pypi import _locked, cache_root

REPO = Path(__file__).resolve().parents[2]


def clean_env(path: list[Path], **extra: str) -> dict[str, str]:
    """The environment a recipe runs in: this one without Python's or a venv's variables, PATH the
    layout's folders then the system's."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTEST_ADDOPTS")
    }
    system = [p for p in os.environ["PATH"].split(os.pathsep) if p and not (Path(p).parent / "pyvenv.cfg").exists()]
    env["PATH"] = os.pathsep.join([*map(str, path), *system])
    env.setdefault("UV_CACHE_DIR", str(cache_root() / "uv"))
    # pip's configuration, not a recipe's text: no bytecode for what pip installs (vLLM's thousands of
    # modules, twice in README's lines), which no recipe reads. pip takes a "no-" option's variable
    # inverted: PIP_NO_COMPILE=0 is --no-compile (pypa/pip#5735)
    env.setdefault("PIP_NO_COMPILE", "0")
    env.update(extra)
    return env


def sh(command: str, env: dict[str, str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """``/bin/sh -c command``, as a Dockerfile's RUN runs it; on failure the output says which line."""
    result = subprocess.run(["/bin/sh", "-c", command], env=env, cwd=cwd, capture_output=True, text=True)
    if check and result.returncode:
        raise AssertionError(
            f"exit {result.returncode}: {command}\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"
        )
    return result


@dataclasses.dataclass
class Layout:
    """An image's filesystem, stood in for by folders: ``paths`` maps a recipe's absolute prefixes
    to them; ``context`` is the build context COPY reads from; ``env`` what RUN runs under."""

    root: Path
    context: Path
    paths: dict[str, str]
    env: dict[str, str]
    image: str | None = None  # what the recipe's FROM must name, where it has one

    def run(self, command: str, check: bool = True) -> subprocess.CompletedProcess:
        return sh(command, self.env, self.root, check)

    def dockerfile(self, block: recipes.Block) -> list[subprocess.CompletedProcess]:
        """The block's instructions, in order: FROM names this layout's image, COPY copies from the
        context, RUN runs (each must exit 0, as in ``docker build``), ENV sets the variable."""
        results = []
        steps = recipes.dockerfile(block.text)
        if not any(step.keyword == "COPY" for step in steps):
            # a recipe that adds to README's plain one (README's NeMo-RL lines, SGLang's RUN line): that
            # recipe's COPY of the wheel to /tmp/ came first
            (self.root / "tmp").mkdir(parents=True, exist_ok=True)
            for wheel in self.context.glob("*.whl"):
                shutil.copy(wheel, self.root / "tmp")
        for step in steps:
            if step.keyword == "FROM":
                assert step.args == self.image, f"{block.where}: FROM {step.args}, this layout stands for {self.image}"
            elif step.keyword == "COPY":
                *sources, dest = self.subst(step.args).split()
                if dest.endswith("/"):
                    Path(dest).mkdir(parents=True, exist_ok=True)
                for source in sources:
                    shutil.copy(self.context / source, dest)
            elif step.keyword == "RUN":
                results.append(self.run(self.subst(step.args)))
            elif step.keyword == "ENV":
                key, _, value = step.args.partition("=")
                self.env[key] = value
        return results

    def subst(self, text: str) -> str:
        return recipes.substitute(text, {k: v for k, v in self.paths.items() if k in text})


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def copy_tree(dest: Path) -> Path:
    """A copy of this working tree's files (tracked and new, not ignored), as a clone holds them."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in map(os.fsdecode, filter(None, names)):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


@pytest.fixture(scope="session")
def clone(tmp_path_factory, worker_id) -> Path:
    """A copy of this working tree in which ``make dist`` ran once, shared by the xdist workers."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent
    dest = shared / "recipes-clone"
    with _locked(f"recipes-clone-{shared.name}"):
        if not (dest / "dist").is_dir():
            shutil.rmtree(dest, ignore_errors=True)
            copy_tree(dest)
            subprocess.run(["make", "dist"], cwd=dest, check=True, capture_output=True, env=clean_env([]))
    return dest


@pytest.fixture(scope="session")
def dist(clone) -> dict[str, str]:
    """What ``make dist`` wrote: the wheel's and the sdist's sha256, by file name."""
    return {p.name: sha256(p) for p in sorted((clone / "dist").iterdir())}


@pytest.fixture(scope="session")
def wheel(clone, dist) -> Path:
    (found,) = [clone / "dist" / name for name in dist if name.endswith(".whl")]
    return found


def uv_binary() -> Path:
    """uv, beside this interpreter (``make install`` puts it in .venv, from the test extra) or on PATH."""
    beside = Path(sys.executable).parent / "uv"
    found = beside if beside.is_file() else shutil.which("uv")
    if not found:
        pytest.fail("uv not found beside this Python or on PATH: `make install` installs it (the test extra)")
    return Path(found).resolve()


def venv(where: Path) -> Path:
    """``python3 -m venv where``: the system's Python, as an image's would be."""
    subprocess.run(["python3", "-m", "venv", str(where)], check=True, env=clean_env([]))
    return where


def site_packages(env: Path) -> Path:
    (found,) = env.glob("lib/python3.*/site-packages")
    return found
