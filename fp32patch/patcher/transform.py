"""One spec x one source text -> a result. Pure: bytes in, bytes out, never the disk.

The result is ``applied`` (new bytes), ``already-applied`` (every edit's marker is there),
``obsolete`` (an upstream fix is recognised), or an error: ``anchor-missing``,
``anchor-ambiguous``, ``unsupported-version``, ``unparseable``, ``partially-applied``.
New text is re-parsed and compiled before it is returned, and the file keeps its form:
encoding declaration, byte-order mark, line endings, indentation and final newline.
"""

from __future__ import annotations

import ast
import difflib
import io
import tokenize
from dataclasses import dataclass, field

import libcst as cst
from packaging.version import Version

from fp32patch.patcher import ops
from fp32patch.patcher.match import present
from fp32patch.patcher.spec import Edit, Spec, Variant

APPLIED = "applied"
ALREADY_APPLIED = "already-applied"
OBSOLETE = "obsolete"
ERRORS = ("anchor-missing", "anchor-ambiguous", "unsupported-version", "unparseable", "partially-applied")

_BOM = b"\xef\xbb\xbf"


@dataclass
class Result:
    spec_id: str
    path: str
    version: str | None
    status: str
    new: bytes | None = None  # for "applied"
    variant: str | None = None
    message: str = ""
    edits: list[str] = field(default_factory=list)  # edits performed
    skipped: list[str] = field(default_factory=list)  # edits already fixed upstream
    anchor: str | None = None  # the anchor an error is about

    @property
    def ok(self) -> bool:
        return self.status not in ERRORS


def markers_in(text: str, spec_id: str) -> set[str]:
    """The edits of ``spec_id`` whose marker comment is in ``text``.

    Only real comments on a line of their own count: marker-like text inside a string
    (a docstring quoting a marker, say) must not make an unpatched file read as patched.
    Text that does not tokenize (a broken file) is searched line by line instead.
    """
    try:
        lines = [
            tok.line
            for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type == tokenize.COMMENT and not tok.line[: tok.start[1]].strip()
        ]
    except (tokenize.TokenError, SyntaxError):
        lines = [text]
    return {m["edit"] for line in lines for m in ops.MARKER_RE.finditer(line) if m["spec"] == spec_id}


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


def transform(spec: Spec, source: bytes, *, path: str, version: str | None) -> Result:
    """Apply ``spec`` to ``source`` (the bytes of ``path`` in release ``version``)."""
    from fp32patch.patcher.spec import parse_version

    parsed_version = parse_version(version)

    def result(status: str, **kw) -> Result:
        return Result(spec_id=spec.id, path=path, version=version, status=status, **kw)

    def refuse(status: str, detail: str, *, anchor: str | None = None, variant: str | None = None) -> Result:
        release = (
            f"{spec.target.distribution} {version}" if version else f"{spec.target.distribution} (version unknown)"
        )
        message = f"{spec.id}: cannot patch {path} ({release}): {detail}"
        return result(status, message=message, anchor=anchor, variant=variant)

    try:
        text, bom = _decode(source)
    except UnicodeDecodeError as exc:
        return refuse("unparseable", f"the file is not Python this tool can parse: it is not UTF-8 ({exc})")
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        return refuse("unparseable", f"the file is not Python this tool can parse: {_syntax_error(text, exc)}")

    variants = spec.variants_for(parsed_version)
    if not variants:
        return refuse(
            "unsupported-version",
            f"this patch supports {spec.target.distribution} {spec.target.versions or 'any'} "
            f"(variants: {', '.join(f'{v.name} {v.versions}' for v in spec.variants)})",
        )

    found = markers_in(text, spec.id)
    if found:
        wanted = set(spec.edit_ids)
        # an edit skipped because upstream fixed that part leaves no marker, yet is done
        if found >= wanted or any(
            found | {e.id for e in v.edits if _fixed_upstream(module, e)} >= {e.id for e in v.edits} for v in variants
        ):
            return result(ALREADY_APPLIED, edits=sorted(found), message=f"{spec.id}: already applied to {path}")
        return refuse(
            "partially-applied",
            f"only some of the patch's markers are present ({', '.join(sorted(found))} of "
            f"{', '.join(spec.edit_ids)}); restore the original file (reinstall the package) and apply again",
        )

    for fix in spec.obsolete_when:
        if all(present(module, p) for p in fix.patterns):
            return result(OBSOLETE, message=f"{spec.id}: not needed, {path} already has the upstream fix: {fix.name}")

    # A known version picks its variant; an unknown one takes the first whose anchors hold.
    errors: list[Result] = []
    for variant in variants:
        outcome = _apply_variant(spec, variant, module, result, refuse)
        if outcome.ok or parsed_version is not None:
            if outcome.status == APPLIED:
                assert outcome.new is not None
                outcome.new = (_BOM if bom else b"") + outcome.new
            return outcome
        errors.append(outcome)
    return errors[0]


def _fixed_upstream(module: cst.Module, edit: Edit) -> bool:
    """Whether every ``skip_when`` pattern of ``edit`` holds: its part is fixed upstream."""
    return bool(edit.skip_when) and all(present(module, p) for p in edit.skip_when)


def _apply_variant(spec: Spec, variant: Variant, module: cst.Module, result, refuse) -> Result:
    changes: list[ops.Change] = []
    performed, skipped = [], []
    for edit in variant.edits:
        if _fixed_upstream(module, edit):
            skipped.append(edit.id)
            continue
        try:
            changes += ops.OPERATIONS[edit.op].plan(module, edit, spec.id)
        except ops.AnchorError as exc:
            hint = (
                "The installed release changed the code this patch anchors on. Run "
                "`fp32patch check --against <its wheel>` and look for an fp32patch release with a "
                "matching spec; nothing was written."
            )
            return refuse(
                exc.code,
                f"edit {edit.id} ({edit.op}, variant {variant.name}): {exc.detail}. {hint}",
                anchor=edit.anchor.describe(),
                variant=variant.name,
            )
        performed.append(edit.id)
    if not performed:
        return result(
            OBSOLETE, variant=variant.name, skipped=skipped, message=f"{spec.id}: every part is already fixed upstream"
        )
    try:
        new_module = ops.apply_changes(module, changes)
    except ValueError as exc:
        return refuse("anchor-ambiguous", str(exc), variant=variant.name)
    new_text = new_module.code
    _check_output(new_text, spec, variant, performed)
    return result(
        APPLIED,
        new=new_text.encode("utf-8"),
        variant=variant.name,
        edits=performed,
        skipped=skipped,
        message=f"{spec.id}: {len(performed)} edit(s) to apply",
    )


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


def version_label(version: Version | None) -> str:
    return str(version) if version is not None else "unknown"
