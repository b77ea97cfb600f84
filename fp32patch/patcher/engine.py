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
from fp32patch.patcher.transaction import (
    StateDir,
    Transaction,
    TransactionError,
    Write,
    describe_os_error,
    sha256,
)
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
    env: str | None = None  # the environment (from --envs) this root belongs to

    def to_json(self) -> dict:
        out = {
            "id": self.patch,
            "status": self.status,
            "target": self.target,
            "version": self.version,
            "path": self.path,
            "root": self.root,
        }
        if self.env:
            out["env"] = self.env
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
    extra: dict = field(default_factory=dict)  # more top-level JSON fields (check: the candidate)

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK

    def by_root(self) -> list[dict]:
        """Per import root, how many patches have each status (roots in the order reported)."""
        roots: dict[str, dict] = {}
        for o in self.outcomes:
            # a not-installed line folded over several roots names them joined by os.pathsep
            for root in o.root.split(os.pathsep) if o.status == NOT_INSTALLED else [o.root]:
                row = roots.setdefault(root, {"root": root, **({"env": o.env} if o.env else {}), "statuses": {}})
                row["statuses"][o.status] = row["statuses"].get(o.status, 0) + 1
        return list(roots.values())

    def to_json(self) -> dict:
        data = {"ok": self.ok, "command": self.command, **self.extra, "patches": [o.to_json() for o in self.outcomes]}
        data["roots"] = self.by_root()
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


def _roots(roots: Sequence[Path], envs: Sequence[Path] = ()) -> list[tuple[Path, Path | None]]:
    """Each import root to work on, with the environment it was found in (``--envs``), once each.

    ``-s`` roots come first, as given; then the site-packages of every environment under
    each ``--envs`` folder. Without either, the running interpreter's site-packages.
    """
    from fp32patch.patcher.envs import find_environments
    from fp32patch.patcher.locate import default_roots

    pairs: list[tuple[Path, Path | None]] = [(Path(r), None) for r in roots or ([] if envs else default_roots())]
    for folder in envs:
        folder = Path(folder).absolute()
        if not folder.is_dir():
            raise UsageError(f"--envs {folder}: {'does not exist' if not folder.exists() else 'is not a folder'}")
        found = find_environments(folder)
        if not any(sps for _, sps in found):
            raise UsageError(
                f"--envs {folder}: no Python environment under it (a folder with pyvenv.cfg or conda-meta/ "
                "and lib/python3.*/site-packages)"
            )
        pairs += [(sp, env) for env, sps in found for sp in sps]
    out: dict[Path, Path | None] = {}
    for root, env in pairs:
        try:
            resolved = check_root(root)
        except LocateError as exc:
            raise UsageError(str(exc)) from None
        if resolved not in out or env is not None:
            out[resolved] = env if env is not None else out.get(resolved)
    return list(out.items())


@dataclass
class _Target:
    spec: Spec
    searched: Path
    located: Located | None
    env: Path | None = None


def _targets(specs: Sequence[Spec], roots: Sequence[Path], envs: Sequence[Path] = ()) -> list[_Target]:
    out = []
    for root, env in _roots(roots, envs):
        for spec in specs:
            try:
                out.append(_Target(spec, root, locate(spec, root), env))
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
        env=str(t.env) if t.env else None,
        **kw,
    )


def _by_root(targets: Sequence[_Target]) -> dict[Path, list[_Target]]:
    """Located targets grouped by the root their file is in (where its state and lock live)."""
    groups: dict[Path, list[_Target]] = {}
    for t in targets:
        if t.located is not None:
            groups.setdefault(t.located.root, []).append(t)
    return groups


def _load_manifest(root: Path) -> mf.Manifest:
    try:
        return StateDir(root).load()
    except mf.ManifestError as exc:
        raise UsageError(
            f"{exc}. Move the state folder {root / mf.STATE_DIR} aside to start over "
            "(files patched under it then read as drifted or not-applied)"
        ) from None


_RESULTS: dict[tuple, Result] = {}


def _transform(t: _Target, data: bytes) -> Result:
    """``transform`` for a located target, once per distinct (spec, bytes, path, version).

    transform is pure, so many environments holding the same release (and apply's plan and
    locked phases) share one result.
    """
    loc = t.located
    assert loc is not None
    key = (t.spec.id, t.spec.sha256, sha256(data), loc.relpath, loc.version)
    if key not in _RESULTS:
        if len(_RESULTS) >= 64:
            _RESULTS.clear()
        _RESULTS[key] = transform(t.spec, data, path=loc.relpath, version=loc.version)
    return _RESULTS[key]


def _write_error(root: Path, exc: OSError) -> UsageError:
    """A root that cannot be written is bad input: exit 2, with what and where."""
    text = exc.strerror if isinstance(exc, TransactionError) else describe_os_error(exc)
    return UsageError(f"cannot write in {root}: {text}; nothing was changed")


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


# ---------------------------------------------------------------- status


def _classify(t: _Target, data: bytes, manifest: mf.Manifest) -> Outcome:
    """The verify/status verdict for one located target: the file's bytes decide.

    An entry left ``pending``/``reverting`` by an interrupted run reads like any other (its
    hashes say which side of the replace the file is on), with a note that the next apply or
    revert settles what may lag behind (RECORD row, bytecode, the manifest itself).
    """
    outcome = _classify_bytes(t, data, manifest)
    assert t.located is not None
    entry = manifest.find(t.spec.id, t.located.relpath)
    if entry is not None and entry.state != mf.APPLIED:
        what = "apply" if entry.state == mf.PENDING else "revert"
        note = f"an fp32patch {what} was interrupted here; the next apply or revert settles it"
        outcome.message = f"{outcome.message}; {note}" if outcome.message else note
        outcome.details["interrupted"] = entry.state
    return outcome


def _classify_bytes(t: _Target, data: bytes, manifest: mf.Manifest) -> Outcome:
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
    result = _transform(t, data)
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
    ids: Sequence[str],
    roots: Sequence[Path],
    *,
    spec_dir: Path | None = None,
    command: str = "status",
    envs: Sequence[Path] = (),
) -> Report:
    """Each patch's state in each root. ``verify`` fails (exit 1) unless all are good."""
    specs = select_specs(ids, spec_dir)
    outcomes: list[Outcome] = []
    manifests: dict[Path, mf.Manifest] = {}
    targets = _targets(specs, roots, envs)
    for t in targets:
        if t.located is None:
            outcomes.append(_outcome(t, NOT_INSTALLED, message=f"{_label(t.spec)} is not in {t.searched}"))
            continue
        root = t.located.root
        if root not in manifests:
            manifests[root] = _load_manifest(root)
        outcomes.append(_classify(t, _read(t.located.path), manifests[root]))
    outcomes = _fold_not_installed(outcomes, targets)
    # An interrupted entry fails verify even where the bytes are patched: its RECORD row or
    # bytecode may still lag behind until the next apply or revert settles it. An environment
    # found by --envs may lack the target (a trainer env without vLLM): that is not a failure.
    bad = [
        o
        for o in outcomes
        if o.status not in VERIFY_OK
        or (ids and o.status == NOT_INSTALLED and not o.env)
        or o.details.get("interrupted")
    ]
    if all(o.status == NOT_INSTALLED for o in outcomes):
        bad = outcomes  # nothing found anywhere is a problem, not a pass
    code = EXIT_VERIFY if (command == "verify" and bad) else EXIT_OK
    return Report(command, outcomes, code)


def _fold_not_installed(outcomes: list[Outcome], targets: Sequence[_Target]) -> list[Outcome]:
    """A patch found in some root need not be listed as missing from the others.

    Environments found by --envs are each reported for every patch found in any of them (the
    report is per root), in the order the roots were given (``-s`` first, then each environment
    in path order); a patch found nowhere is one line, as for ``-s``.
    """
    order = {str(t.searched): i for i, t in reversed(list(enumerate(targets)))}
    outcomes = sorted(outcomes, key=lambda o: order.get(o.root, len(order)))
    found = {o.patch for o in outcomes if o.status != NOT_INSTALLED}
    kept, missing = [], {}
    for o in outcomes:
        if o.status != NOT_INSTALLED or (o.env and o.patch in found):
            kept.append(o)
        elif o.patch not in found and o.patch not in missing:
            missing[o.patch] = o
        elif o.patch in missing:
            missing[o.patch].root += os.pathsep + o.root
            missing[o.patch].env = None  # several roots now, not one environment
    return kept + list(missing.values())


# ---------------------------------------------------------------- apply


def _record_rel(t: _Target) -> str | None:
    """The RECORD kept in step with the target: its distribution's, when inside the root."""
    loc = t.located
    assert loc is not None
    record = loc.distribution.record if loc.distribution else None
    if record is not None and record.is_relative_to(loc.root):
        return record.relative_to(loc.root).as_posix()
    return None


def _entry(t: _Target, result: Result, before: bytes) -> mf.Entry:
    loc = t.located
    assert loc is not None and result.new is not None
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
        record=_record_rel(t),
        applied_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    )


def apply(
    ids: Sequence[str],
    roots: Sequence[Path],
    *,
    dry_run: bool = False,
    spec_dir: Path | None = None,
    envs: Sequence[Path] = (),
) -> Report:
    specs = select_specs(ids, spec_dir)
    targets = _targets(specs, roots, envs)
    by_root = _by_root(targets)
    outcomes = [
        _outcome(t, NOT_INSTALLED, message=f"{_label(t.spec)} is not in {t.searched}")
        for t in targets
        if t.located is None
    ]
    if not by_root:
        outcomes = _fold_not_installed(outcomes, targets)
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
            result = _transform(t, data)
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
        return Report("apply", _fold_not_installed(outcomes, targets), code, notes=notes)

    notes: list[str] = []
    for root, results in planned:
        done, settled = _commit_apply(root, results)
        outcomes += done
        notes += settled
    code = EXIT_REFUSED if any(o.status in ERRORS for o in outcomes) else EXIT_OK
    return Report("apply", _fold_not_installed(outcomes, targets), code, notes=notes)


def _commit_apply(root: Path, planned: list[tuple[_Target, Result, bytes]]) -> tuple[list[Outcome], list[str]]:
    """Under the root's lock: settle an interrupted run, re-read, re-transform (another process may have won), write.

    A root where the plan found nothing to write and nothing was interrupted is reported
    without taking the lock (nor creating the state folder): a read-only image that is
    already patched verifies and re-applies cleanly.
    """
    state = StateDir(root)
    tx = Transaction(root)
    group = [t for t, _, _ in planned]
    relpaths = [t.located.relpath for t in group if t.located is not None]
    try:
        if not any(r.status == "applied" for _, r, _ in planned) and not tx.needs_recovery(
            _load_manifest(root), relpaths
        ):
            return [_outcome(t, r.status, message=r.message, variant=r.variant) for t, r, _ in planned], []
        tx.check_writable(relpaths, [_record_rel(t) for t in group])
        with state.lock():
            manifest = _load_manifest(root)
            notes = tx.recover(manifest, relpaths)
            outcomes: list[Outcome] = []
            writes: list[Write] = []
            pending: list[tuple[_Target, Result]] = []
            for t in group:
                loc = t.located
                assert loc is not None
                data = _read(loc.path)
                result = _transform(t, data)
                if result.status == "applied":
                    entry = _entry(t, result, data)
                    writes.append(Write(loc.relpath, data, result.new or b"", entry, record=entry.record))
                    pending.append((t, result))
                else:
                    outcomes.append(_outcome(t, result.status, message=result.message, variant=result.variant))
            if any(o.status in ERRORS for o in outcomes):
                return outcomes + [
                    _outcome(t, "not-applied", message="another patch in this root was refused") for t, _ in pending
                ], notes
            if writes:
                tx.commit(writes, manifest)
    except OSError as exc:  # TransactionError included: the root cannot be written as planned
        raise _write_error(root, exc) from None
    for t, result in pending:
        # edits skipped because upstream already fixed their part, so a partial fix shows
        details = {"edits": result.edits, **({"skipped": result.skipped} if result.skipped else {})}
        outcomes.append(_outcome(t, "applied", message=result.message, variant=result.variant, details=details))
    return outcomes, notes


# ---------------------------------------------------------------- revert


def revert(
    ids: Sequence[str],
    roots: Sequence[Path],
    *,
    force: bool = False,
    spec_dir: Path | None = None,
    envs: Sequence[Path] = (),
) -> Report:
    """Put back the exact original bytes of every patched file (sha256-checked)."""
    specs = select_specs(ids, spec_dir)
    every = _targets(specs, roots, envs)
    by_root = _by_root(every)
    outcomes: list[Outcome] = []
    notes: list[str] = []
    refused = False
    for root, group in by_root.items():
        state = StateDir(root)
        peek = _load_manifest(root)
        recorded = [t for t in group if t.located and peek.find(t.spec.id, t.located.relpath)]
        tx = Transaction(root)
        relpaths = [t.located.relpath for t in group if t.located is not None]
        if not recorded and not tx.needs_recovery(peek, relpaths):
            why = "no fp32patch record in this root" if not state.exists() else "not recorded as patched in this root"
            outcomes += [_outcome(t, NOT_APPLIED, message=why) for t in group]
            continue
        try:
            tx.check_writable(relpaths, [e.record for e in peek.entries])
            with state.lock():
                manifest = _load_manifest(root)
                notes += tx.recover(manifest, relpaths)
                writes: list[Write] = []
                done: list[Outcome] = []
                for t in group:
                    out, write = _plan_revert(t, manifest, state, force)
                    done.append(out)
                    if write is not None:
                        writes.append(write)
                if any(o.status in ("drifted", "error") for o in done):
                    # all of this root or none of it; other roots are reverted on their own
                    refused = True
                    for o in done:
                        if o.status == "reverted":  # planned, not written: it is still what it was
                            o.status = DRIFTED if o.details.get("forced") else APPLIED
                            o.message = "not reverted: another file in this root was refused"
                    outcomes += done
                    continue
                displaced = tx.commit(writes, manifest) if writes else []
                for out in done:
                    if displaced and out.status == "reverted" and out.details.get("forced"):
                        out.details["displaced"] = [str(p) for p in displaced]
                        out.message += f"; the changed file is kept at {', '.join(map(str, displaced))}"
                outcomes += done
        except OSError as exc:
            raise _write_error(root, exc) from None
    if not outcomes:
        return Report("revert", [], EXIT_OK, notes=["nothing to revert: no patched target found"])
    code = EXIT_REFUSED if refused else EXIT_OK
    if refused:
        notes.append(
            "nothing was written in a root with a refusal; --force reverts a drifted file (its bytes are kept)"
        )
    return Report("revert", _fold_not_installed(outcomes, every), code, notes=notes)


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


def diff(
    ids: Sequence[str], roots: Sequence[Path], *, spec_dir: Path | None = None, envs: Sequence[Path] = ()
) -> Report:
    """For each installed target: the patch's change (original -> patched) as a unified diff."""
    specs = select_specs(ids, spec_dir)
    outcomes = []
    refused = False
    targets = _targets(specs, roots, envs)
    manifests = {root: _load_manifest(root) for root in _by_root(targets)}  # read once per root
    for t in targets:
        if t.located is None:
            outcomes.append(_outcome(t, NOT_INSTALLED))
            continue
        loc = t.located
        data = _read(loc.path)
        entry = manifests[loc.root].find(t.spec.id, loc.relpath)
        if entry is not None and sha256(data) != entry.sha256_before:
            try:
                original = StateDir(loc.root).original(entry.sha256_before)
            except TransactionError as exc:
                raise UsageError(str(exc.strerror)) from None
            status = APPLIED if sha256(data) == entry.sha256_after else DRIFTED
            outcomes.append(_outcome(t, status, diff=unified_diff(original, data, loc.relpath)))
            continue
        result = _transform(t, data)
        if result.status == "applied":
            outcomes.append(
                _outcome(
                    t, NOT_APPLIED, variant=result.variant, diff=unified_diff(data, result.new or b"", loc.relpath)
                )
            )
        else:
            refused |= result.status in ERRORS
            outcomes.append(_outcome(t, result.status, message=result.message))
    return Report("diff", _fold_not_installed(outcomes, targets), EXIT_REFUSED if refused else EXIT_OK)


def spec_table(spec_dir: Path | None = None) -> list[Spec]:
    try:
        return load_specs(spec_dir)
    except SpecError as exc:
        raise UsageError(str(exc)) from None
