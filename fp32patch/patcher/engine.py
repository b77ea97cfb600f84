"""What each CLI command does, as functions that return reports (the CLI only renders).

Data flows one way: locate -> spec -> transform (pure) -> transaction (writes) -> manifest.
Every command first resolves all its targets and computes every result; ``apply`` and
``revert`` write only when nothing was refused, and then all of a root's files or none.
"""

from __future__ import annotations

import datetime as _dt
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fp32patch.patcher import manifest as mf
from fp32patch.patcher.locate import Located, LocateError, check_root, locate
from fp32patch.patcher.spec import Spec, SpecError, load_specs
from fp32patch.patcher.transaction import StateDir, Transaction, TransactionError, Write, sha256
from fp32patch.patcher.transform import ERRORS, Result, markers_in, transform, unified_diff

# statuses of verify/status
APPLIED, NOT_APPLIED, DRIFTED, OUTDATED = "applied", "not-applied", "drifted", "outdated"
OBSOLETE, NOT_INSTALLED, UNSUPPORTED = "obsolete", "not-installed", "unsupported-version"
VERIFY_OK = {APPLIED, OBSOLETE, NOT_INSTALLED}

EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3


class UsageError(ValueError):
    """Bad usage or bad input: exit 2, nothing written."""


@dataclass
class Outcome:
    """One patch in one import root: what was found or done."""

    patch: str
    status: str
    root: str
    target: str  # "<distribution>:<path in root>"
    version: str | None = None
    path: str | None = None  # absolute path of the file, when installed
    message: str = ""
    variant: str | None = None
    diff: str | None = None
    details: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {
            "id": self.patch,
            "status": self.status,
            "target": self.target,
            "version": self.version,
            "path": self.path,
            "root": self.root,
        }
        if self.variant:
            out["variant"] = self.variant
        if self.message:
            out["message"] = self.message
        out.update(self.details)
        return out


@dataclass
class Report:
    command: str
    outcomes: list[Outcome]
    exit_code: int
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK

    def to_json(self) -> dict:
        data = {"ok": self.ok, "command": self.command, "patches": [o.to_json() for o in self.outcomes]}
        if self.notes:
            data["notes"] = self.notes
        return data


# ---------------------------------------------------------------- selection


def select_specs(ids: Sequence[str], spec_dir: Path | None = None) -> list[Spec]:
    specs = load_specs(spec_dir)
    if not ids:
        return specs
    known = {s.id: s for s in specs}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise UsageError(f"unknown patch id {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
    return [known[i] for i in dict.fromkeys(ids)]


def _roots(roots: Sequence[Path]) -> list[Path]:
    from fp32patch.patcher.locate import default_roots

    out: list[Path] = []
    for root in roots or default_roots():
        try:
            resolved = check_root(Path(root))
        except LocateError as exc:
            raise UsageError(str(exc)) from None
        if resolved not in out:
            out.append(resolved)
    return out


@dataclass
class _Target:
    spec: Spec
    searched: Path
    located: Located | None


def _targets(specs: Sequence[Spec], roots: Sequence[Path]) -> list[_Target]:
    out = []
    for root in _roots(roots):
        for spec in specs:
            try:
                out.append(_Target(spec, root, locate(spec, root)))
            except LocateError as exc:
                raise UsageError(str(exc)) from None
    return out


def _label(spec: Spec) -> str:
    return f"{spec.target.distribution}:{spec.target.path}"


def _outcome(t: _Target, status: str, **kw) -> Outcome:
    loc = t.located
    return Outcome(
        patch=t.spec.id,
        status=status,
        root=str(t.searched),
        target=_label(t.spec),
        version=loc.version if loc else None,
        path=str(loc.path) if loc else None,
        **kw,
    )


def _load_manifest(root: Path) -> mf.Manifest:
    try:
        return StateDir(root).load()
    except mf.ManifestError as exc:
        raise UsageError(
            f"{exc}. Move the state folder {root / mf.STATE_DIR} aside to start over "
            "(files patched under it then read as drifted or not-applied)"
        ) from None


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


# ---------------------------------------------------------------- status


def _classify(t: _Target, data: bytes, manifest: mf.Manifest) -> Outcome:
    """The verify/status verdict for one located target."""
    loc = t.located
    assert loc is not None
    entry = manifest.find(t.spec.id, loc.relpath)
    current = sha256(data)
    details: dict = {"sha256": current, "recorded": entry is not None}
    if entry is not None:
        details.update(sha256_before=entry.sha256_before, sha256_after=entry.sha256_after)
        if current == entry.sha256_after:
            if entry.spec_sha256 != t.spec.sha256:
                return _outcome(
                    t,
                    OUTDATED,
                    variant=entry.variant,
                    details=details,
                    message=f"applied by an older spec (fp32patch {entry.tool_version}); run `fp32patch revert` then `fp32patch apply`",
                )
            return _outcome(t, APPLIED, variant=entry.variant, details=details)
        if current != entry.sha256_before and markers_in(data.decode("utf-8", "replace"), t.spec.id):
            return _outcome(
                t,
                DRIFTED,
                variant=entry.variant,
                details=details,
                message=f"{loc.path} changed after it was patched (sha256 {current[:12]}, recorded {entry.sha256_after[:12]})",
            )
    result = transform(t.spec, data, path=loc.relpath, version=loc.version)
    if result.status == "already-applied":
        note = "applied, but no record of it in this root's manifest: hashes cannot be checked"
        return _outcome(t, APPLIED, details=details, message=note)
    if result.status == "obsolete":
        return _outcome(t, OBSOLETE, details=details, message=result.message)
    if result.status == "unsupported-version":
        return _outcome(t, UNSUPPORTED, details=details, message=result.message)
    if result.status == "partially-applied":
        return _outcome(t, DRIFTED, details=details, message=result.message)
    message = "" if result.ok else f"and it cannot be applied: {result.message}"
    if entry is not None and current != entry.sha256_before:
        message = f"the file was replaced since it was patched (reinstalled or upgraded?) {message}".strip()
    details["applicable"] = result.ok
    return _outcome(t, NOT_APPLIED, details=details, message=message)


def status(
    ids: Sequence[str], roots: Sequence[Path], *, spec_dir: Path | None = None, command: str = "status"
) -> Report:
    """Each patch's state in each root. ``verify`` fails (exit 1) unless all are good."""
    specs = select_specs(ids, spec_dir)
    outcomes: list[Outcome] = []
    manifests: dict[Path, mf.Manifest] = {}
    for t in _targets(specs, roots):
        if t.located is None:
            outcomes.append(_outcome(t, NOT_INSTALLED, message=f"{_label(t.spec)} is not in {t.searched}"))
            continue
        root = t.located.root
        if root not in manifests:
            manifests[root] = _load_manifest(root)
        outcomes.append(_classify(t, _read(t.located.path), manifests[root]))
    outcomes = _fold_not_installed(outcomes)
    bad = [o for o in outcomes if o.status not in VERIFY_OK or (ids and o.status == NOT_INSTALLED)]
    if all(o.status == NOT_INSTALLED for o in outcomes):
        bad = outcomes  # nothing found anywhere is a problem, not a pass
    code = EXIT_VERIFY if (command == "verify" and bad) else EXIT_OK
    return Report(command, outcomes, code)


def _fold_not_installed(outcomes: list[Outcome]) -> list[Outcome]:
    """A patch found in some root need not be listed as missing from the others."""
    found = {o.patch for o in outcomes if o.status != NOT_INSTALLED}
    kept, missing = [], {}
    for o in outcomes:
        if o.status != NOT_INSTALLED:
            kept.append(o)
        elif o.patch not in found and o.patch not in missing:
            missing[o.patch] = o
        elif o.patch in missing:
            missing[o.patch].root += os.pathsep + o.root
    return kept + list(missing.values())


# ---------------------------------------------------------------- apply


def _entry(t: _Target, result: Result, before: bytes, mode: int) -> mf.Entry:
    loc = t.located
    assert loc is not None and result.new is not None
    record = loc.distribution.record if loc.distribution else None
    record_rel = None
    if record is not None and _within(loc.root, record):
        record_rel = record.relative_to(loc.root).as_posix()
    return mf.Entry(
        patch=t.spec.id,
        path=loc.relpath,
        spec_sha256=t.spec.sha256,
        distribution=t.spec.target.distribution,
        version=loc.version,
        variant=result.variant,
        sha256_before=sha256(before),
        sha256_after=sha256(result.new),
        mode=os.stat(loc.path).st_mode & 0o7777,
        record=record_rel,
        applied_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def _within(root: Path, path: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def apply(ids: Sequence[str], roots: Sequence[Path], *, dry_run: bool = False, spec_dir: Path | None = None) -> Report:
    specs = select_specs(ids, spec_dir)
    targets = _targets(specs, roots)
    by_root: dict[Path, list[_Target]] = {}
    outcomes: list[Outcome] = []
    for t in targets:
        if t.located is None:
            outcomes.append(_outcome(t, NOT_INSTALLED, message=f"{_label(t.spec)} is not in {t.searched}"))
        else:
            by_root.setdefault(t.located.root, []).append(t)
    if not by_root:
        outcomes = _fold_not_installed(outcomes)
        return Report("apply", outcomes, EXIT_USAGE, notes=["no patch target was found in the given import roots"])

    planned: list[tuple[Path, list[tuple[_Target, Result, bytes]]]] = []
    refused = False
    # First every result, without writing: one refusal anywhere means nothing is written.
    # The writes re-read and re-transform under each root's lock (another process may
    # have patched in between).
    for root, group in by_root.items():
        results = []
        for t in group:
            assert t.located is not None
            data = _read(t.located.path)
            result = transform(t.spec, data, path=t.located.relpath, version=t.located.version)
            results.append((t, result, data))
            refused |= result.status in ERRORS
        planned.append((root, results))

    if refused or dry_run:
        for _, results in planned:
            for t, result, data in results:
                status = result.status
                diff = None
                if result.status == "applied":
                    status = "would-apply" if not refused else "not-applied"
                    diff = unified_diff(data, result.new or b"", t.located.relpath if t.located else "")
                outcomes.append(_outcome(t, status, message=result.message, variant=result.variant, diff=diff))
        code = EXIT_REFUSED if refused else EXIT_OK
        notes = ["nothing was written"] if refused else ["dry run: nothing was written"]
        return Report("apply", _fold_not_installed(outcomes), code, notes=notes)

    for root, _ in planned:
        outcomes += _commit_apply(root, [t for t in by_root[root]])
    code = EXIT_REFUSED if any(o.status in ERRORS for o in outcomes) else EXIT_OK
    return Report("apply", _fold_not_installed(outcomes), code)


def _commit_apply(root: Path, group: list[_Target]) -> list[Outcome]:
    """Under the root's lock: re-read, re-transform (another process may have won), write."""
    state = StateDir(root)
    outcomes: list[Outcome] = []
    try:
        with state.lock():
            manifest = _load_manifest(root)
            writes: list[Write] = []
            pending: list[tuple[_Target, Result]] = []
            for t in group:
                loc = t.located
                assert loc is not None
                data = _read(loc.path)
                result = transform(t.spec, data, path=loc.relpath, version=loc.version)
                if result.status == "applied":
                    entry = _entry(t, result, data, 0)
                    writes.append(Write(loc.relpath, data, result.new or b"", entry, record=entry.record))
                    pending.append((t, result))
                else:
                    outcomes.append(_outcome(t, result.status, message=result.message, variant=result.variant))
            if any(o.status in ERRORS for o in outcomes):
                return outcomes + [
                    _outcome(t, "not-applied", message="another patch in this root was refused") for t, _ in pending
                ]
            Transaction(root).commit(writes, manifest)
    except TransactionError as exc:
        raise UsageError(f"nothing was changed in {root}: {exc.strerror or exc}") from None
    except PermissionError as exc:
        raise UsageError(f"cannot write in {root}: {exc.strerror} ({exc.filename}); nothing was changed") from None
    for t, result in pending:
        # edits skipped because upstream already fixed their part, so a partial fix shows
        details = {"edits": result.edits, **({"skipped": result.skipped} if result.skipped else {})}
        outcomes.append(_outcome(t, "applied", message=result.message, variant=result.variant, details=details))
    return outcomes


# ---------------------------------------------------------------- revert


def revert(ids: Sequence[str], roots: Sequence[Path], *, force: bool = False, spec_dir: Path | None = None) -> Report:
    """Put back the exact original bytes of every patched file (sha256-checked)."""
    specs = select_specs(ids, spec_dir)
    targets = [t for t in _targets(specs, roots) if t.located is not None]
    by_root: dict[Path, list[_Target]] = {}
    for t in targets:
        assert t.located is not None
        by_root.setdefault(t.located.root, []).append(t)
    outcomes: list[Outcome] = []
    refused = False
    plans = []
    for root, group in by_root.items():
        state = StateDir(root)
        if not state.exists():
            outcomes += [_outcome(t, NOT_APPLIED, message="no fp32patch record in this root") for t in group]
            continue
        plans.append((root, group))
    for root, group in plans:
        state = StateDir(root)
        try:
            with state.lock():
                manifest = _load_manifest(root)
                writes: list[Write] = []
                done: list[Outcome] = []
                for t in group:
                    out, write = _plan_revert(t, manifest, state, force)
                    refused |= out.status in ("drifted", "error")
                    done.append(out)
                    if write is not None:
                        writes.append(write)
                if refused:
                    outcomes += done
                    continue
                displaced = (
                    Transaction(root).commit([w for w in writes if w.after != w.before], manifest) if writes else []
                )
                if any(w.after == w.before for w in writes):
                    for w in writes:
                        if w.after == w.before and w.drop:
                            manifest.drop(*w.drop)
                    state.save(manifest)
                for out in done:
                    if displaced and out.status == "reverted" and out.details.get("forced"):
                        out.details["displaced"] = [str(p) for p in displaced]
                        out.message += f"; the changed file is kept at {', '.join(map(str, displaced))}"
                outcomes += done
        except TransactionError as exc:
            raise UsageError(f"nothing was changed in {root}: {exc.strerror or exc}") from None
    if not outcomes:
        return Report("revert", [], EXIT_OK, notes=["nothing to revert: no patched target found"])
    code = EXIT_REFUSED if refused else EXIT_OK
    notes = (
        ["nothing was written in a root with a refusal; --force reverts a drifted file (its bytes are kept)"]
        if refused
        else []
    )
    return Report("revert", outcomes, code, notes=notes)


def _plan_revert(t: _Target, manifest: mf.Manifest, state: StateDir, force: bool) -> tuple[Outcome, Write | None]:
    loc = t.located
    assert loc is not None
    entry = manifest.find(t.spec.id, loc.relpath)
    if entry is None:
        return _outcome(t, NOT_APPLIED, message="not recorded as patched in this root"), None
    data = _read(loc.path)
    current = sha256(data)
    drop = (entry.patch, entry.path)
    if current == entry.sha256_before:
        return _outcome(t, NOT_APPLIED, message="already the original bytes; record cleared"), Write(
            loc.relpath, data, data, None, drop=drop
        )
    forced = current != entry.sha256_after
    if forced and not force:
        msg = (
            f"{loc.path} changed since it was patched (sha256 {current[:12]}, recorded {entry.sha256_after[:12]}); "
            "revert --force restores the original and keeps the changed file in the state folder"
        )
        return _outcome(t, DRIFTED, message=msg), None
    try:
        original = state.original(entry.sha256_before)
    except TransactionError as exc:
        return _outcome(t, "error", message=f"cannot revert: {exc.strerror}"), None
    out = _outcome(t, "reverted", message=f"restored the original bytes (sha256 {entry.sha256_before[:12]})")
    out.details["forced"] = forced
    return out, Write(loc.relpath, data, original, None, drop=drop, record=entry.record, displace=forced)


# ---------------------------------------------------------------- diff


def diff(ids: Sequence[str], roots: Sequence[Path], *, spec_dir: Path | None = None) -> Report:
    """For each installed target: the patch's change (original -> patched) as a unified diff."""
    specs = select_specs(ids, spec_dir)
    outcomes = []
    refused = False
    for t in _targets(specs, roots):
        if t.located is None:
            outcomes.append(_outcome(t, NOT_INSTALLED))
            continue
        loc = t.located
        data = _read(loc.path)
        manifest = _load_manifest(loc.root)
        entry = manifest.find(t.spec.id, loc.relpath)
        if entry is not None and sha256(data) != entry.sha256_before:
            try:
                original = StateDir(loc.root).original(entry.sha256_before)
            except TransactionError as exc:
                raise UsageError(str(exc.strerror)) from None
            status = APPLIED if sha256(data) == entry.sha256_after else DRIFTED
            outcomes.append(_outcome(t, status, diff=unified_diff(original, data, loc.relpath)))
            continue
        result = transform(t.spec, data, path=loc.relpath, version=loc.version)
        if result.status == "applied":
            outcomes.append(
                _outcome(
                    t, NOT_APPLIED, variant=result.variant, diff=unified_diff(data, result.new or b"", loc.relpath)
                )
            )
        else:
            refused |= result.status in ERRORS
            outcomes.append(_outcome(t, result.status, message=result.message))
    return Report("diff", _fold_not_installed(outcomes), EXIT_REFUSED if refused else EXIT_OK)


def spec_table(spec_dir: Path | None = None) -> list[Spec]:
    try:
        return load_specs(spec_dir)
    except SpecError as exc:
        raise UsageError(str(exc)) from None
