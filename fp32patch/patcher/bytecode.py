"""Stale bytecode must never hide an edit: every ``.pyc`` of a written file is removed or rebuilt."""

from __future__ import annotations

import contextlib
import importlib.util
import py_compile
from pathlib import Path


def refresh_bytecode(path: Path) -> None:
    """Make sure no cached bytecode can stand in for ``path``'s new source.

    Every ``__pycache__/<stem>.*.pyc`` is removed (a pyc compiled with unchecked-hash
    invalidation is never compared with its source). For this interpreter, a pyc that
    existed is rebuilt with checked-hash invalidation: correct whatever the timestamps.
    """
    cache = path.parent / "__pycache__"
    if not cache.is_dir() or cache.is_symlink():
        return
    ours = Path(importlib.util.cache_from_source(str(path)))
    had_ours = ours.exists()
    for pyc in cache.glob(f"{path.stem}.*.pyc"):
        if pyc.name.split(".")[0] == path.stem:
            with contextlib.suppress(FileNotFoundError):
                pyc.unlink()
    if had_ours:
        with contextlib.suppress(py_compile.PyCompileError, SyntaxError, OSError):
            py_compile.compile(
                str(path), cfile=str(ours), doraise=True, invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH
            )
