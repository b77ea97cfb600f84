"""``revert``: put back the exact original bytes, from the manifest and the kept originals.

A revert needs no spec: the manifest says which files a patch changed and the hash of
each file's original, and the original bytes are kept by hash. So a patch applied with
``--specs`` is reverted without them. Where other patches share a file with the one being
reverted, their edits are computed again from the original (their specs are needed then),
so the file ends as if only they had been applied. A file changed since it was patched is
refused unless ``--force``, which keeps the changed bytes in the state folder.

A file that carries a patch's markers with no record of it (``unrecorded``: the state
folder stayed behind) is never answered "ok": ``--against`` the installed release (a wheel,
an sdist or a folder, read as ``check`` reads it) restores its stock bytes when the specs
applied to them give exactly today's bytes; otherwise the revert refuses and names the way
back. ``--against`` also stands in for a kept original that is missing or altered, when
the release's file has the recorded sha256.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from fp32patch.patcher import manifest as mf
from fp32patch.patcher import nearby, unrecorded
from fp32patch.patcher.candidate import CandidateError, Found, found_in
from fp32patch.patcher.locate import LocateError, inside
from fp32patch.patcher.model import Spec, Status
from fp32patch.patcher.plan import (
    RootPlan,
    Target,
    entries_after,
    entry_outcome,
    load_manifest,
    read,
    select_specs,
    settle,
    targets,
    write_error,
)
from fp32patch.patcher.plan import (
    roots as find_roots,
)
from fp32patch.patcher.report import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
    Interrupted,
    Invocation,
    Outcome,
    Report,
    UsageError,
)
from fp32patch.patcher.spec import load_specs
from fp32patch.patcher.state import StateDir, sha256
from fp32patch.patcher.status import gone_message
from fp32patch.patcher.transaction import (
    Transaction,
    TransactionError,
    Write,
    commit_all,
    describe_os_error,
    locked,
)


class _Refused(Exception):
    def __init__(self, status: Status, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Stock:
    """The installed release's own files, from ``--against``: by path, and per spec for proving them."""

    label: str
    found: list[Found]

    @classmethod
    def read(cls, against: Path | None, specs: Sequence[Spec]) -> Stock | None:
        if against is None:
            return None
        try:
            found, _ = found_in(against, specs)
        except (CandidateError, LocateError) as exc:
            raise UsageError(f"--against {exc}") from None
        return cls(str(against), found)

    def file(self, path: str, digest: str) -> bytes | None:
        """The release's bytes of ``path``, if they hash to ``digest``."""
        for f in self.found:
            data = (f.data or {}).get(path)
            if data is not None and sha256(data) == digest:
                return data
        return None


def revert(
    ids: Sequence[str],
    roots: Sequence[Path],
    *,
    force: bool = False,
    spec_dir: Path | None = None,
    envs: Sequence[Path] = (),
    against: Path | None = None,
) -> Report:
    """Restore the original bytes of every file the selected patches changed (sha256-checked)."""
    inv = Invocation(tuple(roots), tuple(envs), spec_dir, tuple(ids))
    specs = {s.id: s for s in _loaded(spec_dir)}
    found = _state_roots(list(specs.values()), roots, envs)
    # an id no loaded spec defines is fine when a manifest here records it (revert needs no spec)
    recorded = {e.patch for root in found for e in load_manifest(root).entries}
    if any(i not in specs and i not in recorded for i in ids):
        select_specs(ids, spec_dir)  # raises the UsageError that names them
    stock = Stock.read(against, list(specs.values()))
    outcomes: list[Outcome] = []
    notes: list[str] = []
    refused = False
    # First each root read without its lock: one with nothing to revert is answered there; an unrecorded
    # refusal is answered there only where the root cannot be locked to read it again.
    every = [_Root(root, env, ts, ids, specs, force, inv, stock) for root, (env, ts) in found.items()]
    work: list[_Root] = []
    for r in every:
        answer = r.without_lock()
        if answer is None:
            work.append(r)
            continue
        r.outcomes = answer[0]
        notes += answer[1]
        refused |= answer[2]
    # Then, under the lock of every root that reverts, each judged again, and all roots written or none.
    mine = [r for r in work if r.writable()]
    try:
        with locked(r.root for r in mine):
            for r in work:
                if r in mine:
                    r.prepare()
                else:
                    r.refuse_unwritable()
                notes += r.notes
                refused |= r.refused
            outcomes = [o for r in every for o in r.outcomes]  # in the order the roots were given
            if refused:
                for o in outcomes:
                    if o.status == Status.REVERTED:  # planned, not written: it is still what it was
                        o.status = o.details.pop("was", Status.APPLIED)
                        o.message = "not reverted: a file in this run was refused"
            else:
                unwritable = next((r for r in work if r not in mine), None)
                if unwritable is not None:
                    raise write_error(unwritable.root, unwritable.why, inv, len(found))
                runs = [(r.tx, r.writes, r.manifest) for r in mine if r.writes]
                for (tx, _, _), displaced in zip(runs, commit_all(runs), strict=True):
                    next(r for r in mine if r.tx is tx).displaced(displaced)
    except OSError as exc:
        failed = next((r for r in mine if r.tx.progress not in ("undone", "done", "none")), None)
        raise write_error((failed or (mine or work)[0]).root, exc, inv, len(found)) from None
    except KeyboardInterrupt:
        outcomes = [o for r in every for o in r.outcomes]
        failed = next((r for r in mine if r.tx.progress not in ("undone", "done")), None)
        where = failed.root if failed else work[0].root if work else Path(".")
        stop = Interrupted(where, failed.tx.progress if failed else "none", inv)
        return Report("revert", outcomes, EXIT_INTERRUPTED, notes=[*notes, stop.note(0)])
    for o in outcomes:
        o.details.pop("was", None)
    if not outcomes:
        advice = nearby.advise(roots, envs, list(specs.values()), inv, "revert")  # a root one level off?
        return Report("revert", [], EXIT_OK, notes=[*notes, "nothing to revert: no patched target found", *advice])
    if refused:
        notes.append("nothing was written: a revert changes every import root of its run, or none")
        if any(o.status == Status.DRIFTED for o in outcomes):
            notes.append("--force reverts a drifted file (its bytes are kept)")
        if any(o.status == Status.UNRECORDED for o in outcomes):
            notes.append(
                "an unrecorded file is restored only from its release's own bytes (--against), never by --force"
            )
    return Report("revert", outcomes, EXIT_REFUSED if refused else EXIT_OK, notes=notes)


def _against_hint(stock: Stock | None) -> str:
    if stock is not None:
        return f"; {stock.label} does not hold a file with the recorded sha256 either"
    return "; `--against WHEEL|SDIST|DIR` (the installed release) restores it from the release's own file"


def _loaded(spec_dir: Path | None) -> list[Spec]:
    try:
        return load_specs(spec_dir)
    except Exception as exc:  # noqa: BLE001 - SpecError: bad input
        raise UsageError(str(exc)) from None


def _state_roots(
    specs: list[Spec], roots: Sequence[Path], envs: Sequence[Path]
) -> dict[Path, tuple[Path | None, list[Target]]]:
    """Every root that may hold state: each searched root, and where each found spec's files live (a checkout
    reached from several environments once)."""
    out: dict[Path, tuple[Path | None, list[Target]]] = {}
    for root, env in find_roots(roots, envs):
        out.setdefault(root, (env, []))
    for t in targets(specs, roots, envs):
        if t.located is not None:
            out.setdefault(t.located.root, (t.env, []))[1].append(t)
    return out


def _outcome(root: Path, env: Path | None, t: Target | None, entry: mf.Entry, status: Status, message: str) -> Outcome:
    return t.outcome(status, message=message) if t is not None else entry_outcome(root, env, entry, status, message)


class _Root:
    """One import root of a revert: read without the lock, then planned under it, then committed with the rest."""

    def __init__(self, root, env, ts, ids, specs, force, inv, stock):
        self.root, self.env, self.ts, self.specs, self.force, self.inv, self.stock = (
            root,
            env,
            ts,
            specs,
            force,
            inv,
            stock,
        )
        self.ids = list(ids)
        self.state = StateDir(root)
        self.tx = Transaction(root)
        self.by_id = {t.spec.id: t for t in ts}
        self.relpaths = [p for t in ts for p in t.spec.target.paths]
        self.outcomes: list[Outcome] = []
        self.notes: list[str] = []
        self.refused = False
        self.writes: list[Write] = []
        self.manifest = mf.Manifest()
        self.displaced_for: dict[str, set[str]] = {}
        self.why: OSError | None = None
        self.early: tuple[list[Outcome], list[str], bool] | None = None

    def _wanted(self, manifest: mf.Manifest) -> list[str]:
        by_entry = dict.fromkeys(e.patch for e in manifest.entries)
        return self.ids or list({**by_entry, **{t.spec.id: None for t in self.ts}})

    def _loose(self, manifest: mf.Manifest) -> tuple[RootPlan, list[Target], set[str]]:
        recorded = {e.patch for e in manifest.entries}
        # an interrupted run's entries wait in its intents until the run is settled
        found = RootPlan.build(self.root, self.ts, manifest)
        held = recorded | {e.patch for i in manifest.intents for e in i.previous}
        return found, _unrecorded(found, self._wanted(manifest), held), recorded

    def _judge_loose(self, found: RootPlan, loose: list[Target], recorded: set[str], wanted: list[str]):
        """The unrecorded patches' verdicts; a refusal holds the others of the root too."""
        if self.stock is None:
            judged = [unrecorded.verdict(found, t, self.inv, {"recorded": False}) for t in loose]
        else:
            judged, _ = _restore(found, loose, wanted, self.stock, self.inv)
        if not any(o.status == Status.UNRECORDED for o in judged):
            return None
        held = "not reverted: another file in this root was refused"
        for o in judged:
            if o.status == Status.REVERTED:
                o.status, o.message = Status.UNRECORDED, held
        others = [
            self.by_id[i].outcome(Status.APPLIED, message=held) for i in wanted if i in recorded and i in self.by_id
        ]
        return judged + others

    def without_lock(self) -> tuple[list[Outcome], list[str], bool] | None:
        """The answer for a root with nothing to revert (None: it needs its lock)."""
        peek = load_manifest(self.root)
        wanted = self._wanted(peek)
        found, loose, recorded = self._loose(peek)
        if loose:
            self.early = self._judge_loose(found, loose, recorded, wanted)
            if self.early is not None:
                self.early = (self.early, [], True)
                return None  # confirmed under the lock when the root can be locked
        if not (recorded & set(wanted)) and not loose and not self.tx.needs_recovery(peek, self.relpaths):
            notes = []
            if not recorded and os.path.isdir(self.state.path):  # a state folder with nothing of ours: a run cut short
                with contextlib.suppress(OSError), self.state.lock():
                    if not self.tx.needs_recovery(load_manifest(self.root), self.relpaths):
                        self.state.touch()  # releasing the lock tidies it away
                if not os.path.lexists(self.state.path):
                    notes.append(
                        f"removed {self.state.path}: an interrupted fp32patch run left it, with nothing recorded in it"
                    )
            why = (
                "no fp32patch record in this root"
                if not self.state.exists()
                else "not recorded as patched in this root"
            )
            return (
                [self.by_id[i].outcome(Status.NOT_APPLIED, message=why) for i in wanted if i in self.by_id],
                notes,
                False,
            )
        return None

    def writable(self) -> bool:
        peek = load_manifest(self.root)
        ours = [e.path for e in peek.entries if inside(self.root, self.root / e.path)]
        try:
            self.tx.check_writable(self.relpaths + ours, [e.record for e in peek.entries])
        except OSError as exc:
            self.why = exc
            return False
        return True

    def refuse_unwritable(self) -> None:
        """A root that cannot be locked: its refusal read without the lock stands (else the run fails, exit 2)."""
        if self.early is not None:
            self.outcomes, self.notes, self.refused = self.early
            return
        why = f"not reverted: cannot write in {self.root}: {describe_os_error(self.why) if self.why else ''}"
        peek = load_manifest(self.root)
        self.outcomes = [
            self.by_id[i].outcome(Status.APPLIED, message=why) for i in self._wanted(peek) if i in self.by_id
        ]

    def prepare(self) -> None:
        """Under the lock: settle an interrupted run, then judge and plan every file of this root."""
        self.notes = settle(self.tx, self.relpaths, self.inv)
        manifest = self.manifest = load_manifest(self.root)
        wanted = self._wanted(manifest)
        found, loose, recorded = self._loose(manifest)
        if loose:
            judged = self._judge_loose(found, loose, recorded, wanted)
            if judged is not None:
                self.state.untouch()  # refused: what the state folder holds stays
                self.outcomes, self.refused = judged, True
                return
        skip = {t.spec.id for t in loose}
        outcomes, writes, self.displaced_for = _plan(
            self.root,
            self.env,
            manifest,
            [i for i in wanted if i not in skip],
            self.by_id,
            self.specs,
            self.force,
            self.state,
            self.inv,
            self.stock,
        )
        if loose and self.stock is not None:
            more, restores = _restore(RootPlan.build(self.root, self.ts, manifest), loose, wanted, self.stock, self.inv)
            for o in more:
                o.details["was"] = Status.UNRECORDED
            outcomes += more
            writes += [w for w in restores if w.relpath not in {x.relpath for x in writes}]
        for o in outcomes:
            if o.status == Status.REVERTED and o.details.get("forced"):
                o.details["was"] = Status.DRIFTED
        self.outcomes, self.writes = outcomes, writes
        self.refused = any(o.status in (Status.DRIFTED, Status.ERROR, Status.UNRECORDED) for o in outcomes)

    def displaced(self, paths: list[Path]) -> None:
        for o in self.outcomes:
            mine = [
                p
                for w, p in zip([w for w in self.writes if w.displace], paths, strict=True)
                if w.relpath in self.displaced_for.get(o.patch, ())
            ]
            if mine:
                o.details["displaced"] = [str(p) for p in mine]
                o.message += f"; the changed file is kept at {', '.join(map(str, mine))}"


def _unrecorded(plan: RootPlan, wanted: list[str], recorded: set[str]) -> list[Target]:
    """The wanted patches whose files carry their markers while the manifest has no entry of theirs."""
    return [
        t for t in plan.targets if t.spec.id in wanted and t.spec.id not in recorded and unrecorded.marked(plan, t.spec)
    ]


def _restore(
    plan: RootPlan, loose: list[Target], wanted: list[str], stock: Stock, inv: Invocation
) -> tuple[list[Outcome], list[Write]]:
    """Each unrecorded patch's files back to the release's own bytes, where those are proved stock."""
    outcomes: list[Outcome] = []
    writes: dict[str, Write] = {}
    for t in loose:
        chain, files = unrecorded.chain_of(plan, t.spec, inv.spec_dir)
        others = [s.id for s in chain if s.id not in wanted]
        if others:
            message = (
                f"{', '.join(others)} also patches {t.spec.target.path} with no record: revert them together "
                f"(`{inv.command('revert', '--against', stock.label, patch=None)}` without --patch)"
            )
            outcomes.append(t.outcome(Status.UNRECORDED, message=message))
            continue
        restored = unrecorded.stock_bytes(plan, t, chain, files, stock.found, stock.label)
        if isinstance(restored, str):
            message = f"{restored}; nothing was written. To restore the stock file, {unrecorded.way_back(t, inv)}"
            outcomes.append(t.outcome(Status.UNRECORDED, message=message))
            continue
        record = plan.record_rel(t.spec)
        for path, data in restored.items():
            writes.setdefault(path, Write(path, files[path] or b"", data, [], record=record))
        dist = t.located.distribution if t.located else None
        release = f"{dist.name} {dist.version}" if dist else "release"
        message = (
            f"restored the stock bytes of {release} from {stock.label} (this patch applied to them gives today's "
            "bytes exactly)"
        )
        outcomes.append(t.outcome(Status.REVERTED, message=message))
    return outcomes, list(writes.values())


def _plan(
    root: Path,
    env: Path | None,
    manifest: mf.Manifest,
    wanted: list[str],
    by_id: dict[str, Target],
    specs: dict[str, Spec],
    force: bool,
    state: StateDir,
    inv: Invocation,
    stock: Stock | None = None,
) -> tuple[list[Outcome], list[Write], dict[str, set[str]]]:
    selected = [i for i in wanted if any(e.patch == i for e in manifest.entries)]
    outcomes = [
        by_id[i].outcome(Status.NOT_APPLIED, message="not recorded as patched in this root")
        for i in wanted
        if i not in selected and i in by_id
    ]
    if not selected:
        return outcomes, [], {}
    # the files to rewrite: those of the selected patches, and of every patch sharing one of them
    paths = {e.path for e in manifest.entries if e.patch in selected}
    while True:
        keep = {e.patch for e in manifest.entries if e.path in paths and e.patch not in selected}
        more = {e.path for e in manifest.entries if e.patch in keep} - paths
        if not more:
            break
        paths |= more
    # an entry whose path leads out of the root (a tampered manifest) is never read or written
    paths = {p for p in paths if inside(root, root / p)}
    files = {p: read(root / p) for p in sorted(paths)}
    missing = [k for k in keep if k not in specs]
    if missing:
        entry = next(e for e in manifest.entries if e.patch in selected)
        message = (
            f"cannot revert {', '.join(selected)} alone: {', '.join(missing)} also patches "
            f"{', '.join(sorted({e.path for e in manifest.entries if e.patch in missing} & paths))} and its spec is "
            f"not loaded; run `{inv.command('revert')}` to revert every patch here, or load its spec with --specs"
        )
        return outcomes + [_outcome(root, env, by_id.get(i), entry, Status.ERROR, message) for i in selected], [], {}

    verdicts: dict[str, tuple[Status, str, bool]] = {}
    originals: dict[str, bytes | None] = {}
    gone = {p for p, data in files.items() if data is None}
    drifted: dict[str, list[str]] = {}  # patch -> its files changed since (named in its row)
    for path, data in files.items():
        on = manifest.on(path)
        lead = on[0]
        current = sha256(data) if data is not None else None
        if path in gone:  # deleted since it was patched: nothing to restore, and nothing is claimed
            originals[path] = None
            for e in on:
                if not force:
                    verdicts[e.patch] = (Status.DRIFTED, gone_message(root, [path], e.patch, inv), False)
            continue
        if current == lead.sha256_before:
            originals[path] = data
            continue
        try:
            originals[path] = state.original(lead.sha256_before)
        except TransactionError as exc:
            release = stock.file(path, lead.sha256_before) if stock else None
            if release is None:
                for e in on:
                    verdicts[e.patch] = (Status.ERROR, f"cannot revert: {exc.strerror}{_against_hint(stock)}", False)
                continue
            originals[path] = release  # the release's own file has the recorded sha256
        if current != lead.sha256_after:
            for e in on:
                if force:
                    verdicts.setdefault(e.patch, (Status.REVERTED, "", True))
                else:
                    msg = (
                        f"{root / path} changed since it was patched (sha256 {(current or 'missing')[:12]}, recorded "
                        f"{lead.sha256_after[:12]}); `{inv.command('revert', '--force', patch=e.patch)}` restores the "
                        "original and keeps the changed file in the state folder"
                    )
                    before = verdicts.get(e.patch)
                    if before and before[0] == Status.DRIFTED:  # another file of the same patch
                        msg = f"{before[1]}; {msg}"
                    verdicts[e.patch] = (Status.DRIFTED, msg, False)
                    drifted.setdefault(e.patch, []).append(str(root / path))

    # the patches that stay, run again from the originals
    plan = RootPlan(root, [by_id.get(k) or Target(specs[k], root, None) for k in keep], manifest)
    plan.files = dict(files)
    staying = [s for s in specs.values() if s.id in keep]
    start = dict(originals)
    for spec in staying:  # a file of theirs that no entry names (nothing to change there) is read as it is
        for p in spec.target.paths:
            if p not in start:
                start[p] = read(root / p)
    results, final = plan.chain(staying, start=start) if staying else ({}, start)
    for k, r in results.items():
        if r.status != Status.APPLIED:
            for i in selected:
                verdicts[i] = (Status.ERROR, f"cannot keep {k} while reverting {i}: {r.message or r.status}", False)

    writes: list[Write] = []
    displaced_for: dict[str, set[str]] = {}
    for path, data in files.items():
        if path in gone:  # only its record goes
            writes.append(Write(path, None, None, [], record=None))
            continue
        after = final.get(path)
        if data is None or after is None:
            continue
        lead = manifest.on(path)[0]
        entries = entries_after([e for e in manifest.on(path) if e.patch in keep], lead.sha256_before, after)
        forced = sha256(data) not in (lead.sha256_after, lead.sha256_before)
        record = next((e.record for e in manifest.on(path) if e.record), None)
        back = after == originals[path]  # the original again: its RECORD row as it was found
        row = lead.record_row if back else None
        writes.append(Write(path, data, after, [] if back else entries, record=record, displace=forced, record_row=row))
        if forced:
            for e in manifest.on(path):
                displaced_for.setdefault(e.patch, set()).add(path)
    for i in selected:
        entry = next(e for e in manifest.entries if e.patch == i)
        status, message, forced = verdicts.get(i, (Status.REVERTED, "", False))
        if status == Status.REVERTED:
            mine = [e for e in manifest.entries if e.patch == i]
            lost = [e.path for e in mine if e.path in gone]
            if lost and all(e.path in gone for e in mine):
                status = Status.NOT_APPLIED
                message = f"{', '.join(str(root / p) for p in lost)} is gone (deleted after patching): nothing to restore; record cleared"
            elif all(sha256(files[e.path] or b"") == e.sha256_before for e in mine if e.path in files):
                status, message = Status.NOT_APPLIED, "already the original bytes; record cleared"
            elif keep & {e.patch for e in manifest.entries if e.path in {m.path for m in mine}}:
                others = sorted(keep & {e.patch for e in manifest.entries if e.path in {m.path for m in mine}})
                message = (
                    f"removed its edits (sha256 of the original {entry.sha256_before[:12]}); kept {', '.join(others)}"
                )
            else:
                message = f"restored the original bytes (sha256 {entry.sha256_before[:12]})"
            if lost and status == Status.REVERTED:
                message += (
                    f"; {', '.join(str(root / p) for p in lost)} is gone (deleted after patching): record cleared"
                )
        out = _outcome(root, env, by_id.get(i), entry, status, message)
        out.details["forced"] = forced
        if status == Status.DRIFTED and i in drifted:
            out.details["drifted"] = drifted[i]
        outcomes.append(out)
    return outcomes, writes, displaced_for
