"""One spec x the texts of its files -> a result. Pure: bytes in, bytes out, never the disk.

The result is ``applied`` (new bytes for the files it changes), ``already-applied`` (every
edit's marker is there), ``obsolete`` (an upstream fix is recognised), or a refusal:
``anchor-missing``, ``anchor-ambiguous``, ``unsupported-version``, ``unparseable``,
``partially-applied``, ``undefined-name``, ``edit-failed``; a shape the spec names in
``refuse_when`` is refused as ``unsupported-version`` with the spec's reason. New text is re-parsed,
compiled and checked for names nothing defines before it is returned, and each file keeps
its form: encoding declaration, byte-order mark, line endings, indentation, final newline.
Any unexpected error while planning an edit becomes a refusal that names the patch and the
edit: never a traceback.

A spec over several files is planned as one: one variant for all of them (a release's
files move together), every file's edits or none.
"""

from __future__ import annotations

import ast
import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field

import libcst as cst

from fp32patch.patcher import ops
from fp32patch.patcher.markers import markers_in
from fp32patch.patcher.match import present
from fp32patch.patcher.model import Edit, Pattern, Spec, Status, Variant
from fp32patch.patcher.names import undefined_names
from fp32patch.patcher.spec import parse_version

_BOM = b"\xef\xbb\xbf"
_UPGRADE_HINT = (
    "The installed release changed the code this patch anchors on. Run `fp32patch check --against <its wheel "
    "or checkout>` and look for an fp32patch release with a matching spec; nothing was written."
)


@dataclass
class Result:
    spec_id: str
    path: str  # the spec's first file, for messages
    version: str | None
    status: Status
    files: dict[str, bytes] = field(default_factory=dict)  # "applied": relpath -> new bytes (changed files only)
    variant: str | None = None
    message: str = ""
    edits: list[str] = field(default_factory=list)  # edits performed
    skipped: list[str] = field(default_factory=list)  # edits already fixed upstream
    anchor: str | None = None  # the anchor a refusal is about
    unreadable: str | None = None  # the release's version could not be read: the anchors alone picked the variant

    @property
    def ok(self) -> bool:
        return not self.status.refused

    @property
    def new(self) -> bytes | None:
        """The new bytes of the first file (a single-file spec's only file)."""
        return self.files.get(self.path)


class _Refusal(Exception):
    def __init__(
        self, status: Status, detail: str, *, anchor: str | None = None, reached: tuple[bool, int] = (False, 0)
    ):
        super().__init__(detail)
        self.status, self.detail, self.anchor = status, detail, anchor
        # how near its variant came: whether every file it edits is there, and how many of its
        # edits held before this one failed
        self.reached = reached


@dataclass
class _File:
    path: str
    text: str
    bom: bool
    module: cst.Module


def _decode(source: bytes) -> tuple[str, bool]:
    bom = source.startswith(_BOM)
    return source[len(_BOM) :].decode("utf-8") if bom else source.decode("utf-8"), bom


def _syntax_error(text: str, exc: cst.ParserSyntaxError) -> str:
    """Where the file is broken, as Python itself says it (libcst's positions can trail the cause)."""
    try:
        compile(text, "<target>", "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
    except SyntaxError as py:
        return f"syntax error at line {py.lineno}: {py.msg}; reinstall the package to get its original file"
    except ValueError as py:  # e.g. a NUL byte
        return str(py)
    return f"Python parses it but libcst does not (line {exc.raw_line}: {exc.message})"


def _parse(path: str, source: bytes) -> _File:
    try:
        text, bom = _decode(source)
    except UnicodeDecodeError as exc:
        raise _Refusal(
            Status.UNPARSEABLE, f"{path} is not Python this tool can parse: it is not UTF-8 ({exc})"
        ) from None
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        detail = f"{path} is not Python this tool can parse: {_syntax_error(text, exc)}"
        raise _Refusal(Status.UNPARSEABLE, detail) from None
    return _File(path, text, bom, module)


def transform(
    spec: Spec,
    source: bytes | Mapping[str, bytes | None],
    *,
    path: str | None = None,
    version: str | None,
    unreadable: str | None = None,
) -> Result:
    """Apply ``spec`` to its files in release ``version``.

    ``source`` maps each of the spec's paths to its bytes (None or absent: not there); a
    single-file spec may pass the bytes alone (``path`` names them, default the spec's).
    ``unreadable`` says what makes the release's version unreadable (metadata that claims a
    version but gives none that parses): a spec with a version window refuses it, one
    without lets its anchors pick the variant and says so.
    """
    if isinstance(source, bytes):
        shown = path or spec.target.path
        by_name: dict[str, tuple[str, bytes | None]] = {spec.target.files[0][0]: (shown, source)}
    else:
        shown = spec.target.path
        by_name = {name: (p, source.get(p)) for name, p in spec.target.files}
    release = f"{spec.target.distribution} {version}" if version else f"{spec.target.distribution} (version unknown)"

    def refuse(exc: _Refusal, variant: str | None = None) -> Result:
        message = f"{spec.id}: cannot patch {shown} ({release}): {exc.detail}"
        return Result(spec.id, shown, version, exc.status, message=message, anchor=exc.anchor, variant=variant)

    try:
        files = {name: _parse(p, data) for name, (p, data) in by_name.items() if data is not None}
    except _Refusal as exc:
        return refuse(exc)
    try:
        return _transform(spec, files, version, shown, unreadable)
    except _Refusal as exc:
        return refuse(exc)
    except Exception as exc:  # noqa: BLE001 - a bug in an operation must not escape as a traceback
        return refuse(_Refusal(Status.EDIT_FAILED, f"planning failed: {type(exc).__name__}: {exc}"))


def _versioned(spec: Spec) -> bool:
    """Whether the spec tells releases apart by version (a window on the target or a variant)."""
    return bool(str(spec.target.versions)) or any(str(v.versions) for v in spec.variants)


def _transform(spec: Spec, files: dict[str, _File], version: str | None, shown: str, unreadable: str | None) -> Result:
    parsed_version = parse_version(version)
    if unreadable is not None and _versioned(spec):
        windows = ", ".join(f"{v.name} {v.versions or 'any'}" for v in spec.variants)
        raise _Refusal(
            Status.UNSUPPORTED,
            f"its version cannot be read ({unreadable}), and this patch's releases are told apart by version "
            f"({spec.target.distribution} {spec.target.versions or 'any'}; variants: {windows}): its anchors alone "
            "cannot prove the variant. Reinstall the package (or fix its metadata) so that its version reads; "
            "nothing was written.",
        )

    def result(status: Status, **kw) -> Result:
        return Result(spec.id, shown, version, status, **kw)

    variants = spec.variants_for(parsed_version)
    if not variants:
        raise _Refusal(
            Status.UNSUPPORTED,
            f"this patch supports {spec.target.distribution} {spec.target.versions or 'any'} "
            f"(variants: {', '.join(f'{v.name} {v.versions}' for v in spec.variants)})",
        )

    found = set().union(*(markers_in(f.text, spec.id) for f in files.values()))
    if found:
        # an edit skipped because upstream fixed that part leaves no marker, yet is done
        for v in variants:
            done = found | {e.id for e in v.edits if _fixed_upstream(files, e)}
            if done >= {e.id for e in v.edits}:
                return result(Status.ALREADY_APPLIED, edits=sorted(found), message=f"{spec.id}: already applied")
        raise _Refusal(
            Status.PARTIALLY_APPLIED,
            f"only some of the patch's markers are present ({', '.join(sorted(found))} of "
            f"{', '.join(spec.edit_ids)}); restore the original files (reinstall the package) and apply again",
        )

    first = spec.target.files[0][0]
    for known in spec.refuse_when:
        if all(_present(files, p, first) for p in known.patterns):
            raise _Refusal(Status.UNSUPPORTED, f"it has {known.name}: {known.why} Nothing was written.")
    for fix in spec.obsolete_when:
        if all(_present(files, p, first) for p in fix.patterns):
            return result(
                Status.OBSOLETE, message=f"{spec.id}: not needed, {shown} already has the upstream fix: {fix.name}"
            )

    # A version that only one variant admits picks it; where several admit it (an unknown version, or a
    # spec whose variants have no windows, as NeMo-RL's: its version says nothing of its files' shape)
    # the first whose anchors hold is taken, whether the version is known or not: so a checkout gets
    # the same variant named with -s as through an editable install whose metadata has a version.
    # Where none holds, the refusal shown is that of the variant that came nearest (every file
    # it edits there, then the most of its edits held before one failed; the newest of equals):
    # it names the anchor that moved in the shape the files have, not one of a shape they never had.
    errors: list[_Refusal] = []
    for variant in variants:
        try:
            _admitted(variant, files, first)
            done = _apply_variant(spec, variant, files, result)
        except _Refusal as exc:
            if len(variants) == 1:
                raise _Refusal(exc.status, exc.detail, anchor=exc.anchor) from None
            errors.append(exc)
            continue
        if unreadable is not None and done.status == Status.APPLIED:
            done.unreadable = unreadable
            done.message = (
                f"{spec.id}: its version cannot be read ({unreadable}); this patch has no version window, so its "
                f"anchors alone picked the variant ({done.variant or 'the only one'})"
            )
        return done
    nearest = max(errors, key=lambda exc: exc.reached)  # max keeps the first of equals
    raise _Refusal(nearest.status, nearest.detail, anchor=nearest.anchor)


def _admitted(variant: Variant, files: dict[str, _File], first: str) -> None:
    """Refuse ``variant`` where the files have a shape its ``unless`` names (a newer release's):
    an older variant never patches a newer file, even where its anchors would hold. Such a
    refusal comes nearest of none, so where another variant was tried it is that one's shown."""
    for pattern in variant.unless:
        if _present(files, pattern, first):
            raise _Refusal(
                Status.UNSUPPORTED,
                f"variant {variant.name} is for releases without "
                f"{f'{pattern.name} ({pattern.describe()})' if pattern.name else pattern.describe()}"
                f"{f' (in {pattern.file})' if pattern.file else ''}, and this one has it. {_UPGRADE_HINT}",
                anchor=pattern.describe(),
                reached=(False, -1),
            )


def _present(files: dict[str, _File], pattern: Pattern, default: str) -> bool:
    f = files.get(pattern.file or default)
    return f is not None and present(f.module, pattern)


def _fixed_upstream(files: dict[str, _File], edit: Edit) -> bool:
    """Whether every ``skip_when`` pattern of ``edit`` holds: its part is fixed upstream."""
    return bool(edit.skip_when) and all(_present(files, p, edit.file) for p in edit.skip_when)


def _apply_variant(spec: Spec, variant: Variant, files: dict[str, _File], result) -> Result:
    changes: dict[str, list[ops.Change]] = {}
    performed: dict[str, list[str]] = {}
    skipped: list[str] = []
    has_files = all(edit.file in files for edit in variant.edits)
    for held, edit in enumerate(variant.edits):
        reached = (has_files, held)
        where = f"edit {edit.id} ({edit.op}, variant {variant.name})"
        target = files.get(edit.file)
        if target is None:
            path = spec.target.path_of(edit.file)
            raise _Refusal(
                Status.ANCHOR_MISSING,
                f"{where}: the file {path} is not there. {_UPGRADE_HINT}",
                anchor=f"file {path}",
                reached=reached,
            )
        if _fixed_upstream(files, edit):
            skipped.append(edit.id)
            continue
        try:
            changes.setdefault(edit.file, []).extend(ops.PLANNERS[edit.op].plan(target.module, edit, spec.id))
        except ops.AnchorError as exc:
            in_file = f" in {target.path}" if len(spec.target.files) > 1 else ""
            hint = "" if exc.code == Status.EDIT_FAILED else f" {_UPGRADE_HINT}"
            raise _Refusal(
                Status(exc.code),
                f"{where}{in_file}: {exc.detail}.{hint}",
                anchor=edit.anchor.describe(),
                reached=reached,
            ) from None
        except Exception as exc:  # noqa: BLE001
            raise _Refusal(
                Status.EDIT_FAILED, f"{where}: planning failed: {type(exc).__name__}: {exc}", reached=reached
            ) from None
        performed.setdefault(edit.file, []).append(edit.id)
    if not performed:
        return result(
            Status.OBSOLETE,
            variant=variant.name,
            skipped=skipped,
            message=f"{spec.id}: every part is already fixed upstream",
        )
    new_files: dict[str, bytes] = {}
    for name, file_changes in changes.items():
        f = files[name]
        try:
            new_module = ops.apply_changes(f.module, file_changes)
        except ValueError as exc:
            raise _Refusal(Status.ANCHOR_AMBIGUOUS, f"{f.path}: {exc}") from None
        new_text = new_module.code
        _check_output(new_text, spec, variant, performed[name])
        missing = undefined_names(f.text, new_text)
        if missing:
            raise _Refusal(Status.UNDEFINED_NAME, _undefined_message(spec, variant, performed[name], f.path, missing))
        new_files[f.path] = (_BOM if f.bom else b"") + new_text.encode("utf-8")
    edits = [e for names in performed.values() for e in names]
    return result(
        Status.APPLIED,
        files=new_files,
        variant=variant.name,
        edits=edits,
        skipped=skipped,
        message=f"{spec.id}: {len(edits)} edit(s) to apply",
    )


def _undefined_message(spec: Spec, variant: Variant, performed: list[str], path: str, missing: list[str]) -> str:
    """Which edit uses the name, and which edit of the spec would define it (the gate, usually)."""
    edits = {e.id: e for e in variant.edits}
    parts = []
    for name in missing:
        users = [i for i in performed if name in _names_in(edits[i].code)] or performed
        definers = [e.id for v in spec.variants for e in v.edits if name in _defined_in(e.code)]
        hint = f"; edit {definers[0]} defines it: add it to the spec" if definers else ""
        parts.append(f"edit {', '.join(dict.fromkeys(users))} uses {name!r}, which nothing in {path} defines{hint}")
    return "; ".join(parts) + " (the patched file would raise NameError); nothing was written"


def _names_in(code: str) -> set[str]:
    try:
        tree = ast.parse(code.replace("${call_args}", "_call_args"))
    except SyntaxError:
        try:
            tree = ast.parse("try:\n    pass\n" + code.strip("\n"))
        except SyntaxError:
            return set()
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


def _defined_in(code: str) -> set[str]:
    try:
        tree = ast.parse(code.replace("${call_args}", "_call_args"))
    except SyntaxError:
        return set()
    out = set()
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(stmt.name)
        elif isinstance(stmt, ast.Assign):
            out |= {t.id for t in stmt.targets if isinstance(t, ast.Name)}
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
    return out


def _check_output(text: str, spec: Spec, variant: Variant, performed: list[str]) -> None:
    """The new text must compile and carry a marker for each edit: else it is our bug."""
    compile(text, f"<{spec.id}>", "exec", dont_inherit=True)
    missing = set(performed) - markers_in(text, spec.id)
    if missing:
        raise AssertionError(f"{spec.id} ({variant.name}): markers missing after edit: {sorted(missing)}")


def unified_diff(before: bytes, after: bytes, path: str, *, labels: tuple[str, str] = ("a", "b")) -> str:
    old = before.decode("utf-8", "replace").splitlines(keepends=True)
    new = after.decode("utf-8", "replace").splitlines(keepends=True)
    return "".join(difflib.unified_diff(old, new, f"{labels[0]}/{path}", f"{labels[1]}/{path}"))
