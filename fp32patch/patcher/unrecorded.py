"""Files that carry a patch's markers while no record says what they were before.

This happens when the state folder (``<root>/.fp32patch``) stays behind: a multi-stage
image build that copies only ``vllm/`` and its dist-info, or a state folder moved aside
after a manifest error. Such a patch is ``unrecorded``: never ``applied`` (nothing could
revert it) and never reverted by guesswork.

Without the release, two things can still be told: whether the files hold exactly what
the specs write (their marked insertions taken out and the specs applied again give
today's bytes: ``exact``), and whether the dist-info RECORD row, which ``apply`` rewrites,
has today's hash (``record_row``). With the release (``revert --against``), its own files
are the stock bytes when the specs applied to them give exactly today's bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

from fp32patch.patcher.candidate import Found
from fp32patch.patcher.markers import markers_in
from fp32patch.patcher.model import Spec, Status
from fp32patch.patcher.plan import RootPlan, Target, read, select_specs
from fp32patch.patcher.record import record_hash, record_row_hash
from fp32patch.patcher.report import Invocation, Outcome
from fp32patch.patcher.state import StateDir


def _has_markers(data: bytes | None, spec_id: str) -> bool:
    return data is not None and bool(markers_in(data.decode("utf-8", "replace"), spec_id))


def marked(plan: RootPlan, spec: Spec) -> bool:
    """Whether any of the spec's files carries one of its markers."""
    return any(_has_markers(plan.files.get(p), spec.id) for p in spec.target.paths)


def chain_of(plan: RootPlan, spec: Spec, spec_dir) -> tuple[list[Spec], dict[str, bytes | None]]:
    """Every loaded spec whose markers share files with ``spec``'s (in chain order), and those files' bytes."""
    every = select_specs([], spec_dir)
    files = {p: plan.files[p] if p in plan.files else read(plan.root / p) for p in spec.target.paths}
    chain = [spec]
    grew = True
    while grew:
        grew = False
        for other in every:
            if other.id in {s.id for s in chain} or not set(other.target.paths) & set(files):
                continue
            if any(_has_markers(files.get(p), other.id) for p in other.target.paths if p in files):
                chain.append(other)
                files.update({p: read(plan.root / p) for p in other.target.paths if p not in files})
                grew = True
    order = [s.id for s in every]
    return sorted(chain, key=lambda s: order.index(s.id) if s.id in order else -1), files


def exact(plan: RootPlan, specs: Sequence[Spec], files: dict[str, bytes | None]) -> bool | None:
    """Whether ``files`` are exactly what ``specs`` write; None when their edits cannot be taken out."""
    from fp32patch.patcher.unapply import strip

    stripped = strip(specs, files)
    if stripped is None:
        return None
    _, final = plan.chain(specs, start=stripped)
    return all(final.get(p) == data for p, data in files.items())


def record_row(plan: RootPlan, spec: Spec) -> str | None:
    """ "matches" when the RECORD rows of the spec's files have today's hashes (``apply`` wrote them),
    "differs" when one does not, None without a RECORD."""
    rel = plan.record_rel(spec)
    record = read(plan.root / rel) if rel else None
    if record is None:
        return None
    verdicts = set()
    for path in spec.target.paths:
        row, data = record_row_hash(record, path), plan.files.get(path)
        if row is not None and data is not None:
            verdicts.add(row == record_hash(data))
    return None if not verdicts else "matches" if all(verdicts) else "differs"


def way_back(t: Target, inv: Invocation) -> str:
    """The commands that restore the stock files of ``t``'s release."""
    here = Invocation((t.searched,), (), inv.spec_dir)
    dist = t.located.distribution if t.located else None
    name, version = (dist.name, dist.version) if dist else (t.spec.target.distribution, None)
    if dist is None or dist.metadata_dir is None or version is None:
        return (
            f"run `{here.command('revert', '--against', 'DIR')}` with a clean copy of the same {name} release "
            "(a checkout of its commit, an unpacked sdist)"
        )
    if "+" in version:
        return (
            f"run `{here.command('revert', '--against', 'WHEEL')}` with the wheel or sdist of this very build "
            f"({name} {version} is a local build, not on the package index), or reinstall it"
        )
    wheel = f"/tmp/stock/{name.replace('-', '_')}-{version}-*.whl"
    return (
        f"run `pip download --no-deps --only-binary=:all: -d /tmp/stock {name}=={version}` then "
        f"`{here.command('revert')} --against {wheel}`, or reinstall {name} {version}"
    )


def verdict(plan: RootPlan, t: Target, inv: Invocation, details: dict) -> Outcome:
    """verify's ``unrecorded``: what the files hold, and the way back."""
    specs, files = chain_of(plan, t.spec, inv.spec_dir)
    details["exact"] = exact(plan, specs, files)
    details["record_row"] = record_row(plan, t.spec)
    where = plan.root / t.spec.target.path
    state = StateDir(plan.root)
    why = (
        f"this root has no state folder ({state.path})"
        if not state.exists()
        else "the manifest in this root records other bytes for it, or none"
    )
    content = {
        True: "its patched code is exactly what this spec writes",
        False: "its patched code is not what this spec writes (edited after patching, or patched by another fp32patch)",
        None: "whether its patched code is what this spec writes cannot be told (an edit replaced upstream code)",
    }[details["exact"]]
    row = {
        "matches": "; its RECORD row has these bytes' hash (an fp32patch apply wrote it)",
        "differs": "; its RECORD row has another hash (changed since it was installed or patched)",
        None: "",
    }[details["record_row"]]
    message = (
        f"{where} carries this patch's markers, but {why}: no record of what it was before, so no revert. "
        f"{content[0].upper()}{content[1:]}{row}. To restore the stock file, {way_back(t, inv)}; or copy the state "
        f"folder from where it was patched"
    )
    return t.outcome(Status.UNRECORDED, details=details, message=message)


def stock_bytes(
    plan: RootPlan, t: Target, specs: Sequence[Spec], files: dict[str, bytes | None], found: list[Found], label: str
) -> dict[str, bytes] | str:
    """The release's own files that ``specs`` turn into exactly today's ``files`` (only those that
    differ), or why they cannot be proved to be the stock ones."""
    installed = t.located.version if t.located else None
    stock: dict[str, bytes | None] = {}
    for spec in specs:
        f = next((f for f in found if f.spec.id == spec.id), None)
        if f is None or f.data is None:
            return f"{label} does not hold {spec.target.path} ({spec.target.distribution}'s file)"
        release = f"{f.distribution or spec.target.distribution} {f.version or '(version unknown)'}"
        if installed and f.version and f.version != installed:
            return f"{label} is {release}, but this root has {t.spec.target.distribution} {installed}"
        stock.update({p: d for p, d in f.data.items() if p in files})
    missing = [p for p, data in files.items() if data is not None and stock.get(p) is None]
    if missing:
        return f"{label} does not hold {missing[0]}"
    _, final = plan.chain(specs, start=stock)
    differs = [p for p, data in files.items() if final.get(p) != data]
    if differs:
        return (
            f"this patch applied to {label}'s {differs[0]} does not give today's bytes (edited after patching, or "
            "another release): it cannot be proved to be the stock file"
        )
    return {p: data for p, data in stock.items() if data is not None and data != files.get(p)}
