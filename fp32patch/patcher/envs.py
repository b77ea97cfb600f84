"""Find every Python environment under a folder, for images that hold many (Ray per-actor envs).

An environment is a folder with ``pyvenv.cfg`` (venv, virtualenv, uv) or ``conda-meta/``
(conda), and its import root is ``lib/python3.*/site-packages``. Ray puts one per
runtime_env under ``.../runtime_resources/{pip,uv,conda}/<hash>/``, so the walk goes a
few levels deep. It never follows symlinks (a link back up would loop) and does not
descend into an environment's own lib/bin/include, where no other environment lives;
a conda base's ``envs/`` is walked.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_DEPTH = 8
_NEVER = {"__pycache__", "node_modules", ".git", "site-packages", "dist-packages"}  # big, and never hold an env
_ENV_OWN = {"lib", "lib64", "bin", "include", "share", "Scripts", "pkgs"}  # an environment's own folders


def is_environment(folder: Path) -> bool:
    return (folder / "pyvenv.cfg").is_file() or (folder / "conda-meta").is_dir()


def site_packages(env: Path) -> list[Path]:
    """The environment's import roots (one per Python it holds, usually one)."""
    found: list[Path] = []
    for lib in ("lib", "lib64"):
        for path in sorted((env / lib).glob("python3*/site-packages")):
            if path.is_dir() and path.resolve() not in {p.resolve() for p in found}:
                found.append(path)
    return found


def find_environments(folder: Path) -> list[tuple[Path, list[Path]]]:
    """Each environment under ``folder`` (itself included) with its site-packages, in path order."""
    found: list[tuple[Path, list[Path]]] = []
    top_depth = len(folder.parts)
    for dirpath, dirnames, _ in os.walk(folder, followlinks=False):
        here = Path(dirpath)
        skip = set(_NEVER)
        if is_environment(here):
            found.append((here, site_packages(here)))
            skip |= _ENV_OWN
        if len(here.parts) - top_depth >= MAX_DEPTH:
            dirnames[:] = []
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
    return sorted(found)
