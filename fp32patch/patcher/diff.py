"""``diff``: each patch as a unified diff, the change it would make or the one it made.

Paths are ``a/<path in root>`` and ``b/<path in root>``, so ``patch -p1`` run in the root
applies it. A patch recorded in the manifest is shown from its kept original; one that is
not is shown as ``apply`` would make it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fp32patch.patcher import nearby
from fp32patch.patcher.model import Status
from fp32patch.patcher.plan import RootPlan, by_root, searched_order, select_specs, targets
from fp32patch.patcher.report import (
    EXIT_OK,
    EXIT_REFUSED,
    Invocation,
    Outcome,
    Report,
    UsageError,
    fold_not_installed,
)
from fp32patch.patcher.state import StateDir, sha256
from fp32patch.patcher.transaction import TransactionError
from fp32patch.patcher.transform import unified_diff


def diff(
    ids: Sequence[str], roots: Sequence[Path], *, spec_dir: Path | None = None, envs: Sequence[Path] = ()
) -> Report:
    specs = select_specs(ids, spec_dir)
    ts = targets(specs, roots, envs)
    outcomes: list[Outcome] = [t.outcome(Status.NOT_INSTALLED) for t in ts if t.located is None]
    refused = False
    for root, group in by_root(ts).items():
        plan = RootPlan.build(root, group)
        state = StateDir(root)
        for t in group:
            paths = t.spec.target.paths
            entries = {p: e for p in paths if (e := plan.manifest.find(t.spec.id, p)) is not None}
            changed = {p: e for p, e in entries.items() if sha256(plan.files.get(p) or b"") != e.sha256_before}
            if changed:
                try:
                    originals = {p: state.original(e.sha256_before) for p, e in changed.items()}
                except TransactionError as exc:
                    raise UsageError(str(exc.strerror)) from None
                alone = {p for p in changed if len(plan.manifest.on(p)) == 1}
                # a file other patches share: this patch's own change, computed from the original
                _, own = plan.chain([t.spec], start={**plan.files, **originals}) if alone != set(changed) else ({}, {})
                text = "".join(
                    unified_diff(originals[p], plan.files.get(p) or b"" if p in alone else own.get(p) or b"", p)
                    for p in paths
                    if p in changed
                )
                ok = all(sha256(plan.files.get(p) or b"") == e.sha256_after for p, e in changed.items())
                outcomes.append(t.outcome(Status.APPLIED if ok else Status.DRIFTED, diff=text))
                continue
            results, final = plan.chain([t.spec])
            result = results[t.spec.id]
            if result.status == Status.APPLIED:
                text = "".join(
                    unified_diff(plan.files.get(p) or b"", final[p] or b"", p) for p in paths if p in result.files
                )
                outcomes.append(t.outcome(Status.NOT_APPLIED, variant=result.variant, diff=text))
            else:
                refused |= result.status.refused
                outcomes.append(t.outcome(result.status, message=result.message))
    found = {t.searched for t in ts if t.located is not None}
    advice = nearby.advise(roots, envs, specs, Invocation(tuple(roots), tuple(envs), spec_dir, tuple(ids)), "diff")
    notes = advice if any(t.searched not in found for t in ts if t.env is None) else []
    code = EXIT_REFUSED if refused else EXIT_OK
    return Report("diff", fold_not_installed(outcomes, searched_order(ts)), code, notes=notes)
