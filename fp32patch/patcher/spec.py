"""Patch specs: TOML data files, loaded, validated and hashed (into ``model`` dataclasses).

A spec says what to change (``[[edits]]``, each one operation of ``vocabulary.OPERATIONS``),
where (``[target]``: a distribution and one or more files inside its import root), for
which releases (``[[variants]]``: version windows, each able to override edit fields or
leave edits out for the shape that release has), and how an upstream fix looks
(``[[obsolete_when]]``).

Every validation error names the file and the field (``spec.toml: edits[1].scope: ...``)
in TOML's words (table, array, string) so a broken spec is fixed where it is broken.
Nothing here parses Python targets, and nothing here imports libcst.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
import sys
from dataclasses import replace
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from fp32patch.patcher.model import Edit, ObsoleteWhen, Pattern, RefuseWhen, Spec, Target, Variant
from fp32patch.patcher.vocabulary import EDIT_FIELDS, OPERATIONS, pattern_kind

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SCHEMA_VERSION = 1
_ID_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_SCOPE_SEGMENT_RE = re.compile(r"^(\*\*|\*|[A-Za-z_][A-Za-z0-9_]*)$")
_FILE_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
# TOML's names for what a field holds
_TOML_TYPE = {dict: "table", list: "array", str: "string", int: "integer", bool: "boolean", float: "float"}

_TOP_FIELDS = (
    "schema",
    "id",
    "summary",
    "description",
    "env",
    "target",
    "edits",
    "variants",
    "obsolete_when",
    "refuse_when",
    "shapes",
)
_TARGET_FIELDS = ("distribution", "path", "files", "versions")
_VARIANT_FIELDS = ("name", "versions", "edits", "omit", "unless")
_PATTERN_FIELDS = ("scope", "match", "params", "regex", "file")
_MAIN = "main"  # the short name of a single-file spec's file


class SpecError(ValueError):
    """A spec file is malformed; the message names the file and the field."""


def _toml_type(value: object) -> str:
    return _TOML_TYPE.get(type(value), type(value).__name__)


class _Fields:
    """Typed access to one TOML table, with errors that say ``file: path.field: problem``.

    Unknown fields are reported first (a misspelt field otherwise shows up as a missing
    required one), with the nearest known name.
    """

    def __init__(self, source: str, where: str, table: Any, known: tuple[str, ...]):
        self.source, self.where = source, where
        if not isinstance(table, dict):
            self.fail("", f"expected a table, got {_toml_type(table)}")
        self.table: dict[str, Any] = table
        unknown = sorted(set(table) - set(known))
        if unknown:
            near = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            self.fail(unknown[0], f"unknown field ({hint}known: {', '.join(known)})")

    def fail(self, key: str, problem: str) -> SpecError:
        name = f"{self.where}.{key}" if self.where and key else (key or self.where or "<top>")
        raise SpecError(f"{self.source}: {name}: {problem}")

    def get(self, key: str, kind: type | tuple[type, ...], *, required: bool = False, default: Any = None) -> Any:
        if key not in self.table:
            if required:
                self.fail(key, "is required")
            return default
        value = self.table[key]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            kinds = kind if isinstance(kind, tuple) else (kind,)
            expected = " or ".join(_TOML_TYPE.get(k, k.__name__) for k in kinds)
            self.fail(key, f"expected {expected}, got {_toml_type(value)} {value!r}")
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
                self.fail(f"{key}[{i}]", f"expected string, got {_toml_type(item)}")
        return tuple(value)

    def tables(self, key: str) -> list[Any]:
        return self.get(key, list, default=[])

    def specifier(self, key: str, default: str = "") -> SpecifierSet:
        text = self.string(key, default=default) or ""
        try:
            return SpecifierSet(text)
        except InvalidSpecifier:
            self.fail(key, f"not a version specifier: {text!r} (write e.g. '>=0.11.0,<0.26')")
        raise AssertionError  # unreachable


class _Shapes:
    """The spec's ``[shapes]``: patterns written once, by name, and named in any pattern list
    (``unless``, ``skip_when``, ``patterns``). Each is checked where written (``shapes.NAME``);
    a name that no list uses is refused, as a misspelt use would leave it."""

    def __init__(self, source: str, table: Any, files: dict[str, str]):
        f = _Fields(source, "shapes", table or {}, tuple(table or ()))  # any name is a field
        self.raw: dict[str, dict[str, Any]] = {}
        self.patterns: dict[str, Pattern] = {}
        for name, value in f.table.items():
            if not _ID_RE.match(name):
                f.fail(name, "a shape's name is lower-case and dash-separated")
            pattern = _pattern(_Fields(source, f"shapes.{name}", value, _PATTERN_FIELDS), files)
            self.raw[name], self.patterns[name] = value, replace(pattern, name=name)
        self.used: set[str] = set()
        self.fields = f

    def get(self, f: _Fields, where: str, name: str) -> Pattern:
        if name not in self.patterns:
            near = difflib.get_close_matches(name, self.patterns, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            known = f"shapes: {', '.join(self.patterns)}" if self.patterns else "the spec has no [shapes]"
            f.fail(where, f"no shape named {name!r} ({hint}{known})")
        self.used.add(name)
        return self.patterns[name]

    def check_used(self) -> None:
        for name in self.patterns:
            if name not in self.used:
                self.fields.fail(name, "named in no unless, skip_when or patterns list")

    def expanded(self, items: Any) -> Any:
        """A pattern list with each name replaced by its table (what the spec hash reads)."""
        return [self.raw[item] if isinstance(item, str) else item for item in items]


def _patterns(source: str, f: _Fields, key: str, files: dict[str, str], shapes: _Shapes) -> tuple[Pattern, ...]:
    """The list of patterns under ``key`` of the table ``f``: tables, or names of ``[shapes]``
    (each named where written)."""
    return tuple(
        shapes.get(f, f"{key}[{j}]", p)
        if isinstance(p, str)
        else _pattern(_Fields(source, f"{f.where}.{key}[{j}]", p, _PATTERN_FIELDS), files)
        for j, p in enumerate(f.tables(key))
    )


def _known_shape_patterns(source: str, f: _Fields, files: dict[str, str], shapes: _Shapes) -> tuple[Pattern, ...]:
    """The ``patterns`` of an ``obsolete_when`` or ``refuse_when`` table ``f``: at least one."""
    pats = _patterns(source, f, "patterns", files, shapes)
    if not pats:
        f.fail("patterns", "needs at least one pattern")
    return pats


def _pattern(f: _Fields, files: dict[str, str]) -> Pattern:
    scope = f.string("scope", default="") or ""
    if scope:
        for segment in scope.split("."):
            if not _SCOPE_SEGMENT_RE.match(segment):
                f.fail("scope", f"bad segment {segment!r} in {scope!r} (names, '*' or '**')")
    match = f.string("match")
    if match is not None:
        try:
            pattern_kind(match)
        except (SyntaxError, ValueError) as exc:
            f.fail("match", f"not valid Python ({getattr(exc, 'msg', exc)})")
    regex = f.string("regex")
    if regex is not None:
        try:
            re.compile(regex)
        except re.error as exc:
            f.fail("regex", f"not a regular expression: {exc}")
    file = f.string("file")
    if file is not None and file not in files:
        f.fail("file", f"no file named {file!r} in [target] files (files: {', '.join(files)})")
    return Pattern(scope=scope, match=match, params=f.strings("params"), regex=regex, file=file)


def _read_code_file(f: _Fields, base: Traversable | Path | None, name: str) -> str:
    if name.startswith("/") or ".." in Path(name).parts or "\\" in name:
        f.fail("code_file", f"must be a relative path under the specs folder, got {name!r}")
    if base is None:
        f.fail("code_file", "this spec was not loaded from a folder, so code_file cannot be read")
    entry: Any = base
    for part in name.split("/"):
        entry = entry / part
    try:
        return entry.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        f.fail("code_file", f"cannot read {name}: {exc}")
    raise AssertionError  # unreachable


def _edit(source: str, where: str, table: dict[str, Any], files: dict[str, str], shapes: _Shapes, base) -> Edit:
    f = _Fields(source, where, table, tuple(EDIT_FIELDS))
    edit_id = f.string("id", required=True)
    if not _ID_RE.match(edit_id or ""):
        f.fail("id", f"{edit_id!r} is not a lower-case, dash-separated id")
    op = f.string("op", required=True)
    if op not in OPERATIONS:
        near = difflib.get_close_matches(op or "", OPERATIONS, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        f.fail("op", f"unknown operation {op!r} ({hint}known: {', '.join(sorted(OPERATIONS))})")
    file = f.string("file")
    if file is None:
        if len(files) > 1:
            f.fail("file", f"this spec edits several files; name one ({', '.join(files)})")
        file = next(iter(files))
    elif file not in files:
        f.fail("file", f"no file named {file!r} in [target] files (files: {', '.join(files)})")
    anchor = _pattern(f, files)
    if "code" in table and "code_file" in table:
        f.fail("code_file", "give code or code_file, not both")
    code_file = f.string("code_file")
    code = _read_code_file(f, base, code_file) if code_file else (f.string("code", required=True) or "")
    count = f.get("count", int, default=1)
    if count < 1:
        f.fail("count", f"must be at least 1, got {count}")
    catches = f.string("catches")
    skip_when = _patterns(source, f, "skip_when", files, shapes)
    edit = Edit(
        id=edit_id or "",
        op=op or "",
        anchor=anchor,
        code=code,
        count=count,
        catches=catches,
        skip_when=skip_when,
        file=file,
    )
    OPERATIONS[edit.op].validate(edit, lambda key, problem: f.fail(key, problem))
    return edit


def _target(top: _Fields) -> Target:
    t = _Fields(top.source, "target", top.get("target", dict, required=True), _TARGET_FIELDS)
    if ("path" in t.table) == ("files" in t.table):
        t.fail("files", "give either path (one file) or files (a table of short name = path)")
    if "path" in t.table:
        files = {_MAIN: t.string("path", required=True) or ""}
    else:
        raw = t.get("files", dict)
        if not raw:
            t.fail("files", "needs at least one file")
        files = {}
        for name, path in raw.items():
            if not _FILE_NAME_RE.match(name):
                t.fail(f"files.{name}", "a file's short name is letters, digits, '_' and '-'")
            if not isinstance(path, str):
                t.fail(f"files.{name}", f"expected string, got {_toml_type(path)}")
            files[name] = path
    for name, path in files.items():
        key = "path" if "path" in t.table else f"files.{name}"
        if not path or path.startswith("/") or ".." in Path(path).parts or "\\" in path:
            t.fail(key, f"must be a relative POSIX path inside the import root, got {path!r}")
    if len(set(files.values())) != len(files):
        t.fail("files", "a file is listed twice")
    return Target(
        distribution=t.string("distribution", required=True) or "",
        files=tuple(files.items()),
        versions=t.specifier("versions"),
    )


def parse_spec(text: str, source: str, *, base: Traversable | Path | None = None) -> Spec:
    """Validate the TOML text of one spec; ``source`` names it in every error.

    ``base`` is the folder ``code_file`` paths are relative to (the specs folder).
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:
        raise SpecError(f"{source}: nested too deeply to be a spec") from None
    top = _Fields(source, "", data, _TOP_FIELDS)
    schema = top.get("schema", int, required=True)
    if schema != SCHEMA_VERSION:
        top.fail("schema", f"this fp32patch reads schema {SCHEMA_VERSION}, the file has {schema}")
    spec_id = top.string("id", required=True) or ""
    if not _ID_RE.match(spec_id):
        top.fail("id", f"{spec_id!r} is not a lower-case, dash-separated id")
    summary = top.string("summary", required=True) or ""
    description = top.string("description", default="") or ""
    env = top.strings("env") or ()
    target = _target(top)
    files = dict(target.files)
    shapes = _Shapes(source, top.get("shapes", dict), files)

    raw_edits = top.tables("edits")
    if not raw_edits:
        top.fail("edits", "a spec needs at least one edit")
    by_id: dict[str, dict[str, Any]] = {}
    for i, table in enumerate(raw_edits):
        if not isinstance(table, dict):
            top.fail(f"edits[{i}]", f"expected a table, got {_toml_type(table)}")
        edit_id = table.get("id")
        if edit_id in by_id:
            top.fail(f"edits[{i}].id", f"duplicate edit id {edit_id!r}")
        _Fields(source, f"edits[{i}]", table, tuple(EDIT_FIELDS))  # unknown fields, named where written
        by_id[str(edit_id)] = table

    variants: list[Variant] = []
    raw_variants = top.tables("variants") or [{"name": "all"}]
    resolved: dict[str, str] = {}  # code_file contents, for the hash
    for i, vt in enumerate(raw_variants):
        vf = _Fields(source, f"variants[{i}]", vt, _VARIANT_FIELDS)
        name = vf.string("name", required=True) or ""
        versions = vf.specifier("versions")
        overrides = vf.get("edits", dict, default={})
        for edit_id in overrides:
            if edit_id not in by_id:
                vf.fail(f"edits.{edit_id}", f"no edit with id {edit_id!r} (edits: {', '.join(by_id)})")
        omit = vf.strings("omit") or ()
        for j, edit_id in enumerate(omit):
            if edit_id not in by_id:
                vf.fail(f"omit[{j}]", f"no edit with id {edit_id!r} (edits: {', '.join(by_id)})")
        edits = []
        for j, (edit_id, table) in enumerate(by_id.items()):
            override = overrides.get(edit_id, {})
            if not isinstance(override, dict):
                vf.fail(f"edits.{edit_id}", "expected a table of edit fields")
            if "id" in override or "op" in override:
                vf.fail(f"edits.{edit_id}", "a variant may not change an edit's id or op")
            _Fields(source, f"variants[{i}].edits.{edit_id}", override, tuple(EDIT_FIELDS))
            if edit_id in omit:
                continue
            merged = {**table, **override}
            if "code_file" in override:
                merged.pop("code", None)
            elif "code" in override:
                merged.pop("code_file", None)
            where = f"edits[{j}]" if not override else f"variants[{i}].edits.{edit_id}"
            edit = _edit(source, where, merged, files, shapes, base)
            if "code_file" in merged:
                resolved[merged["code_file"]] = edit.code
            edits.append(edit)
        if not edits:
            vf.fail("omit", "a variant needs at least one edit")
        unless = _patterns(source, vf, "unless", files, shapes)
        variants.append(Variant(name=name, versions=versions, edits=tuple(edits), unless=unless))

    obsolete = []
    for i, ot in enumerate(top.tables("obsolete_when")):
        of = _Fields(source, f"obsolete_when[{i}]", ot, ("name", "patterns"))
        name = of.string("name", required=True) or ""
        obsolete.append(ObsoleteWhen(name=name, patterns=_known_shape_patterns(source, of, files, shapes)))

    refused = []
    for i, rt in enumerate(top.tables("refuse_when")):
        rf = _Fields(source, f"refuse_when[{i}]", rt, ("name", "patterns", "why"))
        name = rf.string("name", required=True) or ""
        why = rf.string("why", required=True) or ""
        pats = _known_shape_patterns(source, rf, files, shapes)
        refused.append(RefuseWhen(name=name, patterns=pats, why=" ".join(why.split())))

    shapes.check_used()
    canonical = json.dumps(
        {"spec": _expanded(data, shapes), "code_files": resolved}, sort_keys=True, separators=(",", ":"), default=str
    )
    return Spec(
        id=spec_id,
        summary=summary,
        description=description,
        target=target,
        variants=tuple(variants),
        obsolete_when=tuple(obsolete),
        refuse_when=tuple(refused),
        source=source,
        sha256=hashlib.sha256(canonical.encode()).hexdigest(),
        env=env,
    )


def _expanded(data: dict[str, Any], shapes: _Shapes) -> dict[str, Any]:
    """The validated spec ``data`` with every named shape written out and ``[shapes]`` gone:
    naming a pattern is notation, so it leaves the spec hash (and a patched tree's state) as it
    was with the pattern written in place."""

    def edit(table: dict[str, Any]) -> dict[str, Any]:
        return {**table, "skip_when": shapes.expanded(table["skip_when"])} if "skip_when" in table else table

    def listed(table: dict[str, Any], key: str) -> dict[str, Any]:
        return {**table, key: shapes.expanded(table[key])} if key in table else table

    out = {key: value for key, value in data.items() if key != "shapes"}
    if "edits" in out:
        out["edits"] = [edit(t) for t in out["edits"]]
    if "variants" in out:
        out["variants"] = [
            listed({**v, "edits": {k: edit(e) for k, e in v["edits"].items()}} if "edits" in v else v, "unless")
            for v in out["variants"]
        ]
    for key in ("obsolete_when", "refuse_when"):
        if key in out:
            out[key] = [listed(t, "patterns") for t in out[key]]
    return out


def load_spec(path: Path) -> Spec:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from None
    return parse_spec(text, str(path), base=path.parent)


def load_specs(directory: Path | None = None) -> list[Spec]:
    """Every ``*.toml`` spec in ``directory``, or the ones shipped in ``fp32patch.patches``."""
    if directory is None:
        base = resources.files("fp32patch.patches")
        files = sorted((entry for entry in base.iterdir() if entry.name.endswith(".toml")), key=lambda e: e.name)
        specs = [
            parse_spec(entry.read_text(encoding="utf-8"), f"fp32patch/patches/{entry.name}", base=base)
            for entry in files
        ]
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
