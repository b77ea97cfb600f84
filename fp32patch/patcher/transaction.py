"""The only code that writes: lock, keep originals, atomic replace, RECORD, bytecode, rollback.

One ``Transaction`` per import root. ``commit`` writes every planned file or, on any
failure, puts back every file it had already replaced; a crash between steps leaves
each file whole (either its old or its new bytes, never a mix), because each write is a
temp file + fsync + ``os.replace`` in the same folder. ``os.replace`` also gives the path
a new inode, so the other names of a hardlinked file (a uv cache, another environment)
keep the old bytes. Originals are stored by content hash before any target is touched,
and the manifest names each file's before/after hashes before the file changes, so the
state after a crash can always be told and completed or undone.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import errno
import fcntl
import hashlib
import importlib.util
import io
import os
import py_compile
import signal
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fp32patch.patcher import manifest as mf


class TransactionError(OSError):
    """The root cannot be written as planned; nothing was left changed."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# Crash-test hook: FP32PATCH_CRASH_AT=N sends SIGKILL to this process at the N-th write
# step (1-based), so tests can prove every step leaves a recoverable state. Unset, inert.
_crash_at = int(os.environ.get("FP32PATCH_CRASH_AT", "0") or 0)
_steps = 0


def _step() -> None:
    global _steps
    _steps += 1
    if _crash_at and _steps == _crash_at:
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, *, mode: int | None = None, like: os.stat_result | None = None) -> None:
    """Replace ``path`` with ``data``: temp file in the same folder, fsync, rename, fsync folder.

    ``mode`` gives the permission bits (default: those of ``like``, else 0o644 under umask);
    as root, ownership follows ``like`` too.
    """
    folder = path.parent
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".fp32patch-tmp", dir=folder)
    try:
        bits = mode if mode is not None else (stat.S_IMODE(like.st_mode) if like else 0o644 & ~_umask())
        os.fchmod(fd, bits)
        if like is not None and os.geteuid() == 0 and (like.st_uid, like.st_gid) != (0, 0):
            os.fchown(fd, like.st_uid, like.st_gid)
        with os.fdopen(fd, "wb") as fh:
            fd = -1
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        _step()
        os.replace(tmp, path)
        _step()
        _fsync_dir(folder)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


class StateDir:
    """``<root>/.fp32patch``: the manifest, the kept originals and the lock of one root."""

    def __init__(self, root: Path):
        self.root = root
        self.path = root / mf.STATE_DIR
        self.manifest_path = self.path / mf.MANIFEST
        self.originals = self.path / "originals"
        self.displaced = self.path / "displaced"

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def ensure(self) -> None:
        # never wider than the root itself: 0o755 root -> 0o755 state, 0o700 root -> 0o700
        bits = stat.S_IMODE(self.root.stat().st_mode) & 0o755
        for folder in (self.path, self.originals):
            if folder.is_symlink():
                raise TransactionError(errno.ELOOP, f"{folder} is a symbolic link; refusing to use it as state")
            folder.mkdir(mode=bits, exist_ok=True)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """An exclusive lock on this root, held across read-compute-write."""
        self.ensure()
        fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def load(self) -> mf.Manifest:
        try:
            raw = self.manifest_path.read_bytes()
        except FileNotFoundError:
            return mf.Manifest()
        return mf.loads(raw, str(self.manifest_path))

    def save(self, manifest: mf.Manifest) -> None:
        atomic_write(self.manifest_path, manifest.dumps(), mode=0o644 & stat.S_IMODE(self.path.stat().st_mode))

    def keep(self, data: bytes) -> str:
        """Store ``data`` under its hash (once) and return the hash."""
        digest = sha256(data)
        dest = self.originals / digest
        if not (dest.is_file() and sha256(dest.read_bytes()) == digest):
            atomic_write(dest, data, mode=0o644 & stat.S_IMODE(self.path.stat().st_mode))
        return digest

    def original(self, digest: str) -> bytes:
        """The kept bytes with this hash; an error if missing or not matching."""
        dest = self.originals / digest
        if dest.is_symlink():
            raise TransactionError(errno.ELOOP, f"kept original {dest} is a symbolic link; refusing it")
        try:
            data = dest.read_bytes()
        except FileNotFoundError:
            raise TransactionError(errno.ENOENT, f"the kept original {dest} is missing") from None
        if sha256(data) != digest:
            raise TransactionError(errno.EIO, f"the kept original {dest} does not match its recorded sha256")
        return data

    def displace(self, data: bytes) -> Path:
        """Keep bytes that a forced revert overwrites, so nothing is lost."""
        if not self.displaced.is_dir():
            self.displaced.mkdir(mode=stat.S_IMODE(self.path.stat().st_mode))
        dest = self.displaced / sha256(data)
        if not dest.exists():
            atomic_write(dest, data, mode=0o644 & stat.S_IMODE(self.path.stat().st_mode))
        return dest


# ---------------------------------------------------------------- RECORD and bytecode


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rewrite_record(record: bytes, relpath: str, data: bytes) -> bytes | None:
    """RECORD with ``relpath``'s row set to ``data``'s hash and size; None if it has no row.

    Only that row's text changes: every other byte (order, quoting, line endings) stays,
    so a revert gives back the RECORD it found.
    """
    lines = record.decode("utf-8").splitlines(keepends=True)
    hit = False
    for i, line in enumerate(lines):
        body = line.rstrip("\r\n")
        row = next(csv.reader([body]), [])
        if row and row[0] == relpath:
            out = io.StringIO()
            csv.writer(out, lineterminator="").writerow([row[0], record_hash(data), str(len(data)), *row[3:]])
            lines[i] = out.getvalue() + line[len(body) :]
            hit = True
    return "".join(lines).encode("utf-8") if hit else None


def refresh_bytecode(path: Path) -> None:
    """Make sure no cached bytecode can stand in for ``path``'s new source.

    Every ``__pycache__/<stem>.*.pyc`` is removed (a pyc compiled with unchecked-hash
    invalidation is never compared with its source). For this interpreter, a pyc that
    existed is rebuilt with checked-hash invalidation: correct whatever the timestamps.
    """
    cache = path.parent / "__pycache__"
    if not cache.is_dir():
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


# ---------------------------------------------------------------- the transaction


@dataclass
class Write:
    """One file to change: its path in the root, the bytes it must have had, the new bytes."""

    relpath: str
    before: bytes
    after: bytes
    entry: mf.Entry | None  # recorded after the write; None drops (patch, relpath) instead
    drop: tuple[str, str] | None = None
    record: str | None = None  # dist-info RECORD (relative to root) to keep in step
    displace: bool = False  # keep the bytes being overwritten (forced revert)


class Transaction:
    def __init__(self, root: Path):
        self.root = root
        self.state = StateDir(root)

    def _check_writable(self, writes: list[Write]) -> None:
        folders = {self.root} | {(self.root / w.relpath).resolve().parent for w in writes}
        for folder in sorted(folders):
            if not os.access(folder, os.W_OK | os.X_OK):
                raise TransactionError(errno.EACCES, f"cannot write in {folder}: permission denied")

    def commit(self, writes: list[Write], manifest: mf.Manifest) -> list[Path]:
        """Write every file in ``writes`` (whose current bytes must be ``before``), or none.

        The caller holds ``self.state.lock()`` and passes the manifest it read under it.
        Returns the paths of bytes displaced by forced reverts.
        """
        self._check_writable(writes)
        targets = [(w, (self.root / w.relpath).resolve()) for w in writes]
        for w, path in targets:
            if sha256(path.read_bytes()) != sha256(w.before):
                raise TransactionError(errno.EAGAIN, f"{path} changed while fp32patch was working; run it again")

        previous = manifest.dumps()
        displaced = [self.state.displace(w.before) for w in writes if w.displace]
        for w in writes:  # 1. every original is kept before anything changes
            if w.entry is not None:
                self.state.keep(w.before)
        _step()
        for w in writes:  # 2. intent: the manifest names before/after of each file
            if w.entry is not None:
                w.entry.state = "pending"
                manifest.put(w.entry)
        self.state.save(manifest)
        _step()

        done: list[tuple[Write, Path, os.stat_result, bytes | None]] = []
        try:
            for w, path in targets:  # 3. the files themselves
                st = path.stat()
                record_before = self._record_bytes(w)
                atomic_write(path, w.after, like=st)
                done.append((w, path, st, record_before))
                self._sync_record(w, w.after)
                refresh_bytecode(path)
        except BaseException:
            self._rollback(done)
            atomic_write(self.state.manifest_path, previous, like=self.state.manifest_path.stat())
            raise
        for w in writes:  # 4. settle the record
            if w.entry is not None:
                w.entry.state = "applied"
            if w.drop is not None:
                manifest.drop(*w.drop)
        self.state.save(manifest)
        return displaced

    def _record_bytes(self, w: Write) -> bytes | None:
        if w.record is None:
            return None
        try:
            return (self.root / w.record).read_bytes()
        except FileNotFoundError:
            return None

    def _sync_record(self, w: Write, data: bytes) -> None:
        if w.record is None:
            return
        record = self.root / w.record
        current = self._record_bytes(w)
        if current is None:
            return
        # RECORD rows are relative to the folder that holds the .dist-info
        rel = os.path.relpath(self.root / w.relpath, record.parent.parent).replace(os.sep, "/")
        new = rewrite_record(current, rel, data)
        if new is not None and new != current:
            atomic_write(record, new, like=record.stat())

    def _rollback(self, done: list[tuple[Write, Path, os.stat_result, bytes | None]]) -> None:
        for w, path, st, record_before in reversed(done):
            atomic_write(path, w.before, like=st)
            if record_before is not None and w.record is not None:
                atomic_write(self.root / w.record, record_before, like=(self.root / w.record).stat())
            refresh_bytecode(path)


def describe_os_error(exc: OSError) -> str:
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    return f"{exc.strerror or exc}{where}"
