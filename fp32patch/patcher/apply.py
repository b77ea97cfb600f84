"""``apply``: every patch's change computed first, then all of a root's files written, or none.

Specs on one file form one chain (the second sees the first's edits) and the file is
written once. A refusal anywhere (an anchor missing or ambiguous, an unsupported release,
a name nothing defines, ...) means nothing is written anywhere. So does a file that
already carries a patch but that ``verify`` would not pass: changed after patching
(``drifted``), patched with no record of it (``unrecorded``), by an earlier spec
(``outdated``), or with its kept original lost. The writes re-read and
re-plan under each root's lock, since another process may have patched in between.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fp32patch.patcher import manifest as mf
from fp32patch.patcher import nearby
from fp32patch.patcher.model import Status
from fp32patch.patcher.plan import (
    RootPlan,
    Target,
    by_root,
    entries_after,
    read,
    searched_order,
    select_specs,
    settle,
    targets,
    write_error,
)
from fp32patch.patcher.record import row_of
from fp32patch.patcher.report import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_USAGE,
    Interrupted,
    Invocation,
    Outcome,
    Report,
    fold_not_installed,
)
from fp32patch.patcher.state import sha256
from fp32patch.patcher.status import classify, missing
from fp32patch.patcher.transaction import Transaction, Write, commit_all, locked
from fp32patch.patcher.transform import Result, unified_diff


def _diffs(before: dict[str, bytes | None], after: dict[str, bytes | None], paths: list[str]) -> str:
    return "".join(
        unified_diff(before.get(p) or b"", after[p] or b"", p)
        for p in paths
        if after.get(p) is not None and after[p] != before.get(p)
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
    ts = targets(specs, roots, envs)
    groups = by_root(ts)
    inv = Invocation(tuple(roots), tuple(envs), spec_dir, tuple(ids))
    manifests: dict = {}
    outcomes = [missing(t, inv, manifests) for t in ts if t.located is None]
    gone = any(o.status == Status.DRIFTED for o in outcomes)  # a recorded file deleted since: verify fails it
    order = searched_order(ts)
    if not groups and not gone:
        return Report(
            "apply",
            fold_not_installed(outcomes, order),
            EXIT_USAGE,
            notes=nearby.advise(roots, envs, specs, inv, "apply", ["--dry-run"] if dry_run else [])
            or ["no patch target was found in the given import roots"],
        )

    # First every result, without writing: one refusal anywhere means nothing is written.
    plans = [RootPlan.build(root, group) for root, group in groups.items()]
    judged = [_judge(plan, inv) for plan in plans]
    refused = gone or any(_refused(j) for j in judged)
    if dry_run or (refused and not any(_lockable(plan) for plan, j in zip(plans, judged, strict=True) if _refused(j))):
        return _without_writing(outcomes, plans, judged, refused, dry_run, order)
    busy = [
        (plan, j)
        for plan, j in zip(plans, judged, strict=True)
        if _refused(j)
        or any(r.status == Status.APPLIED for r in j[0].values())
        or Transaction(plan.root).needs_recovery(plan.manifest, list(plan.files))
    ]
    if not busy:  # every root patched already and settled: no lock, no state folder (a read-only image)
        return Report("apply", fold_not_installed(outcomes + _reported_all(plans, judged), order), EXIT_OK)

    # Then, under the lock of every root that writes (or was refused: a racing run may have caused it),
    # the judgement again, and the writes of every root, or none.
    unwritable: dict[Path, OSError] = {}
    mine: list[Path] = []
    for plan, _ in busy:
        try:
            Transaction(plan.root).check_writable(list(plan.files), [plan.record_rel(t.spec) for t in plan.targets])
            mine.append(plan.root)
        except OSError as exc:  # a refused root that cannot be locked keeps the verdict read without it
            unwritable[plan.root] = exc
    notes: list[str] = []
    runs: list[tuple[Transaction, list[Write], mf.Manifest]] = []
    try:
        with locked(mine):
            for i, plan in enumerate(plans):
                if plan.root in mine:
                    notes += settle(Transaction(plan.root), list(plan.files), inv)
                    plans[i] = RootPlan.build(plan.root, plan.targets)
                    judged[i] = _judge(plans[i], inv)
            if gone or any(_refused(j) for j in judged):
                return _without_writing(outcomes, plans, judged, True, False, order, notes)
            for root, exc in unwritable.items():
                raise write_error(root, exc, inv, len(plans))
            for plan, (results, final, _) in zip(plans, judged, strict=True):
                writes = _writes(plan, results, final)
                if writes:
                    runs.append((Transaction(plan.root), writes, plan.manifest))
            commit_all(runs)
    except OSError as exc:  # TransactionError included: a root cannot be written as planned
        raise write_error(_failed(runs, plans[0].root), exc, inv, len(plans)) from None
    except KeyboardInterrupt:
        failed = next((tx for tx, _, _ in runs if tx.progress not in ("undone", "done")), None)
        stop = Interrupted(failed.root if failed else plans[0].root, failed.progress if failed else "none", inv)
        return Report("apply", fold_not_installed(outcomes, order), EXIT_INTERRUPTED, [*notes, stop.note(0)])
    reported = _reported_all(plans, judged)
    notes += [o.message for o in reported if o.status == Status.APPLIED and o.details.get("version_unreadable")]
    return Report("apply", fold_not_installed(outcomes + reported, order), EXIT_OK, notes=notes)


def _failed(runs: list[tuple[Transaction, list[Write], mf.Manifest]], default: Path) -> Path:
    """The root whose write failed (every root committed before it is undone)."""
    return next((tx.root for tx, _, _ in runs if tx.progress not in ("undone", "done")), default)


Judged = tuple[dict[str, Result], dict[str, bytes | None], dict[str, Outcome]]


def _judge(plan: RootPlan, inv: Invocation) -> Judged:
    """Each patch's result on the root's bytes, and the verdict on a file that already carries a patch
    (judged as verify judges it: drifted, unrecorded, outdated, original-lost)."""
    results, final = plan.chain([t.spec for t in plan.targets])
    verdicts = {
        t.spec.id: verdict
        for t in plan.targets
        if results[t.spec.id].status == Status.ALREADY_APPLIED
        and (verdict := classify(plan, t, inv)).status != Status.APPLIED
    }
    return results, final, verdicts


def _refused(j: Judged) -> bool:
    return bool(j[2]) or any(r.status.refused for r in j[0].values())


def _lockable(plan: RootPlan) -> bool:
    try:
        Transaction(plan.root).check_writable(list(plan.files))
    except OSError:
        return False
    return True


def _without_writing(
    outcomes: list[Outcome],
    plans: list[RootPlan],
    judged: list[Judged],
    refused: bool,
    dry_run: bool,
    order: list[str],
    notes: Sequence[str] = (),
) -> Report:
    outcomes = list(outcomes)
    for plan, (results, _, verdicts) in zip(plans, judged, strict=True):
        for t in plan.targets:
            if t.spec.id in verdicts:
                outcomes.append(verdicts[t.spec.id])
                continue
            r = results[t.spec.id]
            status: Status = r.status
            diff = None
            if r.status == Status.APPLIED:
                status = Status.WOULD_APPLY if not refused else Status.NOT_APPLIED
                before = {p: plan.files.get(p) for p in t.spec.target.paths}
                diff = _diffs(before, {p: r.files.get(p, before[p]) for p in before}, t.spec.target.paths)
            outcomes.append(t.outcome(status, message=r.message, variant=r.variant, diff=diff))
    code = EXIT_REFUSED if refused else EXIT_OK
    said = ["nothing was written"] if refused else ["dry run: nothing was written"]
    return Report("apply", fold_not_installed(outcomes, order), code, notes=[*notes, *said])


def _reported_all(plans: list[RootPlan], judged: list[Judged]) -> list[Outcome]:
    return [_reported(t, j[0][t.spec.id]) for plan, j in zip(plans, judged, strict=True) for t in plan.targets]


def _writes(plan: RootPlan, results: dict[str, Result], final: dict[str, bytes | None]) -> list[Write]:
    """One write per changed file: its new bytes and every patch's entry on it."""
    writes: list[Write] = []
    specs = {t.spec.id: t.spec for t in plan.targets}
    for path, after in final.items():
        before = plan.files.get(path)
        if after is None or before is None or after == before:
            continue
        old = plan.manifest.on(path)
        record = next((plan.record_rel(s) for s in specs.values() if path in s.target.paths), None)
        if old and sha256(before) == old[0].sha256_after:
            original, keep = old[0].sha256_before, None  # patched by us already: its original is kept
            row = old[0].record_row
        else:
            original, keep, old = sha256(before), before, []
            found = read(plan.root / record) if record else None
            row = row_of(found, path) if found is not None else None  # given back as is by revert
        applied_here = [
            specs[i] for i, r in results.items() if r.status == Status.APPLIED and path in r.files and i in specs
        ]
        mine = {s.id for s in applied_here}
        entries = entries_after([e for e in old if e.patch not in mine], original, after)
        entries += [plan.entry(s, path, original, after, results[s.id].variant) for s in applied_here]
        for e in entries:
            e.record_row = row
        record = next((e.record for e in entries if e.record), None)
        writes.append(Write(path, before, after, entries, keep=keep, record=record))
    return writes


def _reported(t: Target, r: Result, *, refused_elsewhere: bool = False) -> Outcome:
    if r.status == Status.APPLIED:
        if refused_elsewhere:
            return t.outcome(Status.NOT_APPLIED, message="another patch in this root was refused")
        # edits skipped because upstream already fixed their part, so a partial fix shows
        details = {"edits": r.edits, **({"skipped": r.skipped} if r.skipped else {})}
        if r.unreadable:
            details["version_unreadable"] = r.unreadable
        return t.outcome(Status.APPLIED, message=r.message, variant=r.variant, details=details)
    return t.outcome(r.status, message=r.message, variant=r.variant)
