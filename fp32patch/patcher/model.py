"""The spec model and the status vocabulary: plain data, importing nothing of ours.

A spec (``patches/*.toml``, loaded by ``spec.py``) names a target distribution and one or
more files in it, the edits to make (each one operation of the vocabulary), version
windows with per-release overrides (variants), and how an upstream fix looks. Everything
else in the patcher reads these dataclasses; nothing here parses Python or touches a disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from packaging.specifiers import SpecifierSet
from packaging.version import Version


class Status(str, Enum):
    """Every status a command reports, by its name in tables and ``--json``."""

    # a patch in a root (verify / status)
    APPLIED = "applied"
    NOT_APPLIED = "not-applied"
    DRIFTED = "drifted"
    OUTDATED = "outdated"
    OBSOLETE = "obsolete"
    NOT_INSTALLED = "not-installed"
    UNSUPPORTED = "unsupported-version"
    SPEC_NOT_LOADED = "spec-not-loaded"  # the manifest records a patch no loaded spec defines
    UNRECORDED = "unrecorded"  # the files carry its markers but no record says what they were before
    ORIGINAL_LOST = "original-lost"  # applied, but the kept original is missing or altered: revert would refuse
    # what a command did or would do
    ALREADY_APPLIED = "already-applied"
    WOULD_APPLY = "would-apply"
    REVERTED = "reverted"
    ERROR = "error"
    # refusals of a transform: nothing is written
    ANCHOR_MISSING = "anchor-missing"
    ANCHOR_AMBIGUOUS = "anchor-ambiguous"
    UNPARSEABLE = "unparseable"
    PARTIALLY_APPLIED = "partially-applied"
    UNDEFINED_NAME = "undefined-name"
    EDIT_FAILED = "edit-failed"

    def __str__(self) -> str:
        return self.value

    @property
    def refused(self) -> bool:
        return self in REFUSALS


REFUSALS = frozenset(
    {
        Status.ANCHOR_MISSING,
        Status.ANCHOR_AMBIGUOUS,
        Status.UNSUPPORTED,
        Status.UNPARSEABLE,
        Status.PARTIALLY_APPLIED,
        Status.UNDEFINED_NAME,
        Status.EDIT_FAILED,
    }
)
# what verify accepts for a patch in a root
VERIFY_OK = frozenset({Status.APPLIED, Status.OBSOLETE, Status.NOT_INSTALLED})


@dataclass(frozen=True)
class Pattern:
    """Where to look and what must be there: a scope, and optionally code with ``...`` holes."""

    scope: str = ""  # dotted class/def path; "" is the module; "**" spans any depth
    match: str | None = None  # a Python expression or statement; `...` matches anything
    params: tuple[str, ...] | None = None  # the scope function's exact parameter names
    regex: str | None = None  # searched in the scope's source text (for string contents)
    file: str | None = None  # which of the spec's files (its short name); None: the default one
    name: str = ""  # its name in the spec's [shapes], where it is one of them

    def describe(self) -> str:
        parts = [f"scope {self.scope or '<module>'}"]
        if self.params is not None:
            parts.append(f"params ({', '.join(self.params)})")
        if self.match is not None:
            parts.append(f"match `{' '.join(self.match.split())}`")
        if self.regex is not None:
            parts.append(f"regex /{self.regex}/")
        return ", ".join(parts)


@dataclass(frozen=True)
class Edit:
    """One operation of the vocabulary, applied at an anchor that must match ``count`` times."""

    id: str
    op: str
    anchor: Pattern
    code: str
    count: int = 1
    catches: str | None = None  # insert_except_handler: the handler to insert after
    skip_when: tuple[Pattern, ...] = ()  # this part is already fixed upstream
    file: str = ""  # the short name of the file it edits


@dataclass(frozen=True)
class ObsoleteWhen:
    """An upstream fix, recognised when every one of its patterns is present."""

    name: str
    patterns: tuple[Pattern, ...]


@dataclass(frozen=True)
class RefuseWhen:
    """A known shape the patch must not touch, recognised when every one of its patterns is
    present: refused (``unsupported-version``) with ``why``, which says what to do instead."""

    name: str
    patterns: tuple[Pattern, ...]
    why: str


@dataclass(frozen=True)
class Variant:
    name: str
    versions: SpecifierSet
    edits: tuple[Edit, ...]  # the edits this variant makes (``omit`` already taken out)
    # shapes of newer releases, any one present keeps this variant off the files: an older
    # variant must not patch a newer file whose anchors happen to hold the older way
    unless: tuple[Pattern, ...] = ()

    def admits(self, version: Version | None) -> bool:
        return version is None or self.versions.contains(version, prereleases=True)

    @property
    def files(self) -> list[str]:
        """The short names of the files this variant edits, in the spec's order of first use."""
        return list(dict.fromkeys(e.file for e in self.edits))


@dataclass(frozen=True)
class Target:
    distribution: str
    files: tuple[tuple[str, str], ...]  # (short name, POSIX path inside the import root); the first decides
    versions: SpecifierSet

    @property
    def path(self) -> str:
        """The first file: whether the patch is installed in a root is decided by it."""
        return self.files[0][1]

    @property
    def paths(self) -> list[str]:
        return [p for _, p in self.files]

    def path_of(self, name: str) -> str:
        return dict(self.files)[name]

    @property
    def label(self) -> str:
        """``<distribution>:<first path>`` (with ``+N`` when the patch spans more files)."""
        more = f" (+{len(self.files) - 1} more)" if len(self.files) > 1 else ""
        return f"{self.distribution}:{self.path}{more}"


@dataclass(frozen=True)
class Spec:
    id: str
    summary: str
    target: Target
    variants: tuple[Variant, ...]
    obsolete_when: tuple[ObsoleteWhen, ...]
    source: str  # where it was loaded from, for messages
    sha256: str  # of the canonical content; recorded in the manifest
    description: str = ""
    env: tuple[str, ...] = field(default=())  # environment variables the patched code reads
    refuse_when: tuple[RefuseWhen, ...] = field(default=())

    @property
    def marker_prefix(self) -> str:
        return f"# fp32patch: {self.id}"

    def variants_for(self, version: Version | None) -> list[Variant]:
        if version is not None and not self.target.versions.contains(version, prereleases=True):
            return []
        return [v for v in self.variants if v.admits(version)]

    @property
    def edit_ids(self) -> list[str]:
        seen: list[str] = []
        for variant in self.variants:
            for edit in variant.edits:
                if edit.id not in seen:
                    seen.append(edit.id)
        return seen

    def edit_ids_in(self, file: str) -> list[str]:
        return [i for i in self.edit_ids if any(e.id == i and e.file == file for v in self.variants for e in v.edits)]
