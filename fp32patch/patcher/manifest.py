"""The state record: what was patched in one import root, with hashes. Data only; no I/O.

It lives at ``<root>/.fp32patch/manifest.json`` beside the kept originals
(``originals/<sha256>``). Because the manifest and the originals are read back by
``revert`` they are input too: every path must stay relative and inside the root,
every hash must be a sha256, and a manifest from a newer fp32patch is refused rather
than misread.
"""

from __future__ import annotations

import json
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import PurePosixPath

from packaging.version import InvalidVersion, Version

from fp32patch import __version__

SCHEMA = 1
STATE_DIR = ".fp32patch"
MANIFEST = "manifest.json"
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
# a RECORD fp32patch keeps in step is a top-level dist-info's; nothing else is ever rewritten
_RECORD_RE = re.compile(r"^[^/]+\.dist-info/RECORD$")

# Entry states. "pending": an apply or revert has recorded its intent (an ``Intent`` for
# the file) and may not have replaced the file yet; "reverting": the state an older
# fp32patch left on an entry it was dropping. A crash leaves them; the next apply or revert
# settles them by the file's bytes (transaction.Transaction.recover).
APPLIED, PENDING, REVERTING = "applied", "pending", "reverting"
STATES = (APPLIED, PENDING, REVERTING)


class ManifestError(ValueError):
    """The manifest cannot be trusted as it is; the message says which field and why."""


@dataclass
class Entry:
    patch: str
    path: str  # POSIX, relative to the root
    spec_sha256: str
    distribution: str
    version: str | None
    variant: str | None
    sha256_before: str
    sha256_after: str
    mode: int  # permission bits of the file as found
    record: str | None  # the dist-info RECORD rewritten alongside, relative to the root
    applied_at: str
    state: str = APPLIED  # PENDING or REVERTING while a transaction is writing
    tool_version: str = __version__
    # the file's RECORD row (its text, no line ending) before it was first patched, so a revert
    # gives back the row it found, not one computed from the bytes (None: no row, or an older record)
    record_row: str | None = None


# each field's JSON types: a manifest with another is refused, naming the field
_TYPES: dict[str, tuple[type, ...]] = {
    "patch": (str,),
    "path": (str,),
    "spec_sha256": (str,),
    "distribution": (str,),
    "version": (str, type(None)),
    "variant": (str, type(None)),
    "sha256_before": (str,),
    "sha256_after": (str,),
    "mode": (int,),
    "record": (str, type(None)),
    "applied_at": (str,),
    "state": (str,),
    "tool_version": (str,),
    "record_row": (str, type(None)),
}
_JSON_NAMES = {str: "a string", int: "an integer", type(None): "null"}


@dataclass
class Intent:
    """A file write in flight: its bytes before and after, and the file's entries before it.

    The new entries are already in the manifest (``pending``). If the file still has its
    ``sha256_from`` bytes after a crash, ``previous`` is put back; if it has ``sha256_to``,
    the new entries stand.
    """

    path: str
    sha256_from: str
    sha256_to: str
    previous: list[Entry] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**asdict(self), "previous": [asdict(e) for e in self.previous]}


@dataclass
class Manifest:
    entries: list[Entry] = field(default_factory=list)
    tool_version: str = __version__
    intents: list[Intent] = field(default_factory=list)

    def on(self, path: str) -> list[Entry]:
        """The entries of every patch on one file."""
        return [e for e in self.entries if e.path == path]

    def replace_path(self, path: str, entries: list[Entry]) -> None:
        self.entries = [e for e in self.entries if e.path != path] + list(entries)

    def intent(self, path: str) -> Intent | None:
        return next((i for i in self.intents if i.path == path), None)

    def find(self, patch: str, path: str) -> Entry | None:
        return next((e for e in self.entries if e.patch == patch and e.path == path), None)

    def put(self, entry: Entry) -> None:
        self.entries = [e for e in self.entries if not (e.patch == entry.patch and e.path == entry.path)]
        self.entries.append(entry)

    def drop(self, patch: str, path: str) -> None:
        self.entries = [e for e in self.entries if not (e.patch == patch and e.path == path)]

    def interrupted(self) -> list[Entry]:
        return [e for e in self.entries if e.state != APPLIED]

    def was_interrupted(self) -> bool:
        return bool(self.intents) or bool(self.interrupted())

    def dumps(self) -> bytes:
        data = {
            "schema": SCHEMA,
            "tool": "fp32patch",
            "tool_version": __version__,
            "entries": [asdict(e) for e in self.entries],
        }
        if self.intents:
            data["intents"] = [i.to_json() for i in self.intents]
        return (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8")


def safe_relpath(value: object, where: str) -> str:
    """A relative POSIX path that cannot leave the root (no '..', not absolute, no drive)."""
    if not isinstance(value, str) or not value:
        raise ManifestError(f"{where}: expected a relative path, got {value!r}")
    p = PurePosixPath(value)
    if p.is_absolute() or ".." in p.parts or "\\" in value or ":" in p.parts[0] or "\x00" in value:
        raise ManifestError(f"{where}: {value!r} is not a relative path inside the import root")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _sha(value: object, where: str) -> str:
    if not isinstance(value, str) or not _SHA_RE.match(value):
        raise ManifestError(f"{where}: expected a sha256 hex digest, got {value!r}")
    return value


def loads(raw: bytes, where: str) -> Manifest:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc}); it may be truncated or corrupted") from None
    except RecursionError:
        raise ManifestError(f"{where}: nested too deeply to be an fp32patch manifest") from None
    if not isinstance(data, dict) or data.get("tool") != "fp32patch":
        raise ManifestError(f"{where}: not an fp32patch manifest")
    written_by = str(data.get("tool_version", ""))
    try:
        newer = Version(written_by) > Version(__version__)
    except InvalidVersion:
        raise ManifestError(f"{where}: tool_version {written_by!r} is not a version") from None
    if data.get("schema") != SCHEMA or newer:
        raise ManifestError(
            f"{where}: written by fp32patch {written_by} (schema {data.get('schema')}), newer than this "
            f"fp32patch {__version__} (schema {SCHEMA}); upgrade fp32patch to use it"
        )
    entries_raw = data.get("entries")
    if not isinstance(entries_raw, list):
        raise ManifestError(f"{where}: entries: expected a list")
    entries = [_entry(e, f"{where}: entries[{i}]") for i, e in enumerate(entries_raw)]
    intents_raw = data.get("intents", [])
    if not isinstance(intents_raw, list):
        raise ManifestError(f"{where}: intents: expected a list")
    intents = []
    for i, raw_intent in enumerate(intents_raw):
        at = f"{where}: intents[{i}]"
        if not isinstance(raw_intent, dict) or not isinstance(raw_intent.get("previous", []), list):
            raise ManifestError(f"{at}: expected an object with a list of previous entries")
        intents.append(
            Intent(
                path=safe_relpath(raw_intent.get("path"), f"{at}.path"),
                sha256_from=_sha(raw_intent.get("sha256_from"), f"{at}.sha256_from"),
                sha256_to=_sha(raw_intent.get("sha256_to"), f"{at}.sha256_to"),
                previous=[_entry(e, f"{at}.previous[{j}]") for j, e in enumerate(raw_intent.get("previous", []))],
            )
        )
    return Manifest(entries=entries, tool_version=written_by, intents=intents)


def _entry(e: object, at: str) -> Entry:
    if not isinstance(e, dict):
        raise ManifestError(f"{at}: expected an object")
    known = {f.name: f for f in fields(Entry)}
    unknown = sorted(set(e) - set(known))
    if unknown:
        raise ManifestError(f"{at}: unknown field {unknown[0]!r} (an entry has {', '.join(known)})")
    missing = [n for n, f in known.items() if n not in e and f.default is MISSING]
    if missing:
        raise ManifestError(f"{at}: the field {missing[0]!r} is missing")
    for name, value in e.items():
        types = _TYPES[name]
        if not isinstance(value, types) or isinstance(value, bool):
            expected = " or ".join(_JSON_NAMES[t] for t in types)
            raise ManifestError(f"{at}.{name}: expected {expected}, got {_short(value)}")
    entry = Entry(**e)
    safe_relpath(entry.path, f"{at}.path")
    if entry.record is not None:
        safe_relpath(entry.record, f"{at}.record")
        if not _RECORD_RE.match(entry.record):
            raise ManifestError(f"{at}.record: {entry.record!r} is not a top-level *.dist-info/RECORD")
    _sha(entry.sha256_before, f"{at}.sha256_before")
    _sha(entry.sha256_after, f"{at}.sha256_after")
    if not isinstance(entry.mode, int) or not 0 <= entry.mode <= 0o7777:
        raise ManifestError(f"{at}.mode: expected permission bits, got {entry.mode!r}")
    if entry.state not in STATES:
        raise ManifestError(f"{at}.state: expected one of {', '.join(STATES)}, got {entry.state!r}")
    return entry
