"""Patch specs: TOML data files, loaded, validated and hashed.

A spec says what to change (``[[edits]]``, each one operation of ``ops.OPERATIONS``),
where (``[target]``: a distribution and a path inside its import root), for which
releases (``[[variants]]``: version windows, each able to override edit fields for the
shape that release has), and how an upstream fix looks (``[[obsolete_when]]``).

Every validation error names the file and the field (``spec.toml: edits[1].scope: ...``)
so a broken spec is fixed where it is broken. Nothing here parses Python targets.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SCHEMA_VERSION = 1
_ID_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_SCOPE_SEGMENT_RE = re.compile(r"^(\*\*|\*|[A-Za-z_][A-Za-z0-9_]*)$")


class SpecError(ValueError):
    """A spec file is malformed; the message names the file and the field."""


@dataclass(frozen=True)
class Pattern:
    """Where to look and what must be there: a scope, and optionally code with ``...`` holes."""

    scope: str = ""  # dotted class/def path; "" is the module; "**" spans any depth
    match: str | None = None  # a Python expression or statement; `...` matches anything
    params: tuple[str, ...] | None = None  # the scope function's exact parameter names
    regex: str | None = None  # searched in the scope's source text (for string contents)

    def describe(self) -> str:
        parts = [f"scope {self.scope or '<module>'}"]
        if self.params is not None:
            parts.append(f"params ({', '.join(self.params)})")
        if self.match is not None:
            parts.append(f"match `{_one_line(self.match)}`")
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


@dataclass(frozen=True)
class ObsoleteWhen:
    """An upstream fix, recognised when every one of its patterns is present."""

    name: str
    patterns: tuple[Pattern, ...]


@dataclass(frozen=True)
class Variant:
    name: str
    versions: SpecifierSet
    edits: tuple[Edit, ...]

    def admits(self, version: Version | None) -> bool:
        return version is None or self.versions.contains(version, prereleases=True)


@dataclass(frozen=True)
class Target:
    distribution: str
    path: str  # POSIX path inside the import root
    versions: SpecifierSet


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


def _one_line(code: str) -> str:
    return " ".join(code.split())


class _Fields:
    """Typed access to one TOML table, with errors that say ``file: path.field: problem``."""

    def __init__(self, source: str, where: str, table: Any):
        self.source, self.where = source, where
        if not isinstance(table, dict):
            self.fail("", f"expected a table, got {type(table).__name__}")
        self.table: dict[str, Any] = table
        self.used: set[str] = set()

    def fail(self, key: str, problem: str) -> SpecError:
        name = f"{self.where}.{key}" if self.where and key else (key or self.where or "<top>")
        raise SpecError(f"{self.source}: {name}: {problem}")

    def get(self, key: str, kind: type | tuple[type, ...], *, required: bool = False, default: Any = None) -> Any:
        self.used.add(key)
        if key not in self.table:
            if required:
                self.fail(key, "is required")
            return default
        value = self.table[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            expected = " or ".join(k.__name__ for k in kinds)
            self.fail(key, f"expected {expected}, got {type(value).__name__} {value!r}")
        return value

    def string(self, key: str, *, required: bool = False, default: str | None = None) -> str | None:
        value = self.get(key, str, required=required, default=default)
        if required and not (value or "").strip():
            self.fail(key, "must not be empty")
        return value

    def strings(self, key: str) -> tuple[str, ...] | None:
        value = self.get(key, list)
        if value is None:
            return None
        for i, item in enumerate(value):
            if not isinstance(item, str):
                self.fail(f"{key}[{i}]", f"expected str, got {type(item).__name__}")
        return tuple(value)

    def tables(self, key: str) -> list[Any]:
        value = self.get(key, list, default=[])
        return value

    def specifier(self, key: str, default: str = "") -> SpecifierSet:
        text = self.string(key, default=default) or ""
        try:
            return SpecifierSet(text)
        except InvalidSpecifier:
            self.fail(key, f"not a version specifier: {text!r} (write e.g. '>=0.11.0,<0.26')")
        raise AssertionError  # unreachable

    def done(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            self.fail(unknown[0], f"unknown field (known: {', '.join(sorted(self.used))})")


def _pattern(f: _Fields) -> Pattern:
    scope = f.string("scope", default="") or ""
    if scope:
        for segment in scope.split("."):
            if not _SCOPE_SEGMENT_RE.match(segment):
                f.fail("scope", f"bad segment {segment!r} in {scope!r} (names, '*' or '**')")
    match = f.string("match")
    if match is not None:
        _check_python(f, "match", match, pattern=True)
    regex = f.string("regex")
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as exc:
            f.fail("regex", f"not a regular expression: {exc}")
    return Pattern(scope=scope, match=match, params=f.strings("params"), regex=regex)


def _check_python(f: _Fields, key: str, code: str, *, pattern: bool = False) -> None:
    import ast

    try:
        ast.parse(code)
    except SyntaxError as exc:
        if pattern:
            # a handler pattern (`except X:`) is not a statement on its own
            try:
                ast.parse(f"try:\n    pass\n{code}")
                return
            except SyntaxError:
                pass
        f.fail(key, f"not valid Python ({exc.msg}, line {exc.lineno})")


_EDIT_FIELDS = ("catches", "code", "count", "id", "match", "op", "params", "regex", "scope", "skip_when")


def _known_edit_fields(source: str, where: str, table: dict[str, Any]) -> None:
    unknown = sorted(set(table) - set(_EDIT_FIELDS))
    if unknown:
        raise SpecError(f"{source}: {where}.{unknown[0]}: unknown field (known: {', '.join(_EDIT_FIELDS)})")


def _edit(source: str, where: str, table: Any, known_ops: dict[str, Any]) -> Edit:
    f = _Fields(source, where, table)
    edit_id = f.string("id", required=True)
    if not _ID_RE.match(edit_id or ""):
        f.fail("id", f"{edit_id!r} is not a lower-case, dash-separated id")
    op = f.string("op", required=True)
    if op not in known_ops:
        f.fail("op", f"unknown operation {op!r} (known: {', '.join(sorted(known_ops))})")
    anchor = _pattern(f)
    code = f.string("code", required=True) or ""
    count = f.get("count", int, default=1)
    if count < 1:
        f.fail("count", f"must be at least 1, got {count}")
    catches = f.string("catches")
    skip_when = tuple(
        _pattern(_Fields(source, f"{where}.skip_when[{i}]", t)) for i, t in enumerate(f.tables("skip_when"))
    )
    f.done()
    edit = Edit(id=edit_id, op=op, anchor=anchor, code=code, count=count, catches=catches, skip_when=skip_when)
    known_ops[op].validate(edit, lambda key, problem: f.fail(key, problem))
    return edit


def parse_spec(text: str, source: str) -> Spec:
    """Validate the TOML text of one spec; ``source`` names it in every error."""
    from fp32patch.patcher.ops import OPERATIONS

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    top = _Fields(source, "", data)
    schema = top.get("schema", int, required=True)
    if schema != SCHEMA_VERSION:
        top.fail("schema", f"this fp32patch reads schema {SCHEMA_VERSION}, the file has {schema}")
    spec_id = top.string("id", required=True) or ""
    if not _ID_RE.match(spec_id):
        top.fail("id", f"{spec_id!r} is not a lower-case, dash-separated id")
    summary = top.string("summary", required=True) or ""
    description = top.string("description", default="") or ""
    env = top.strings("env") or ()

    t = _Fields(source, "target", top.get("target", dict, required=True))
    path = t.string("path", required=True) or ""
    if path.startswith("/") or ".." in Path(path).parts or "\\" in path:
        t.fail("path", f"must be a relative POSIX path inside the import root, got {path!r}")
    target = Target(
        distribution=t.string("distribution", required=True) or "",
        path=path,
        versions=t.specifier("versions"),
    )
    t.done()

    raw_edits = top.tables("edits")
    if not raw_edits:
        top.fail("edits", "a spec needs at least one edit")
    by_id: dict[str, dict[str, Any]] = {}
    for i, table in enumerate(raw_edits):
        if not isinstance(table, dict):
            top.fail(f"edits[{i}]", "expected a table")
        edit_id = table.get("id")
        if edit_id in by_id:
            top.fail(f"edits[{i}].id", f"duplicate edit id {edit_id!r}")
        _known_edit_fields(source, f"edits[{i}]", table)  # named where it is written, not where merged
        by_id[str(edit_id)] = table

    variants: list[Variant] = []
    raw_variants = top.tables("variants") or [{"name": "all"}]
    for i, vt in enumerate(raw_variants):
        vf = _Fields(source, f"variants[{i}]", vt)
        name = vf.string("name", required=True) or ""
        versions = vf.specifier("versions")
        overrides = vf.get("edits", dict, default={})
        for edit_id in overrides:
            if edit_id not in by_id:
                vf.fail(f"edits.{edit_id}", f"no edit with id {edit_id!r} (edits: {', '.join(by_id)})")
        vf.done()
        edits = []
        for j, (edit_id, table) in enumerate(by_id.items()):
            merged = dict(table)
            override = overrides.get(edit_id, {})
            if not isinstance(override, dict):
                vf.fail(f"edits.{edit_id}", "expected a table of edit fields")
            if "id" in override or "op" in override:
                vf.fail(f"edits.{edit_id}", "a variant may not change an edit's id or op")
            _known_edit_fields(source, f"variants[{i}].edits.{edit_id}", override)
            merged.update(override)
            where = f"edits[{j}]" if not override else f"variants[{i}].edits.{edit_id}"
            edits.append(_edit(source, where, merged, OPERATIONS))
        variants.append(Variant(name=name, versions=versions, edits=tuple(edits)))

    obsolete = []
    for i, ot in enumerate(top.tables("obsolete_when")):
        of = _Fields(source, f"obsolete_when[{i}]", ot)
        name = of.string("name", required=True) or ""
        pats = tuple(
            _pattern(_Fields(source, f"obsolete_when[{i}].patterns[{j}]", p))
            for j, p in enumerate(of.tables("patterns"))
        )
        if not pats:
            of.fail("patterns", "needs at least one pattern")
        of.done()
        obsolete.append(ObsoleteWhen(name=name, patterns=pats))
    top.done()

    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return Spec(
        id=spec_id,
        summary=summary,
        description=description,
        target=target,
        variants=tuple(variants),
        obsolete_when=tuple(obsolete),
        source=source,
        sha256=hashlib.sha256(canonical.encode()).hexdigest(),
        env=env,
    )


def load_spec(path: Path) -> Spec:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from None
    return parse_spec(text, str(path))


def load_specs(directory: Path | None = None) -> list[Spec]:
    """Every ``*.toml`` spec in ``directory``, or the ones shipped in ``fp32patch.patches``."""
    if directory is None:
        files = sorted(
            (entry for entry in resources.files("fp32patch.patches").iterdir() if entry.name.endswith(".toml")),
            key=lambda entry: entry.name,
        )
        specs = [parse_spec(entry.read_text(encoding="utf-8"), f"fp32patch/patches/{entry.name}") for entry in files]
    else:
        if not directory.is_dir():
            raise SpecError(f"{directory}: not a directory of specs")
        specs = [load_spec(p) for p in sorted(directory.glob("*.toml"))]
        if not specs:
            raise SpecError(f"{directory}: holds no *.toml specs")
    seen: dict[str, str] = {}
    for spec in specs:
        if spec.id in seen:
            raise SpecError(f"{spec.source}: id: {spec.id!r} is already defined by {seen[spec.id]}")
        seen[spec.id] = spec.source
    return specs


def parse_version(text: str | None) -> Version | None:
    if not text:
        return None
    try:
        return Version(text)
    except InvalidVersion:
        return None
