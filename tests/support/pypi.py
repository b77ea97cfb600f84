"""Real upstream artifacts for tests: release files read straight out of PyPI wheels.

A vLLM wheel is 250-400 MB; the tests need a few of its members. ``wheel_members``
reads the wheel's zip directory and just those members over HTTP range requests (about
a second per release) and caches them under ``$FP32PATCH_TEST_CACHE``; ``wheel_file``
downloads a whole wheel with pip, for the tests that install it as a real import root.

Test processes run side by side (pytest-xdist), so each fetch holds a lock file of its own
under the cache, and what others may be reading is only ever added to, each file written
whole (temp file + ``os.replace``), never removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

INDEX = os.environ.get("FP32PATCH_TEST_INDEX", "https://pypi.org/simple")


def cache_root() -> Path:
    return Path(os.environ.get("FP32PATCH_TEST_CACHE", Path.home() / ".cache" / "fp32patch-tests"))


@contextlib.contextmanager
def _locked(key: str):
    """Hold ``key``'s lock under the cache, across processes."""
    folder = cache_root() / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"{key}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_whole(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", delete=False) as out:
        out.write(data)
    os.replace(out.name, target)


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file, one HTTP range request per read."""

    def __init__(self, url: str):
        self.url, self.pos = url, 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=60) as r:
            self.size = int(r.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def readinto(self, buffer) -> int:
        if self.pos >= self.size or not len(buffer):
            return 0
        end = min(self.size, self.pos + len(buffer)) - 1
        request = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end}"})
        with urllib.request.urlopen(request, timeout=60) as r:
            data = r.read()
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _wheel_url(project: str, version: str) -> tuple[str, str]:
    request = urllib.request.Request(f"{INDEX}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    prefix = f"{project.replace('-', '_')}-{version}-"
    wheels = [
        f for f in files if f["filename"].startswith(prefix) and f["filename"].endswith(".whl") and not f.get("yanked")
    ]
    linux = [f for f in wheels if "x86_64" in f["filename"]] or wheels
    if not linux:
        raise LookupError(f"no wheel of {project}=={version} on {INDEX}")
    return linux[0]["url"], linux[0]["filename"]


def wheel_members(project: str, version: str, members: list[str]) -> Path:
    """A folder holding ``members`` of ``project==version``'s wheel plus its .dist-info.

    The cache grows: a later call that asks for another member fetches what it had plus
    that one, so the NemotronH and LogitsProcessor matrices share one folder per release.
    Members the wheel does not hold are recorded as asked for and stay absent.
    """
    dest = cache_root() / "wheel-members" / f"{project}-{version}"
    stamp = dest / ".complete"
    if set(members) <= set(_members_had(stamp)):
        return dest
    with _locked(f"wheel-members-{project}-{version}"):
        have = _members_had(stamp)  # another process may have fetched them meanwhile
        if set(members) <= set(have):
            return dest
        want = sorted(set(have) | set(members))
        url, _ = _wheel_url(project, version)
        with zipfile.ZipFile(io.BufferedReader(_RangeFile(url), buffer_size=1 << 16)) as wheel:
            names = wheel.namelist()
            info = [
                n
                for n in names
                if n.split("/")[0].endswith(".dist-info") and n.rsplit("/", 1)[-1] in ("METADATA", "RECORD", "WHEEL")
            ]
            for member in [*(m for m in want if m not in have), *info]:
                name = _in_wheel(member, names)
                if name is not None and not (dest / member).exists():
                    data = wheel.read(name)
                    _write_whole(dest / member, _installed_record(data) if member.endswith("RECORD") else data)
        _write_whole(stamp, json.dumps(want).encode())
    return dest


def _in_wheel(member: str, names: list[str]) -> str | None:
    """Where the wheel holds ``member`` (a path as installed): at that path, or under the wheel's
    ``<dist>.data/purelib/`` or ``platlib/`` (OpenRLHF's wheels put their package there)."""
    if member in names:
        return member
    for name in names:
        head, _, rest = name.partition("/")
        if head.endswith(".data") and rest.partition("/")[0] in ("purelib", "platlib"):
            if rest.partition("/")[2] == member:
                return name
    return None


def _installed_record(data: bytes) -> bytes:
    """A wheel's RECORD as pip installs it: rows under ``<dist>.data/purelib/`` (or ``platlib/``)
    name the installed path."""
    rows = []
    for row in data.decode().splitlines(keepends=True):
        head, _, rest = row.partition("/")
        if head.endswith(".data") and rest.startswith(("purelib/", "platlib/")):
            row = rest.partition("/")[2]
        rows.append(row)
    return "".join(rows).encode()


def _members_had(stamp: Path) -> list[str]:
    return json.loads(stamp.read_text()) if stamp.exists() else []


def member_files(project: str, version: str, members: list[str]) -> dict[str, Path]:
    """``members`` of the release that its wheel holds, plus its dist-info files, by path in
    the wheel; other members cached for the release are left out."""
    src = wheel_members(project, version, members)
    out = {}
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(src).as_posix()
        if path.is_file() and (rel in members or rel.split("/")[0].endswith(".dist-info")):
            out[rel] = path
    return out


def import_root_from_members(project: str, version: str, members: list[str], where: Path) -> Path:
    """Lay ``members`` (and the dist-info) out in ``where`` as an installed import root."""
    for rel, path in member_files(project, version, members).items():
        target = where / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return where


def wheel_file(project: str, version: str) -> Path:
    """The whole wheel, downloaded once with pip into the test cache."""
    folder = cache_root() / "wheels"
    prefix = f"{project.replace('-', '_')}-{version}-"
    found = sorted(folder.glob(f"{prefix}*.whl")) if folder.exists() else []
    if found:
        return found[0]
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(f"wheel-{project}-{version}"):
        found = sorted(folder.glob(f"{prefix}*.whl"))
        if found:
            return found[0]
        with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as partial:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--only-binary=:all:",
                    # the file, not an install: a release asking a newer Python (SkyRL 0.4.0: >= 3.12)
                    # is read, or installed with --ignore-requires-python, by the tests on this one
                    "--ignore-requires-python",
                    "-d",
                    partial,
                    f"{project}=={version}",
                ],
                check=True,
            )
            for wheel in Path(partial).glob("*.whl"):
                os.replace(wheel, folder / wheel.name)
    return sorted(folder.glob(f"{prefix}*.whl"))[0]


def pip_install_target(project: str, version: str, where: Path) -> Path:
    """``pip install --no-deps --target where project==version``: a real import root."""
    wheel = wheel_file(project, version)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(where), str(wheel)],
        check=True,
    )
    return where


def sdist_file(project: str, version: str) -> Path:
    """The release's sdist, downloaded once (by URL, sha256-checked: ``pip download`` would build it)."""
    folder = cache_root() / "sdists"
    name = f"{project}-{version}.tar.gz"
    dest = folder / name
    if dest.exists():
        return dest
    request = urllib.request.Request(f"{INDEX}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    entry = next((f for f in files if f["filename"] == name), None)
    if entry is None:
        raise LookupError(f"no sdist {name} on {INDEX}")
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(f"sdist-{project}-{version}"):
        if dest.exists():
            return dest
        digest = hashlib.sha256()
        with (
            urllib.request.urlopen(entry["url"], timeout=300) as r,
            tempfile.NamedTemporaryFile(dir=folder, prefix=f".{name}.", delete=False) as out,
        ):
            while chunk := r.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
        if digest.hexdigest() != entry["hashes"]["sha256"]:
            os.unlink(out.name)
            raise OSError(f"{name}: sha256 does not match the index")
        os.replace(out.name, dest)
    return dest
