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

from fp32patch.patcher.model import Spec, Status
from fp32patch.patcher.plan import (
    RootPlan,
    Target,
    by_root,
    entries_after,
    read,
    searched_order,
    select_specs,
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
from fp32patch.patcher.state import StateDir, sha256
from fp32patch.patcher.status import classify, missing
from fp32patch.patcher.transaction import Transaction, Write
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
            notes=["no patch target was found in the given import roots"],
        )

    # First every result, without writing: one refusal anywhere means nothing is written.
    plans = [RootPlan.build(root, group) for root, group in groups.items()]
    chains = [plan.chain([t.spec for t in plan.targets]) for plan in plans]
    # a file that already carries a patch is judged as verify judges it (drifted, unrecorded, ...)
    judged = {
        (plan.root, t.spec.id): verdict
        for plan, (results, _) in zip(plans, chains, strict=True)
        for t in plan.targets
        if results[t.spec.id].status == Status.ALREADY_APPLIED
        and (verdict := classify(plan, t, inv)).status != Status.APPLIED
    }
    refused = gone or bool(judged) or any(r.status.refused for results, _ in chains for r in results.values())
    if refused or dry_run:
        for plan, (results, _) in zip(plans, chains, strict=True):
            for t in plan.targets:
                if (plan.root, t.spec.id) in judged:
                    outcomes.append(judged[plan.root, t.spec.id])
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
        notes = ["nothing was written"] if refused else ["dry run: nothing was written"]
        return Report("apply", fold_not_installed(outcomes, order), code, notes=notes)

    notes: list[str] = []
    for finished, (plan, (results, _)) in enumerate(zip(plans, chains, strict=True)):
        try:
            done, settled = _commit(plan, results)
        except Interrupted as stop:
            return Report("apply", fold_not_installed(outcomes, order), EXIT_INTERRUPTED, [*notes, stop.note(finished)])
        outcomes += done
        notes += settled
    code = EXIT_REFUSED if any(Status(str(o.status)).refused for o in outcomes) else EXIT_OK
    return Report("apply", fold_not_installed(outcomes, order), code, notes=notes)


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


def _commit(plan: RootPlan, planned: dict[str, Result]) -> tuple[list[Outcome], list[str]]:
    """Under the root's lock: settle an interrupted run, re-read, re-plan (another process may have won), write.

    A root where the plan found nothing to write and nothing was interrupted is reported
    without taking the lock (nor creating the state folder): a read-only image that is
    already patched verifies and re-applies cleanly.
    """
    root = plan.root
    tx = Transaction(root)
    relpaths = list(plan.files)
    specs: list[Spec] = [t.spec for t in plan.targets]
    try:
        if not any(r.status == Status.APPLIED for r in planned.values()) and not tx.needs_recovery(
            plan.manifest, relpaths
        ):
            return [_reported(t, planned[t.spec.id]) for t in plan.targets], []
        tx.check_writable(relpaths, [plan.record_rel(s) for s in specs])
        with StateDir(root).lock():
            locked = RootPlan.build(root, plan.targets)
            notes = tx.recover(locked.manifest, relpaths)
            locked.reload()
            results, final = locked.chain(specs)
            if any(r.status.refused for r in results.values()):
                return [_reported(t, results[t.spec.id], refused_elsewhere=True) for t in plan.targets], notes
            writes = _writes(locked, results, final)
            if writes:
                tx.commit(writes, locked.manifest)
    except OSError as exc:  # TransactionError included: the root cannot be written as planned
        raise write_error(root, exc) from None
    except KeyboardInterrupt:
        raise Interrupted(root, tx.progress) from None
    return [_reported(t, results[t.spec.id]) for t in plan.targets], notes


def _reported(t: Target, r: Result, *, refused_elsewhere: bool = False) -> Outcome:
    if r.status == Status.APPLIED:
        if refused_elsewhere:
            return t.outcome(Status.NOT_APPLIED, message="another patch in this root was refused")
        # edits skipped because upstream already fixed their part, so a partial fix shows
        details = {"edits": r.edits, **({"skipped": r.skipped} if r.skipped else {})}
        return t.outcome(Status.APPLIED, message=r.message, variant=r.variant, details=details)
    return t.outcome(r.status, message=r.message, variant=r.variant)
