"""Durable replacement of one file, the crash-test hook, and the names of our temp files.

``atomic_write`` is temp file in the same folder + fsync + ``os.replace`` + fsync of the
folder: a reader (or a crash) sees the old bytes or the new ones, never a mix, and the
path gets a new inode, so other hardlinks to the old file keep their bytes. A crash can
leave only the temp file behind; its name (``.<name>.<random>.fp32patch-tmp``) is ours
alone, so the next run, under the root's lock, can remove it without guessing.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import stat
import tempfile
from pathlib import Path

TMP_SUFFIX = ".fp32patch-tmp"
# mkstemp's random part is 8 characters of [a-z0-9_]
_TMP_RE = re.compile(r"^\.(?P<name>.+)\.[a-z0-9_]{8}" + re.escape(TMP_SUFFIX) + r"$")


class TransactionError(OSError):
    """The root cannot be written (or read back) as planned; the message says why."""


# Crash-test hook: FP32PATCH_CRASH_AT=N sends SIGKILL to this process at the N-th write
# step (1-based), so tests can prove that every step leaves a recoverable state (with
# FP32PATCH_CRASH_SIGNAL=INT, a Ctrl-C instead). A step is each point between two durable
# changes. Unset, inert.
_crash_at = int(os.environ.get("FP32PATCH_CRASH_AT", "0") or 0)
_crash_signal = getattr(signal, "SIG" + os.environ.get("FP32PATCH_CRASH_SIGNAL", "KILL"), signal.SIGKILL)
_steps = 0


def step() -> None:
    global _steps
    _steps += 1
    if _crash_at and _steps == _crash_at:
        os.kill(os.getpid(), _crash_signal)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def atomic_write(path: Path, data: bytes, *, mode: int | None = None, like: os.stat_result | None = None) -> None:
    """Replace ``path`` with ``data``: temp file in the same folder, fsync, rename, fsync folder.

    ``mode`` gives the permission bits (default: those of ``like``, else 0o644 under umask);
    as root, ownership follows ``like`` too. A symlink at ``path`` is replaced, never followed.
    """
    folder = path.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=TMP_SUFFIX, dir=folder)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None
    try:
        bits = mode if mode is not None else (stat.S_IMODE(like.st_mode) if like else 0o644 & ~umask())
        os.fchmod(fd, bits)
        if like is not None and os.geteuid() == 0 and (like.st_uid, like.st_gid) != (0, 0):
            os.fchown(fd, like.st_uid, like.st_gid)
        with os.fdopen(fd, "wb") as fh:
            fd = -1
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        step()  # a kill here leaves a complete temp file beside an untouched target
        os.replace(tmp, path)
        step()  # a kill here leaves the new bytes, perhaps not yet durable in the folder
        fsync_dir(folder)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename != str(path):
            # the file being replaced is what failed, whatever step (temp file, rename) said so
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise


def read_no_follow(path: Path) -> bytes:
    """The bytes of ``path``, refusing a symbolic link in its last component."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TransactionError(errno.ELOOP, f"{path} is a symbolic link; refusing to follow it") from None
        raise
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def stale_temps(folder: Path, names: set[str] | None = None) -> list[Path]:
    """Our temp files in ``folder`` (for the files in ``names`` only, when given)."""
    try:
        entries = list(os.scandir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        m = _TMP_RE.match(entry.name)
        if m and (names is None or m["name"] in names) and entry.is_file(follow_symlinks=False):
            found.append(Path(entry.path))
    return found
