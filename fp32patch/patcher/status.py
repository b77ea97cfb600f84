"""``verify`` and ``status``: each patch's state in each import root, from the files' bytes.

A patch whose files hash as the manifest recorded is decided without parsing anything;
only a file that is not recorded (or no longer matches) is run through ``transform`` to
tell ``not-applied`` from ``obsolete``, ``already-applied`` and the rest. Manifest entries
whose spec is not loaded are reported too (``spec-not-loaded``), never skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fp32patch.patcher import manifest as mf
from fp32patch.patcher import nearby, unrecorded
from fp32patch.patcher.markers import markers_in
from fp32patch.patcher.model import VERIFY_OK, Status
from fp32patch.patcher.plan import (
    RootPlan,
    Target,
    by_root,
    entry_outcome,
    load_manifest,
    searched_order,
    select_specs,
    targets,
)
from fp32patch.patcher.report import (
    EXIT_OK,
    EXIT_VERIFY,
    Invocation,
    Outcome,
    Report,
    fold_not_installed,
    why_verify_failed,
)
from fp32patch.patcher.state import StateDir, sha256
from fp32patch.patcher.transaction import TransactionError


def _interrupted(plan: RootPlan, t: Target) -> str | None:
    """ "pending"/"reverting" when a killed run left a write of this patch's files in flight."""
    for path in t.spec.target.paths:
        intent = plan.manifest.intent(path)
        if intent is not None:
            return "pending" if plan.manifest.find(t.spec.id, path) else "reverting"
        entry = plan.manifest.find(t.spec.id, path)
        if entry is not None and entry.state != mf.APPLIED:
            return entry.state
    return None


def classify(plan: RootPlan, t: Target, inv: Invocation) -> Outcome:
    """The verify/status verdict for one found patch: its files' bytes decide.

    An entry left by an interrupted run reads like any other (its hashes say which side of
    the replace the file is on), with a note that the next apply or revert settles what may
    lag behind (RECORD row, bytecode, the manifest itself).
    """
    outcome = _classify(plan, t, inv)
    state = _interrupted(plan, t)
    if state is not None:
        what = "apply" if state == "pending" else "revert"
        note = (
            f"an fp32patch {what} was interrupted here; `{inv.command('apply')}` or `{inv.command('revert')}` "
            "settles it"
        )
        outcome.message = f"{outcome.message}; {note}" if outcome.message else note
        outcome.details["interrupted"] = state
    return outcome


def _entry(plan: RootPlan, spec_id: str, path: str) -> mf.Entry | None:
    """The patch's entry for a file as its bytes stand: a write still in flight that has not
    replaced the file yet leaves the entry it had before."""
    intent = plan.manifest.intent(path)
    data = plan.files.get(path)
    if intent is not None and data is not None and sha256(data) == intent.sha256_from != intent.sha256_to:
        return next((e for e in intent.previous if e.patch == spec_id), None)
    return plan.manifest.find(spec_id, path)


def _classify(plan: RootPlan, t: Target, inv: Invocation) -> Outcome:
    spec = t.spec
    first = plan.files.get(spec.target.path) or b""
    details: dict = {"sha256": sha256(first)}
    entries = {p: e for p in spec.target.paths if (e := _entry(plan, spec.id, p)) is not None}
    details["recorded"] = bool(entries)
    if len(spec.target.files) > 1:
        details["files"] = [
            {
                "path": p,
                "sha256": sha256(data) if (data := plan.files.get(p)) is not None else None,
                "recorded": p in entries,
            }
            for p in spec.target.paths
        ]
    lead = next(iter(entries.values()), None)
    if lead is not None:
        details.update(sha256_before=lead.sha256_before, sha256_after=lead.sha256_after)
    verdicts = {p: _file_verdict(plan.files.get(p), e, spec.id) for p, e in entries.items()}
    if entries and all(v == "ok" for v in verdicts.values()):
        if lead is not None and lead.spec_sha256 != spec.sha256:
            message = (
                f"applied by an earlier version of this spec (recorded spec sha256 {lead.spec_sha256[:12]}, "
                f"this fp32patch's is {spec.sha256[:12]}); run `{inv.command('revert', patch=spec.id)}` then "
                f"`{inv.command('apply', patch=spec.id)}`"
            )
            return t.outcome(Status.OUTDATED, variant=lead.variant, details=details, message=message)
        lost = _lost_original(plan, entries.values(), t, inv)
        if lost:
            return t.outcome(
                Status.ORIGINAL_LOST, variant=lead.variant if lead else None, details=details, message=lost
            )
        return t.outcome(Status.APPLIED, variant=lead.variant if lead else None, details=details)
    gone = [p for p, v in verdicts.items() if v == "gone"]
    if gone:
        details["missing"] = gone
        message = gone_message(plan.root, gone, t.spec.id, inv)
        return t.outcome(Status.DRIFTED, variant=entries[gone[0]].variant, details=details, message=message)
    drifted = [p for p, v in verdicts.items() if v == "drifted"]
    if drifted:
        # the files that changed, by name: a patch of several files is not its first file
        details["drifted"] = [str(plan.root / p) for p in drifted]
        message = "; ".join(
            f"{plan.root / p} changed after it was patched (sha256 {sha256(plan.files.get(p) or b'')[:12]}, "
            f"recorded {entries[p].sha256_after[:12]})"
            for p in drifted
        )
        return t.outcome(Status.DRIFTED, variant=entries[drifted[0]].variant, details=details, message=message)

    results, _ = plan.chain([spec])
    result = results[spec.id]
    if result.status == Status.ALREADY_APPLIED:
        return unrecorded.verdict(plan, t, inv, details)
    if result.status in (Status.OBSOLETE, Status.UNSUPPORTED):
        return t.outcome(result.status, details=details, message=result.message)
    if result.status == Status.PARTIALLY_APPLIED:
        return t.outcome(Status.DRIFTED, details=details, message=result.message)
    message = "" if result.ok else f"and it cannot be applied: {result.message}"
    if entries:
        message = f"the file was replaced since it was patched (reinstalled or upgraded?) {message}".strip()
    details["applicable"] = result.ok
    return t.outcome(Status.NOT_APPLIED, details=details, message=message)


def gone_message(root: Path, paths: Sequence[str], patch: str, inv: Invocation) -> str:
    where = ", ".join(str(root / p) for p in paths)
    return (
        f"{where} was patched and recorded, and is gone (deleted after patching); reinstall the package to bring "
        f"it back, or `{inv.command('revert', '--force', patch=patch)}` clears the record (nothing to restore there)"
    )


def missing(t: Target, inv: Invocation, manifests: dict[Path, mf.Manifest]) -> Outcome:
    """A spec not found in a root: ``not-installed``, unless this root records that it patched its files
    (they were deleted since): a recorded file is never ``not-installed``."""
    root = t.searched
    if root not in manifests:
        manifests[root] = load_manifest(root) if StateDir(root).exists() else mf.Manifest()
    entries = [e for e in manifests[root].entries if e.patch == t.spec.id and not (root / e.path).exists()]
    if not entries:
        return t.not_installed()
    details = {"recorded": True, "missing": [e.path for e in entries], "sha256_after": entries[0].sha256_after}
    message = gone_message(root, [e.path for e in entries], t.spec.id, inv)
    out = entry_outcome(root, t.env, entries[0], Status.DRIFTED, message, details=details)
    out.target, out.variant = t.spec.target.label, entries[0].variant
    return out


def _lost_original(plan: RootPlan, entries, t: Target, inv: Invocation) -> str:
    """Why a revert would refuse (a kept original missing or altered), or ""."""
    state = StateDir(plan.root)
    for e in entries:
        if e.sha256_before == e.sha256_after:
            continue
        try:
            state.original(e.sha256_before)
        except TransactionError as exc:
            return (
                f"applied, but revert would refuse: {exc.strerror}. To restore the stock file, "
                f"{unrecorded.way_back(t, inv)}"
            )
    return ""


def _file_verdict(data: bytes | None, entry: mf.Entry, spec_id: str) -> str:
    """ "ok" (the recorded bytes), "drifted" (our markers, other bytes), "gone", or "replaced"."""
    if data is None:
        return "gone"
    current = sha256(data)
    if current == entry.sha256_after:
        return "ok"
    if current != entry.sha256_before and markers_in(data.decode("utf-8", "replace"), spec_id):
        return "drifted"
    return "replaced"


def unloaded(root: Path, manifest: mf.Manifest, loaded: set[str], inv: Invocation, env: Path | None) -> list[Outcome]:
    """Patches the manifest records that no loaded spec defines: reported, never skipped."""
    out: dict[str, Outcome] = {}
    for e in manifest.entries:
        if e.patch in loaded or e.patch in out:
            continue
        message = (
            f"recorded as applied (by fp32patch {e.tool_version}) but no loaded spec defines {e.patch!r}: load its "
            f"spec with --specs DIR to check it, or run `{inv.command('revert', patch=e.patch)}` (a revert needs "
            "only the manifest and the kept originals)"
        )
        details = {"recorded": True, "sha256_before": e.sha256_before, "sha256_after": e.sha256_after}
        out[e.patch] = entry_outcome(root, env, e, Status.SPEC_NOT_LOADED, message, details=details)
    return list(out.values())


def status(
    ids: Sequence[str],
    roots: Sequence[Path],
    *,
    spec_dir: Path | None = None,
    command: str = "status",
    envs: Sequence[Path] = (),
) -> Report:
    """Each patch's state in each root. ``verify`` fails (exit 1) unless all are good."""
    inv = Invocation(tuple(roots), tuple(envs), spec_dir, tuple(ids))
    specs = select_specs(ids, spec_dir)
    ts = targets(specs, roots, envs)
    manifests: dict[Path, mf.Manifest] = {}
    outcomes: list[Outcome] = [missing(t, inv, manifests) for t in ts if t.located is None]
    plans: dict[Path, RootPlan] = {}
    for root, group in by_root(ts).items():
        plans[root] = plan = RootPlan.build(root, group)
        outcomes += [classify(plan, t, inv) for t in group]
    if not ids:  # a manifest entry whose spec is not loaded is reported, never skipped
        loaded = {s.id for s in specs}
        envs_of = {t.searched: t.env for t in ts}
        for root in dict.fromkeys([*plans, *(t.searched for t in ts)]):
            if root in plans or StateDir(root).exists():
                manifest = plans[root].manifest if root in plans else load_manifest(root)
                outcomes += unloaded(root, manifest, loaded, inv, envs_of.get(root))
    outcomes = fold_not_installed(outcomes, searched_order(ts))
    # An interrupted entry fails verify even where the bytes are patched: its RECORD row or
    # bytecode may still lag behind until the next apply or revert settles it. An environment
    # found by --envs may lack the target (a trainer env without vLLM): that is not a failure.
    bad = [
        o
        for o in outcomes
        if o.status not in VERIFY_OK
        or (ids and o.status == Status.NOT_INSTALLED and not o.env)
        or o.details.get("interrupted")
    ]
    # a root named with -s (or the default one) that holds none of the packages: where they are instead
    found = {t.searched for t in ts if t.located is not None}
    empty = any(t.searched not in found for t in ts if t.env is None)
    advice = nearby.advise(roots, envs, specs, inv, command) if empty else []
    if all(o.status == Status.NOT_INSTALLED for o in outcomes):
        bad = outcomes  # nothing found anywhere is a problem, not a pass
        if advice:
            return Report(command, outcomes, EXIT_VERIFY if command == "verify" else EXIT_OK, notes=advice)
    if command != "verify" or not bad:
        return Report(command, outcomes, EXIT_OK, notes=advice)
    return Report(command, outcomes, EXIT_VERIFY, notes=[*why_verify_failed(bad, inv), *advice])
