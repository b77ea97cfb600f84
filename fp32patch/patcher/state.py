"""``<root>/.fp32patch``: the manifest, the kept originals, displaced bytes and the lock of one root.

Everything in this folder is read back later, so it is input too, and may have been
tampered with. Its folders must be real folders (a symlink could lead a write or a read
outside the root), its files are read without following symlinks, and a kept original
is used only if its bytes hash to the name it is kept under. Nothing here is created
wider than the root itself or than the umask allows.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from fp32patch.patcher import manifest as mf
from fp32patch.patcher.atomic import TransactionError, atomic_write, read_no_follow, umask

# state folders this process made or wrote (by path: the lock and the writes use their own StateDir)
_touched: set[str] = set()
_made: set[str] = set()  # ... and of those, the ones it made
_taken = [0]  # locks this process has taken (or is taking), ever


def locks_taken() -> int:
    """How many roots' locks this process has taken: from the first on, a Ctrl-C is the writer's to handle
    (it may have written, and says what it left)."""
    return _taken[0]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class UnreadableState(OSError):
    """The state folder or its manifest cannot be read (not that its content is bad): the file and why."""

    def __init__(self, state: StateDir, exc: OSError):
        where = exc.filename or str(state.manifest_path)
        super().__init__(exc.errno, exc.strerror, where)
        self.message = (
            f"cannot read {where}: {exc.strerror or exc}. fp32patch keeps what it patched in {state.path}: run "
            "fp32patch as a user who can read it (the one who applied, e.g. the image's build user), or make it "
            "readable to this one; nothing was changed"
        )

    def __str__(self) -> str:
        return self.message


class StateDir:
    def __init__(self, root: Path):
        self.root = root
        self.path = root / mf.STATE_DIR
        self.manifest_path = self.path / mf.MANIFEST
        self.originals = self.path / "originals"
        self.displaced = self.path / "displaced"
        self.lock_path = self.path / "lock"

    def exists(self) -> bool:
        return os.path.lexists(self.manifest_path)

    def real_dir(self, folder: Path) -> bool:
        """True if ``folder`` is a real folder, False if absent; an error for anything else."""
        try:
            st = os.lstat(folder)
        except FileNotFoundError:
            return False
        if stat.S_ISLNK(st.st_mode):
            raise TransactionError(errno.ELOOP, f"{folder} is a symbolic link; refusing to use it as fp32patch state")
        if not stat.S_ISDIR(st.st_mode):
            raise TransactionError(errno.ENOTDIR, f"{folder} is not a folder; move it aside to use fp32patch here")
        return True

    def _mkdir(self, folder: Path) -> None:
        if not self.real_dir(folder):
            # never wider than the root itself (mkdir applies the umask on top)
            bits = stat.S_IMODE(self.root.stat().st_mode) & 0o755
            with contextlib.suppress(FileExistsError):  # another process made it first
                folder.mkdir(mode=bits)
                self.touch()
                if folder == self.path:
                    _made.add(str(self.path))
            self.real_dir(folder)

    def _file_bits(self) -> int:
        return 0o644 & ~umask() & stat.S_IMODE(self.path.stat().st_mode)

    def ensure(self) -> None:
        self._mkdir(self.path)
        self._mkdir(self.originals)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """An exclusive lock on this root, held across read-compute-write."""
        _taken[0] += 1
        fd = self._locked_fd()
        try:
            yield
        finally:
            try:
                self.tidy()
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def touch(self) -> None:
        """This process made the folder or wrote its manifest (or found it holds nothing of ours): when
        nothing is recorded here as the lock is released, the folder goes."""
        _touched.add(str(self.path))

    def untouch(self) -> None:
        """Keep the folder as it is (a refusal: its kept originals may be the way back), unless this
        process made it."""
        if str(self.path) not in _made:
            _touched.discard(str(self.path))

    def tidy(self) -> None:
        """The whole folder goes when nothing of ours is recorded here and this process made the folder
        or wrote its manifest (call under the lock): a root with nothing of ours in it has no state folder,
        whether the run was cut short (Ctrl-C) or settled what a killed one left. A folder this process
        only looked at stays as it was: a command that refuses writes nothing."""
        if str(self.path) not in _touched:
            return
        _touched.discard(str(self.path))
        _made.discard(str(self.path))
        try:
            manifest = mf.loads(read_no_follow(self.manifest_path), str(self.manifest_path))
        except FileNotFoundError:
            manifest = mf.Manifest()
        except (OSError, mf.ManifestError):
            return  # not ours to judge: the next command reports it
        if not (manifest.entries or manifest.intents):
            self.remove_if_unused(manifest)

    def _locked_fd(self) -> int:
        # A full revert removes the state folder, lock included, while it holds the lock: a process
        # that was waiting then holds a lock file nobody else can open, so it takes the new one.
        while True:
            self.ensure()
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
            except FileNotFoundError:
                continue  # the folder was removed between ensure() and open()
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise TransactionError(errno.ELOOP, f"{self.lock_path} is a symbolic link; refusing it") from None
                raise
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.lstat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def remove_if_unused(self, manifest: mf.Manifest) -> None:
        """Remove the state folder once nothing of ours is patched here: its kept originals, the empty
        manifest and the lock (call under the lock). Displaced bytes a forced revert kept are the
        user's: with them, the folder stays."""
        if manifest.entries or manifest.intents:
            return
        with contextlib.suppress(FileNotFoundError, TransactionError):
            if self.real_dir(self.originals):
                for kept in os.scandir(self.originals):
                    if kept.is_file(follow_symlinks=False):
                        os.unlink(kept.path)
        for path, remove in (
            (self.originals, os.rmdir),
            (self.manifest_path, os.unlink),
            (self.lock_path, os.unlink),
            (self.path, os.rmdir),  # not when it still holds something: displaced bytes, say
        ):
            with contextlib.suppress(OSError):
                remove(path)

    def load(self) -> mf.Manifest:
        try:
            if not self.real_dir(self.path):
                return mf.Manifest()
            raw = read_no_follow(self.manifest_path)
        except FileNotFoundError:
            return mf.Manifest()
        except IsADirectoryError:
            raise mf.ManifestError(f"{self.manifest_path}: is a folder, not a manifest") from None
        except TransactionError as exc:
            raise mf.ManifestError(str(exc.strerror)) from None
        except OSError as exc:  # permission denied (another user's state folder, umask 077), I/O error
            raise UnreadableState(self, exc) from None
        return mf.loads(raw, str(self.manifest_path))

    def raw_manifest(self) -> bytes | None:
        try:
            return read_no_follow(self.manifest_path)
        except FileNotFoundError:
            return None

    def save(self, manifest: mf.Manifest) -> None:
        self.touch()
        atomic_write(self.manifest_path, manifest.dumps(), mode=self._file_bits())

    def restore_manifest(self, raw: bytes | None) -> None:
        """Put back the manifest as it was (``None``: there was none)."""
        self.touch()
        if raw is None:
            with contextlib.suppress(FileNotFoundError):
                self.manifest_path.unlink()
        else:
            atomic_write(self.manifest_path, raw, mode=self._file_bits())

    def _store(self, folder: Path, data: bytes, name: str | None = None) -> tuple[Path, bool]:
        """``data`` under ``name`` or its hash in ``folder`` (once); the path, and whether it was written now."""
        self.real_dir(folder)
        dest = folder / (name or sha256(data))
        try:
            if read_no_follow(dest) == data:
                return dest, False
        except (FileNotFoundError, TransactionError):
            pass  # absent, or a symlink: atomic_write replaces the link itself
        atomic_write(dest, data, mode=self._file_bits())
        return dest, True

    def keep(self, data: bytes) -> tuple[str, bool]:
        """Store ``data`` under its hash (once); the hash, and whether it was stored now."""
        dest, stored = self._store(self.originals, data)
        return dest.name, stored

    def forget(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.originals / digest).unlink()

    def original(self, digest: str) -> bytes:
        """The kept bytes with this hash; an error if missing, a symlink, or not matching."""
        dest = self.originals / digest
        if not (self.real_dir(self.path) and self.real_dir(self.originals)):
            raise TransactionError(errno.ENOENT, f"the kept original {dest} is missing")
        try:
            data = read_no_follow(dest)
        except FileNotFoundError:
            raise TransactionError(errno.ENOENT, f"the kept original {dest} is missing") from None
        except IsADirectoryError:
            raise TransactionError(errno.EISDIR, f"the kept original {dest} is not a file") from None
        except PermissionError as exc:
            raise UnreadableState(self, exc) from None
        if sha256(data) != digest:
            raise TransactionError(errno.EIO, f"the kept original {dest} does not match its recorded sha256")
        return data

    def displace(self, data: bytes, relpath: str) -> Path:
        """Keep bytes that a forced revert overwrites, so nothing is lost, under a name that says which file
        they were: ``vllm/x/y.py`` -> ``displaced/vllm.x.y.py.<sha256, 16 digits>``."""
        self._mkdir(self.displaced)
        return self._store(self.displaced, data, f"{relpath.replace('/', '.')}.{sha256(data)[:16]}")[0]

    def folders(self) -> list[Path]:
        return [self.path, self.originals, self.displaced]
