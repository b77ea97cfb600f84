"""``fp32patch check --against WHEEL|SDIST|DIR``: would each patch still apply to a candidate release?

Before an upgrade, each patch whose target distribution the candidate is (by the name in
its METADATA, PKG-INFO, dist-info or pyproject) is run through ``transform`` on the
candidate's own copy of the file, in memory: ``would-apply`` (with the variant and its
edits), ``obsolete`` (the upstream fix is there), ``already-applied`` (a patched folder),
or a refusal telling which anchor drifted and how. A candidate without the target file
(moved or deleted upstream) is ``not-installed``. Exit 0 when every matching patch would
apply or is not needed, 3 when one would not, 2 for bad input. Nothing is written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fp32patch.patcher.candidate import CandidateError, Found, found_in
from fp32patch.patcher.locate import LocateError
from fp32patch.patcher.model import Status
from fp32patch.patcher.plan import select_specs
from fp32patch.patcher.report import EXIT_OK, EXIT_REFUSED, Outcome, Report, UsageError
from fp32patch.patcher.transform import transform


def check(candidate: Path, ids: Sequence[str] = (), *, spec_dir: Path | None = None) -> Report:
    specs = select_specs(ids, spec_dir)
    try:
        found, info = found_in(candidate, specs)
    except (CandidateError, LocateError) as exc:
        raise UsageError(f"--against {exc}") from None
    if not found:
        what = f"{info['distribution']} {info['version']}" if info.get("distribution") else "anything in it"
        targets = ", ".join(sorted({s.target.distribution for s in specs}))
        raise UsageError(f"--against {candidate}: no patch targets {what} (the patches target: {targets})")

    outcomes = [_outcome(f, candidate) for f in found]
    bad = any(Status(str(o.status)).refused or o.status == Status.NOT_INSTALLED for o in outcomes)
    notes = ["nothing was installed, extracted or written"]
    return Report("check", outcomes, EXIT_REFUSED if bad else EXIT_OK, notes=notes, extra={"candidate": info})


def _outcome(f: Found, candidate: Path) -> Outcome:
    spec = f.spec
    common = dict(
        patch=spec.id,
        root=str(candidate),
        target=spec.target.label,
        version=f.version,
        path=f.where,
    )
    if f.data is None:
        release = f"{spec.target.distribution} {f.version or '(version unknown)'}"
        message = (
            f"{release} has no {spec.target.path}: the file this patch edits moved or was removed upstream; "
            "the patch needs a new spec before this upgrade"
        )
        return Outcome(status=Status.NOT_INSTALLED, message=message, **common)
    result = transform(spec, f.data, version=f.version)
    details = {"edits": result.edits, "skipped": result.skipped}
    if result.status == Status.APPLIED:
        message = f"{len(result.edits)} edit(s) would apply: {', '.join(result.edits)} (variant {result.variant})"
        if result.skipped:
            message += f"; already fixed upstream: {', '.join(result.skipped)}"
        return Outcome(status=Status.WOULD_APPLY, variant=result.variant, message=message, details=details, **common)
    if result.anchor:
        details["anchor"] = result.anchor
    return Outcome(status=result.status, variant=result.variant, message=result.message, details=details, **common)
