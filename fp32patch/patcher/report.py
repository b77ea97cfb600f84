"""What commands return: one ``Outcome`` per patch and import root, gathered in a ``Report``.

The engine returns these values and the CLI renders them (a table, or ``--json``). Exit
codes: 0 success, 1 ``verify`` found a problem, 2 bad usage or input (nothing written),
3 a patch cannot be applied or reverted (nothing written).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from fp32patch.patcher.model import Status

EXIT_OK, EXIT_VERIFY, EXIT_USAGE, EXIT_REFUSED = 0, 1, 2, 3
EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports SIGINT


class UsageError(ValueError):
    """Bad usage or bad input: exit 2, nothing written."""


def did_you_mean(word: str, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the choice spelled closest to ``word``, or "" where none is close."""
    import difflib

    inside = [c for c in choices if len(word) >= 3 and word.lower() in c]  # a part of an id: "nemotron", "verl"
    close = inside if len(inside) == 1 else difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Interrupted(Exception):
    """Ctrl-C while a root was being written: which root, and how far its transaction had got
    (``Transaction.progress``); every root of the run committed before it is undone."""

    def __init__(self, root: Path, progress: str, inv: Invocation | None = None):
        super().__init__(str(root))
        self.root, self.progress = root, progress
        self.inv = inv or Invocation((root,))

    def note(self, finished: int = 0) -> str:
        settle = f"`{self.inv.command('revert')}` or `{self.inv.command('apply')}`"
        what = {
            "none": f"before this run wrote anything in {self.root}",
            "rolled-back": f"while writing {self.root}: rolled back, every file of this run has its bytes from before it",
            "undone": f"while writing {self.root}: rolled back, every file of this run has its bytes from before it",
            "writing": f"while writing {self.root}, and its roll-back was cut short: every file there is whole (its old "
            f"or new bytes) and the run's intent is recorded; {settle} settles the rest",
            "done": f"just after {self.root} was written: its changes stay",
        }[self.progress]
        before = f"; {finished} import root(s) finished before it keep their changes" if finished else ""
        return f"interrupted (Ctrl-C) {what}{before}; exit {EXIT_INTERRUPTED}"


@dataclass(frozen=True)
class Invocation:
    """The roots and spec folder a command was given, so a printed next command runs as is."""

    roots: tuple[Path, ...] = ()
    envs: tuple[Path, ...] = ()
    spec_dir: Path | None = None
    patches: tuple[str, ...] = ()  # the --patch ids it was given

    def command(self, verb: str, *extra: str, patch: str | None = None) -> str:
        words = ["fp32patch", verb]
        for root in self.roots:
            words += ["-s", str(root)]
        for env in self.envs:
            words += ["--envs", str(env)]
        if self.spec_dir is not None:
            words += ["--specs", str(self.spec_dir)]
        for one in [patch] if patch else self.patches:
            words += ["--patch", one]
        return shlex.join([*words, *extra])


@dataclass
class Outcome:
    """One patch in one import root: what was found or done."""

    patch: str
    status: Status | str
    root: str
    target: str  # "<distribution>:<first path in root>"
    version: str | None = None
    path: str | None = None  # absolute path of the (first) file, when installed
    message: str = ""
    variant: str | None = None
    diff: str | None = None
    details: dict = field(default_factory=dict)
    env: str | None = None  # the environment (from --envs) this root belongs to

    def to_json(self) -> dict:
        out = {
            "id": self.patch,
            "status": str(self.status),
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
        if self.diff is not None:  # diff, apply --dry-run: the unified diff itself
            out["diff"] = self.diff
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
            for root in o.root.split(os.pathsep) if o.status == Status.NOT_INSTALLED else [o.root]:
                row = roots.setdefault(root, {"root": root, **({"env": o.env} if o.env else {}), "statuses": {}})
                key = str(o.status)
                row["statuses"][key] = row["statuses"].get(key, 0) + 1
        return list(roots.values())

    def to_json(self) -> dict:
        data = {"ok": self.ok, "command": self.command, **self.extra, "patches": [o.to_json() for o in self.outcomes]}
        data["roots"] = self.by_root()
        if self.notes:
            data["notes"] = self.notes
        return data


def why_verify_failed(bad: Sequence[Outcome], inv: Invocation) -> list[str]:
    """One line per kind of problem, counted per row, with the command that fixes it."""
    apply, revert = f"`{inv.command('apply')}`", f"`{inv.command('revert')}`"
    counts: dict[str, int] = {}
    for o in bad:
        kind = "interrupted" if o.details.get("interrupted") else str(o.status)
        counts[kind] = counts.get(kind, 0) + (o.root.count(os.pathsep) + 1 if o.status == Status.NOT_INSTALLED else 1)
    how = {
        str(Status.NOT_APPLIED): lambda n: f"{n} not applied: run {apply}",
        str(Status.DRIFTED): lambda n: (
            f"{n} drifted (changed after patching): `{inv.command('revert', '--force')}` restores the originals and "
            f"keeps the changed bytes in the state folder; then {apply}"
        ),
        str(Status.OUTDATED): lambda n: f"{n} outdated (patched by an earlier spec): run {revert}, then {apply}",
        str(Status.UNRECORDED): lambda n: (
            f"{n} unrecorded (patched, but this root has no record of it): `fp32patch revert --against` the "
            "installed release's wheel, sdist or checkout restores the stock files (each line above says how)"
        ),
        str(Status.ORIGINAL_LOST): lambda n: (
            f"{n} with a lost original (revert would refuse): `fp32patch revert --against` the installed release "
            "restores them (each line above says how)"
        ),
        "interrupted": lambda n: f"{n} left by an interrupted run: run {apply} or {revert} to settle",
        str(Status.NOT_INSTALLED): lambda n: (
            f"{n} not installed where asked: name the environment that holds the target with -s DIR or --envs DIR"
        ),
    }
    return [how.get(kind, lambda n, k=kind: f"{n} {k}: see the lines above")(n) for kind, n in counts.items()]


def fold_not_installed(outcomes: list[Outcome], order: Sequence[str]) -> list[Outcome]:
    """A patch found in some root need not be listed as missing from the others.

    Environments found by --envs are each reported for every patch found in any of them (the
    report is per root), in the order the roots were given (``-s`` first, then each environment
    in path order); a patch found nowhere is one line, as for ``-s``.
    """
    rank = {root: i for i, root in reversed(list(enumerate(order)))}
    outcomes = sorted(outcomes, key=lambda o: rank.get(o.root, len(rank)))
    found = {o.patch for o in outcomes if o.status != Status.NOT_INSTALLED}
    kept: list[Outcome] = []
    missing: dict[str, Outcome] = {}
    for o in outcomes:
        if o.status != Status.NOT_INSTALLED or (o.env and o.patch in found):
            kept.append(o)
        elif o.patch not in found and o.patch not in missing:
            missing[o.patch] = o
        elif o.patch in missing:
            folded = missing[o.patch]
            folded.root += os.pathsep + o.root
            folded.env = None  # several roots now, not one environment
            folded.message = f"{folded.target} is not in any of the {folded.root.count(os.pathsep) + 1} import roots"
    return kept + list(missing.values())
