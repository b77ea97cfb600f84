"""The only code that writes target files: keep originals, record intent, replace, settle, roll back.

One ``Transaction`` per import root, always under that root's lock. ``commit`` goes:

1. keep every original (content-addressed) and every displaced byte string;
2. record intent: for each file an ``Intent`` (its sha256 before and after, and its
   entries before), and its new entries, ``pending``, in the manifest;
3. replace each file (atomic: old or new bytes, never a mix), then its RECORD row and
   its bytecode;
4. settle the manifest (entries ``applied``, intents cleared).

On an exception it puts back every file it had replaced, then the previous manifest. A
kill at any point leaves each file whole and the intent on disk, so ``recover`` (run
first by the next apply or revert, under the lock) can tell from the file's bytes which
side of the replace it is on and finish the rest: RECORD, bytecode, manifest, temp files.
Nothing here parses Python.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from fp32patch.patcher import manifest as mf
from fp32patch.patcher.atomic import TransactionError, atomic_write, read_no_follow, stale_temps, step
from fp32patch.patcher.bytecode import refresh_bytecode
from fp32patch.patcher.record import put_row, record_hash, rewrite_record
from fp32patch.patcher.state import StateDir, sha256

__all__ = [
    "RollbackError",
    "StateDir",
    "Transaction",
    "TransactionError",
    "Write",
    "commit_all",
    "describe_os_error",
    "locked",
    "record_hash",
    "sha256",
]


def describe_os_error(exc: OSError) -> str:
    where = f" ({exc.filename})" if getattr(exc, "filename", None) else ""
    return f"{exc.strerror or exc}{where}"


class RollbackError(TransactionError):
    """A write failed and putting back what it had changed failed too: what failed first, and what is left."""

    def __init__(self, cause: BaseException | str | None, failed: list[str]):
        if isinstance(cause, RollbackError):
            cause = cause.cause
        elif isinstance(cause, OSError):
            cause = describe_os_error(cause)
        elif isinstance(cause, KeyboardInterrupt):
            cause = "interrupted (Ctrl-C)"
        elif isinstance(cause, BaseException):
            cause = f"{type(cause).__name__}: {cause}"
        self.cause: str = cause or ""
        self.failed = failed
        super().__init__(errno.EIO, "; ".join(failed))


def _bytes_of(path: Path) -> bytes | None:
    try:
        return read_no_follow(path)
    except OSError:
        return None


def _read_only_fs(folder: Path) -> bool:
    try:
        return bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _row_found(entries: Iterable[mf.Entry], digest: str | None) -> str | None:
    """The RECORD row found before patching, when ``digest`` is the original's (None: compute it)."""
    return next((e.record_row for e in entries if e.sha256_before == digest and e.record_row is not None), None)


# ---------------------------------------------------------------- the transaction


@dataclass
class Write:
    """One file to change: its path in the root, the bytes it must have now, the bytes it gets.

    ``entries`` are the file's manifest entries once written (every patch on it; empty: the
    file is back to its original and has none). ``after`` equal to ``before`` writes no
    file, only the entries.
    """

    relpath: str
    before: bytes | None  # None (with ``after`` None): the file is gone and only its entries change
    after: bytes | None
    entries: list[mf.Entry]
    keep: bytes | None = None  # the file's original bytes, to keep for revert (None: kept already)
    record: str | None = None  # dist-info RECORD (relative to root) to keep in step
    displace: bool = False  # keep the bytes being overwritten (forced revert)
    record_row: str | None = None  # the RECORD row to give ``after`` as is (a revert: the row found); None: computed


class Transaction:
    def __init__(self, root: Path):
        self.root = root
        self.state = StateDir(root)
        # how far ``commit`` got, for a run cut short (Ctrl-C): "none", "writing", "rolled-back", "done",
        # and "undone" (a finished commit put back because another root of the run failed)
        self.progress = "none"
        self._committed: tuple[list, bytes | None, list[str]] = ([], None, [])

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
        folders |= {f / "__pycache__" for f in list(folders) if (f / "__pycache__").is_dir()}  # bytecode is refreshed
        folders |= {(self.root / r).parent for r in records if r is not None}
        for folder in sorted(folders):
            if not folder.exists():  # a file gone with its folder: nothing is written there
                continue
            if not os.access(folder, os.W_OK | os.X_OK):
                if _read_only_fs(folder):
                    raise TransactionError(errno.EROFS, f"{folder}: read-only file system")
                raise TransactionError(errno.EACCES, f"{folder}: permission denied (uid {os.geteuid()})")

    # -- RECORD

    def _record_now(self, record_rel: str | None) -> bytes | None:
        """The RECORD's bytes as they are (None: no RECORD), to put back on a rollback."""
        record = self._record(record_rel)
        try:
            return read_no_follow(record) if record is not None else None
        except FileNotFoundError:
            return None

    def _sync_record(self, record_rel: str | None, relpath: str, data: bytes, row: str | None = None) -> bytes | None:
        """Set ``relpath``'s RECORD row to ``data``'s hash and size, or to ``row`` exactly when given (the row
        found before patching, for bytes given back); returns the RECORD's previous bytes (None: untouched)."""
        record = self._record(record_rel)
        if record is None:
            return None
        try:
            current = read_no_follow(record)
        except FileNotFoundError:
            return None
        # RECORD rows are relative to the folder that holds the .dist-info: the root
        new = put_row(current, relpath, row) if row is not None else rewrite_record(current, relpath, data)
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
        every = [*manifest.entries, *(e for i in manifest.intents for e in i.previous)]
        for rel in [
            *(e.path for e in every),
            *(e.record or "" for e in every),
            *(i.path for i in manifest.intents),
            *relpaths,
        ]:
            if rel:
                with contextlib.suppress(TransactionError):
                    path = self.target(rel)
                    wanted.setdefault(path.parent, set()).add(path.name)
        for folder, names in wanted.items():
            stale += stale_temps(folder, names)
        return stale

    def needs_recovery(self, manifest: mf.Manifest, relpaths: Iterable[str] = ()) -> bool:
        """Whether an interrupted run left something for ``recover`` (checked without the lock)."""
        return manifest.was_interrupted() or bool(self._stale_temps(manifest, list(relpaths)))

    def recover(self, manifest: mf.Manifest, relpaths: Iterable[str] = ()) -> list[str]:
        """Finish what an interrupted run left: temp files, interrupted entries. Returns notes.

        Call under the lock with the manifest just read; saves it if it changed. For each
        file write in flight (an ``Intent``) the file's bytes decide: the new bytes mean the
        replace happened (the new entries stand), the old bytes mean it did not or was undone
        (the file's previous entries are put back); either way the RECORD row and the
        bytecode are made to match the bytes that are there. Other bytes: the new entries
        stand, so the file reads as drifted, as any file changed after patching does.
        """
        notes: list[str] = []
        stale = self._stale_temps(manifest, relpaths)
        for tmp in stale:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        if stale:
            self.state.touch()  # a run cut short was here: with nothing recorded, its folder goes too
            notes.append(
                f"removed {len(stale)} temporary file(s) left by an interrupted fp32patch run: "
                + ", ".join(str(p) for p in stale)
            )

        settled = bool(manifest.intents)
        for intent in list(manifest.intents):
            notes.append(self._settle(manifest, intent))
        manifest.intents = []
        legacy = manifest.interrupted()  # states an older fp32patch left, without an intent
        for entry in legacy:
            notes.append(self._settle_legacy(manifest, entry))
        if settled or legacy:
            self.state.save(manifest)
        return notes

    def _current(self, relpath: str) -> tuple[Path | None, bytes | None]:
        try:
            path = self.target(relpath)
            return path, path.read_bytes()
        except OSError:  # gone, unreadable, or leading out of the root: nothing of ours to finish
            return None, None

    def _settle(self, manifest: mf.Manifest, intent: mf.Intent) -> str:
        """One interrupted file write: the file's bytes say which entries stand."""
        path, data = self._current(intent.path)
        current = sha256(data) if data is not None else None
        if path is not None and data is not None and current in (intent.sha256_to, intent.sha256_from):
            every = [*manifest.on(intent.path), *intent.previous]
            for entry in every:
                if entry.record:
                    self._sync_record(entry.record, intent.path, data, _row_found(every, current))
                    break
            refresh_bytecode(path)
        if current == intent.sha256_from and intent.sha256_from != intent.sha256_to:
            manifest.replace_path(intent.path, intent.previous)
            for entry in intent.previous:
                entry.state = mf.APPLIED
            return f"settled an interrupted run on {intent.path}: the file has the bytes it had before, as recorded"
        for entry in manifest.on(intent.path):
            entry.state = mf.APPLIED
        if current == intent.sha256_to:
            return f"settled an interrupted run on {intent.path}: the new bytes are in place"
        return f"an interrupted run left {intent.path} with bytes it did not write; it reads as changed"

    def _settle_legacy(self, manifest: mf.Manifest, entry: mf.Entry) -> str:
        what = "apply" if entry.state == mf.PENDING else "revert"
        path, data = self._current(entry.path)
        current = sha256(data) if data is not None else None
        if path is not None and data is not None and current in (entry.sha256_after, entry.sha256_before):
            self._sync_record(entry.record, entry.path, data, _row_found([entry], current))
            refresh_bytecode(path)
            if current == entry.sha256_after:
                entry.state = mf.APPLIED
                return f"settled an interrupted {what} of {entry.path}: its patched bytes are in place"
            manifest.drop(entry.patch, entry.path)
            return f"settled an interrupted {what} of {entry.path}: its original bytes are in place"
        entry.state = mf.APPLIED
        return f"an interrupted {what} left {entry.path} with bytes it did not write; it reads as changed"

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
            try:
                now: bytes | None = path.read_bytes()
            except FileNotFoundError:
                now = None
            if now != w.before:
                raise TransactionError(errno.EAGAIN, f"{path} changed while fp32patch was working; run it again")
            planned.append((w, path))

        previous = self.state.raw_manifest()
        self.progress = "writing"
        done: list[tuple[Write, Path, os.stat_result, bytes | None]] = []
        kept_now: list[str] = []
        try:  # from here on, any failure (Ctrl-C included) puts back what was changed
            displaced = [self.state.displace(w.before, w.relpath) for w in writes if w.displace]
            for w in writes:  # 1. every original is kept before anything changes
                if w.keep is not None:
                    digest, stored = self.state.keep(w.keep)
                    if stored:
                        kept_now.append(digest)
            step()
            for w in writes:  # 2. intent: the file's bytes before and after, its entries before and after
                if w.before is None:  # a file that is gone: no write to settle, only its entries go
                    manifest.replace_path(w.relpath, w.entries)
                    continue
                manifest.intents.append(
                    mf.Intent(
                        w.relpath, sha256(w.before), sha256(w.after), [copy.copy(e) for e in manifest.on(w.relpath)]
                    )
                )
                for entry in w.entries:
                    entry.state = mf.PENDING
                manifest.replace_path(w.relpath, w.entries)
            self.state.save(manifest)
            step()
            for w, path in planned:  # 3. the files themselves
                if w.after == w.before or w.after is None:
                    continue
                st = path.stat()
                # noted before the write: a Ctrl-C just after the replace must still put the file back
                done.append((w, path, st, self._record_now(w.record)))
                atomic_write(path, w.after, like=st)
                self._sync_record(w.record, w.relpath, w.after, w.record_row)
                refresh_bytecode(path)
                step()
            for w in writes:  # 4. settle the record (a failure here still undoes the files)
                for entry in w.entries:
                    entry.state = mf.APPLIED
            manifest.intents = []
            self.state.save(manifest)
        except BaseException as exc:
            self._rollback(done, previous, kept_now, exc)
            self.progress = "rolled-back"
            raise
        self.progress = "done"
        self._committed = (done, previous, kept_now)
        return displaced

    def undo(self) -> None:
        """Put back everything a finished ``commit`` wrote (another root of the same run failed).

        The caller still holds the lock; the state folder is tidied only when it is released, so
        the kept originals a full revert no longer names are still there to be named again."""
        if self.progress != "done":
            return
        done, previous, kept = self._committed
        self.progress = "writing"
        self._rollback(done, previous, kept, None)
        self.progress = "undone"

    def _rollback(
        self,
        done: list[tuple[Write, Path, os.stat_result, bytes | None]],
        previous: bytes | None,
        kept: list[str],
        cause: BaseException | None,
    ) -> None:
        """Put back each file (and its RECORD) that does not have its bytes from before; only what changed
        is written, so a failure to write a file is never reported as a failure to put it back."""
        failed: list[str] = []
        for w, path, st, record_before in reversed(done):
            try:
                if _bytes_of(path) != w.before:
                    atomic_write(path, w.before, like=st)
                    with contextlib.suppress(OSError):  # the bytecode of bytes that are back is that of before
                        refresh_bytecode(path)
                record = self._record(w.record)
                if record_before is not None and record is not None and _bytes_of(record) != record_before:
                    atomic_write(record, record_before, like=record.stat())
            except OSError as exc:
                failed.append(f"{path}: {describe_os_error(exc)}")
        try:
            if not failed:
                self.state.restore_manifest(previous)
        except OSError as exc:
            failed.append(f"{self.state.manifest_path}: {describe_os_error(exc)}")
        if failed:
            # the manifest keeps its intent entries: the next apply or revert settles them
            raise RollbackError(cause, failed)
        for digest in kept:  # stored by this transaction, referenced by nothing now
            self.state.forget(digest)


# ---------------------------------------------------------------- every root of one run


@contextlib.contextmanager
def locked(roots: Iterable[Path]) -> Iterator[None]:
    """The locks of every root of one run, taken in one order (two runs never wait on each other in a circle),
    each folder once however it is spelled (a lock taken twice by one run would wait on itself)."""
    with contextlib.ExitStack() as stack:
        for root in sorted({Path(os.path.realpath(r)) for r in roots}, key=str):
            stack.enter_context(StateDir(root).lock())
        yield


def commit_all(runs: list[tuple[Transaction, list[Write], mf.Manifest]]) -> list[list[Path]]:
    """Commit each root's writes in turn, under every root's lock: all roots, or none.

    A failure in one root (Ctrl-C included) rolls that root back (``commit``) and undoes every root
    committed before it, then re-raises: a ``RollbackError`` when something could not be put back.
    """
    finished: list[Transaction] = []
    displaced: list[list[Path]] = []
    try:
        for tx, writes, manifest in runs:
            displaced.append(tx.commit(writes, manifest) if writes else [])
            finished.append(tx)
    except BaseException as exc:
        failed: list[str] = []
        for tx in reversed(finished):
            try:
                tx.undo()
            except RollbackError as undo:
                failed += undo.failed
        if failed:
            raise RollbackError(exc, [*(exc.failed if isinstance(exc, RollbackError) else []), *failed]) from None
        raise
    return displaced
