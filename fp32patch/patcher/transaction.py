"""The only code that writes target files: keep originals, record intent, replace, settle, roll back.

One ``Transaction`` per import root, always under that root's lock. ``commit`` goes:

1. keep every original (content-addressed) and every displaced byte string;
2. record intent: each entry to write is ``pending`` (apply) or ``reverting`` (revert)
   in the manifest, which names the file's sha256 before and after;
3. replace each file (atomic: old or new bytes, never a mix), then its RECORD row and
   its bytecode;
4. settle the manifest (``applied``, or the entry dropped).

On an exception it puts back every file it had replaced, then the previous manifest. A
kill at any point leaves each file whole and the intent on disk, so ``recover`` (run
first by the next apply or revert, under the lock) can tell from the file's bytes which
side of the replace it is on and finish the rest: RECORD, bytecode, manifest, temp files.
Nothing here parses Python.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import errno
import hashlib
import importlib.util
import io
import os
import py_compile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fp32patch.patcher import manifest as mf
from fp32patch.patcher.atomic import TransactionError, atomic_write, read_no_follow, stale_temps, step
from fp32patch.patcher.state import StateDir, sha256

__all__ = ["StateDir", "Transaction", "TransactionError", "Write", "sha256", "describe_os_error"]


# ---------------------------------------------------------------- RECORD and bytecode


def record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def rewrite_record(record: bytes, relpath: str, data: bytes) -> bytes | None:
    """RECORD with ``relpath``'s row set to ``data``'s hash and size; None if it has no row.

    Only that row's text changes: every other byte (order, quoting, line endings) stays,
    so a revert gives back the RECORD it found. A RECORD that is not UTF-8 CSV is left alone.
    """
    try:
        lines = record.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None
    hit = False
    for i, line in enumerate(lines):
        body = line.rstrip("\r\n")
        try:
            row = next(csv.reader([body]), [])
        except csv.Error:
            continue
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


def describe_os_error(exc: OSError) -> str:
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    return f"{exc.strerror or exc}{where}"


def _read_only_fs(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


# ---------------------------------------------------------------- the transaction


@dataclass
class Write:
    """One file to change: its path in the root, the bytes it must have had, the new bytes."""

    relpath: str
    before: bytes
    after: bytes  # equal to ``before``: no file write, only the manifest change
    entry: mf.Entry | None  # recorded with the write; None for a revert, which drops ``drop``
    drop: tuple[str, str] | None = None
    record: str | None = None  # dist-info RECORD (relative to root) to keep in step
    displace: bool = False  # keep the bytes being overwritten (forced revert)


class Transaction:
    def __init__(self, root: Path):
        self.root = root
        self.state = StateDir(root)

    # -- paths: every file written or read back must be inside the root

    def target(self, relpath: str) -> Path:
        """The real file behind ``relpath``; an error if it (or a folder on the way) leads out of the root."""
        path = self.root / relpath
        try:
            resolved = path.resolve()
        except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
            raise TransactionError(errno.ELOOP, f"{path} is a symbolic link loop; refusing it") from None
        try:
            resolved.relative_to(self.root.resolve())
        except ValueError:
            raise TransactionError(
                errno.EXDEV, f"{path} leads outside the import root {self.root} (to {resolved}); refusing it"
            ) from None
        return resolved

    def _record(self, relpath: str | None) -> Path | None:
        if relpath is None:
            return None
        record = self.root / relpath
        if record.is_symlink() or record.parent.is_symlink():
            raise TransactionError(errno.ELOOP, f"{record} is (or is inside) a symbolic link; refusing to rewrite it")
        return record

    def check_writable(self, relpaths: Iterable[str], records: Iterable[str | None] = ()) -> None:
        """Refuse up front, before the state folder or any file is created, if a folder is not writable.

        ``os.access`` answers for this process: as root it passes permission bits (root can
        write there) but still reports a read-only file system.
        """
        folders = {self.state.path if self.state.path.is_dir() else self.root}
        folders |= {self.target(r).parent for r in relpaths}
        folders |= {(self.root / r).parent for r in records if r is not None}
        for folder in sorted(folders):
            if not os.access(folder, os.W_OK | os.X_OK):
                if _read_only_fs(folder):
                    raise TransactionError(errno.EROFS, f"{folder}: read-only file system")
                raise TransactionError(errno.EACCES, f"{folder}: permission denied (uid {os.geteuid()})")

    # -- RECORD

    def _sync_record(self, record_rel: str | None, relpath: str, data: bytes) -> bytes | None:
        """Set ``relpath``'s RECORD row to ``data``; returns the RECORD's previous bytes (None: untouched)."""
        record = self._record(record_rel)
        if record is None:
            return None
        try:
            current = read_no_follow(record)
        except FileNotFoundError:
            return None
        # RECORD rows are relative to the folder that holds the .dist-info: the root
        new = rewrite_record(current, relpath, data)
        if new is None or new == current:
            return None
        atomic_write(record, new, like=record.stat())
        return current

    # -- recovery

    def _stale_temps(self, manifest: mf.Manifest, relpaths: Iterable[str]) -> list[Path]:
        """Our temp files in the state folders and beside every file this root writes."""
        stale: list[Path] = []
        for folder in self.state.folders():
            with contextlib.suppress(TransactionError):
                if self.state.real_dir(folder):
                    stale += stale_temps(folder)
        wanted: dict[Path, set[str]] = {}
        for rel in [*(e.path for e in manifest.entries), *(e.record or "" for e in manifest.entries), *relpaths]:
            if rel:
                with contextlib.suppress(TransactionError):
                    path = self.target(rel)
                    wanted.setdefault(path.parent, set()).add(path.name)
        for folder, names in wanted.items():
            stale += stale_temps(folder, names)
        return stale

    def needs_recovery(self, manifest: mf.Manifest, relpaths: Iterable[str] = ()) -> bool:
        """Whether an interrupted run left something for ``recover`` (checked without the lock)."""
        return bool(manifest.interrupted()) or bool(self._stale_temps(manifest, list(relpaths)))

    def recover(self, manifest: mf.Manifest, relpaths: Iterable[str] = ()) -> list[str]:
        """Finish what an interrupted run left: temp files, interrupted entries. Returns notes.

        Call under the lock with the manifest just read; saves it if it changed. For each
        ``pending``/``reverting`` entry the file's bytes decide: the after-hash means the
        replace happened (the entry is settled as applied), the before-hash means it did not
        or was undone (the entry is dropped); either way the RECORD row and the bytecode are
        made to match the bytes that are there. Other bytes: the entry is kept as applied,
        so the file reads as drifted, as any file changed after patching does.
        """
        notes: list[str] = []
        stale = self._stale_temps(manifest, relpaths)
        for tmp in stale:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        if stale:
            notes.append(
                f"removed {len(stale)} temporary file(s) left by an interrupted fp32patch run: "
                + ", ".join(str(p) for p in stale)
            )

        settled = manifest.interrupted()
        for entry in settled:
            what = "apply" if entry.state == mf.PENDING else "revert"
            try:
                path = self.target(entry.path)
                data: bytes | None = path.read_bytes()
            except OSError:  # gone, unreadable, or leading out of the root: nothing of ours to finish
                path, data = None, None
            current = sha256(data) if data is not None else None
            if path is not None and data is not None and current in (entry.sha256_after, entry.sha256_before):
                self._sync_record(entry.record, entry.path, data)
                refresh_bytecode(path)
                if current == entry.sha256_after:
                    entry.state = mf.APPLIED
                    notes.append(f"settled an interrupted {what} of {entry.path}: its patched bytes are in place")
                else:
                    manifest.drop(entry.patch, entry.path)
                    notes.append(f"settled an interrupted {what} of {entry.path}: its original bytes are in place")
            else:
                entry.state = mf.APPLIED
                notes.append(
                    f"an interrupted {what} left {entry.path} with bytes it did not write; it reads as changed"
                )
        if settled:
            self.state.save(manifest)
        return notes

    # -- commit

    def commit(self, writes: list[Write], manifest: mf.Manifest) -> list[Path]:
        """Write every file in ``writes`` (whose current bytes must be ``before``), or none.

        The caller holds ``self.state.lock()`` and passes the manifest it read under it.
        Returns the paths of bytes displaced by forced reverts.
        """
        self.check_writable([w.relpath for w in writes], [w.record for w in writes])
        planned: list[tuple[Write, Path]] = []
        for w in writes:
            path = self.target(w.relpath)
            self._record(w.record)  # refused now, before anything is written, if it is a symlink
            if path.read_bytes() != w.before:
                raise TransactionError(errno.EAGAIN, f"{path} changed while fp32patch was working; run it again")
            planned.append((w, path))

        previous = self.state.raw_manifest()
        displaced = [self.state.displace(w.before) for w in writes if w.displace]
        kept_now: list[str] = []
        for w in writes:  # 1. every original is kept before anything changes
            if w.entry is not None:
                digest, stored = self.state.keep(w.before)
                if stored:
                    kept_now.append(digest)
        step()
        for w in writes:  # 2. intent: the manifest names before/after of each file
            if w.entry is not None:
                w.entry.state = mf.PENDING
                manifest.put(w.entry)
            if w.drop is not None and (entry := manifest.find(*w.drop)) is not None:
                entry.state = mf.REVERTING
        self.state.save(manifest)
        step()

        done: list[tuple[Write, Path, os.stat_result, bytes | None]] = []
        try:
            for w, path in planned:  # 3. the files themselves
                if w.after == w.before:
                    continue
                st = path.stat()
                atomic_write(path, w.after, like=st)
                done.append((w, path, st, None))  # from here on, a failure must put the file back
                done[-1] = (w, path, st, self._sync_record(w.record, w.relpath, w.after))
                refresh_bytecode(path)
                step()
            for w in writes:  # 4. settle the record (a failure here still undoes the files)
                if w.entry is not None:
                    w.entry.state = mf.APPLIED
                if w.drop is not None:
                    manifest.drop(*w.drop)
            self.state.save(manifest)
        except BaseException:
            self._rollback(done, previous, kept_now)
            raise
        return displaced

    def _rollback(
        self, done: list[tuple[Write, Path, os.stat_result, bytes | None]], previous: bytes | None, kept: list[str]
    ) -> None:
        failed: list[str] = []
        for w, path, st, record_before in reversed(done):
            try:
                atomic_write(path, w.before, like=st)
                record = self._record(w.record)
                if record_before is not None and record is not None:
                    atomic_write(record, record_before, like=record.stat())
                refresh_bytecode(path)
            except OSError as exc:
                failed.append(f"{path}: {describe_os_error(exc)}")
        if failed:
            # the manifest keeps its intent entries: the next apply or revert settles them
            raise TransactionError(
                errno.EIO,
                "the rollback could not put back " + "; ".join(failed) + ". Each file is whole (old or new bytes); "
                "run `fp32patch apply` or `fp32patch revert` again to settle the rest",
            )
        self.state.restore_manifest(previous)
        for digest in kept:  # stored by this transaction, referenced by nothing now
            self.state.forget(digest)
