"""The ``fp32patch`` command: parse, call the engine, render. Nothing else lives here.

Results go to stdout (tables, or one JSON object with ``--json``; for ``diff``, the patch
alone); diagnostics go to stderr. Colour follows the terminal and ``NO_COLOR``. Only the
commands that transform import libcst (through the engine), so ``verify``, ``status``,
``list`` and ``--version`` start fast. Exit codes: 0 success, 1 verify
found a problem, 2 bad usage or input (nothing written), 3 a patch cannot be applied
(nothing written).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def _wants_json(argv: list[str]) -> bool:
    """``--json`` as a flag, or with a value it does not take (``--json=1``: a usage error, answered in JSON)."""
    return any(a == "--json" or a.startswith("--json=") for a in argv)


_CTRL_C = "interrupted (Ctrl-C) before fp32patch changed anything; nothing was written; exit 130"


def _interrupted(*_) -> None:
    """Ctrl-C in the CLI's process. Once a root's lock was taken, the writer's own ``KeyboardInterrupt`` (it
    rolls back and says how far it got); before, nothing has been written (writes happen under a lock only),
    so one line (one JSON object too, with ``--json``) and exit 130 at once: no exception travels through
    the code it lands in (typer's parser turns one into a silent exit 130, an import into a traceback)."""
    state = sys.modules.get("fp32patch.patcher.state")
    if state is not None and state.locks_taken():
        raise KeyboardInterrupt
    if _wants_json(sys.argv[1:]):  # built by hand: json itself may be what is being imported
        os.write(1, ('{\n  "ok": false,\n  "error": "' + _CTRL_C + '",\n  "patches": []\n}\n').encode())
    os.write(2, (_CTRL_C + "\n").encode())
    os._exit(130)


def _catch_ctrl_c():
    """The previous SIGINT handler (None outside the main thread, where no signal is delivered). A SIGINT
    the process inherited as ignored (nohup, a background job) stays ignored."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            return None
        return signal.signal(signal.SIGINT, _interrupted)
    except ValueError:
        return None


def _as_command() -> bool:
    """This process is the fp32patch command (its console script or ``python -m fp32patch``), not a program
    that imports the module (a test): then the handler stays for the whole run."""
    first = sys.argv[0] if sys.argv else ""
    return os.path.basename(first) == "fp32patch" or first.endswith(os.path.join("fp32patch", "__main__.py"))


# Ctrl-C from here on ends the run with a line (for a program that imports this module, its last lines put
# the previous handler back)
try:
    _sigint = _catch_ctrl_c()
    import json
    from dataclasses import dataclass
    from pathlib import Path
    from typing import Annotated

    import typer
    import typer.core
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    from fp32patch import __version__
    from fp32patch.patcher.model import Status
    from fp32patch.patcher.report import EXIT_INTERRUPTED, EXIT_USAGE, Invocation, Outcome, Report, UsageError
except KeyboardInterrupt:  # before the handler was in place
    _interrupted()


def _json_error(message: str) -> None:
    """Under ``--json`` every failure is one JSON object on stdout (the message goes to stderr too)."""
    print(json.dumps({"ok": False, "error": message, "patches": []}, indent=2))


class _Group(typer.core.TyperGroup):
    """With ``--json``, a usage error (an unknown option, a missing ``--against``) is a JSON object too."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        argv = list(sys.argv[1:] if args is None else args)
        if not _wants_json(argv) or not standalone_mode:
            return super().main(argv, prog_name, complete_var, standalone_mode, **extra)
        # newer typer carries its own copy of click (typer.core._click), older typer uses click
        click = getattr(typer.core, "_click", None) or typer.core.click
        try:
            code = super().main(argv, prog_name, complete_var, False, **extra)
        except click.ClickException as exc:
            _json_error(exc.format_message())
            err.print(f"[bold red]error:[/] {escape(exc.format_message())}", soft_wrap=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            _json_error("aborted")
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_Group,
    name="fp32patch",
    help="fp32 LM-head logits in both engines of RL training: patches the rollout engines (vLLM, SGLang) and the "
    "stacks (NeMo-RL, verl, TRL, OpenRLHF, slime, Prime-RL, AReaL, SkyRL) at image-build time (apply, verify in CI, revert), so the "
    "rollout engine and the trainer (Megatron-Core, PyTorch/HF) compute the LM head in fp32 from one switch.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _flags_take_no_value() -> None:
    """typer 0.2x prints a type beside every option (`<bool>` on a flag, `--help` included); a flag has none."""
    from typer import core

    shown = getattr(core.TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_fp32patch", False):
        return

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) else shown(self, ctx)

    display_type_rich._fp32patch = True  # type: ignore[attr-defined]
    core.TyperOption.display_type_rich = display_type_rich


_flags_take_no_value()
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)


class Grid:
    """A table: rich's on a terminal; piped (CI logs, grep), plain columns as wide as their cells,
    with no box characters, no padding to a width and no folding."""

    def __init__(self, *columns: str):
        self.columns = list(columns)
        self.rows: list[tuple[list[str], bool]] = []

    def add_row(self, *cells: str, end_section: bool = False) -> None:
        self.rows.append((list(cells), end_section))

    def print(self, console: Console) -> None:
        if console.is_terminal:
            table = Table(show_edge=False, pad_edge=False)
            for column in self.columns:
                table.add_column(column, overflow="fold")
            for cells, end_section in self.rows:
                table.add_row(*cells, end_section=end_section)
            console.print(table)
            return
        lines = [self.columns] + [[Text.from_markup(c).plain for c in cells] for cells, _ in self.rows]
        widths = [
            max(len(line) for cell in column for line in cell.splitlines() or [""])
            for column in zip(*lines, strict=True)
        ]
        for cells in lines:
            split = [cell.splitlines() or [""] for cell in cells]
            for i in range(max(map(len, split))):
                row = [(part[i] if i < len(part) else "").ljust(w) for part, w in zip(split, widths, strict=True)]
                console.file.write("  ".join(row).rstrip() + "\n")
        console.file.flush()


SitePackages = Annotated[
    list[Path] | None,
    typer.Option(
        "--site-packages",
        "-s",
        help="An import root (site-packages, a `pip install --target` folder, a source checkout). "
        "Repeatable. Default: this interpreter's site-packages.",
        show_default=False,
        metavar="DIR",
    ),
]
Envs = Annotated[
    list[Path] | None,
    typer.Option(
        "--envs",
        help="A folder holding Python environments (venv, virtualenv, uv, conda; e.g. Ray's runtime_resources): "
        "every environment under it is an import root, reported one by one. Repeatable; adds to -s.",
        show_default=False,
        metavar="DIR",
    ),
]
PatchIds = Annotated[
    list[str] | None,
    typer.Option(
        "--patch", "-p", help="Only this patch id (repeatable). Default: every patch.", show_default=False, metavar="ID"
    ),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object for machines.", show_default=False)]
ShowAll = Annotated[
    bool,
    typer.Option(
        "--all",
        help="Also list each patch whose package is not in the import root (one line counts them otherwise; "
        "--json always lists them).",
        show_default=False,
    ),
]
Specs = Annotated[
    Path | None,
    typer.Option(
        "--specs",
        help="Load specs from this folder instead of the ones shipped with fp32patch.",
        show_default=False,
        metavar="DIR",
    ),
]

_STYLE = {
    Status.APPLIED: "green",
    Status.ALREADY_APPLIED: "green",
    Status.REVERTED: "green",
    Status.WOULD_APPLY: "cyan",
    Status.OBSOLETE: "blue",
    Status.NOT_INSTALLED: "dim",
    Status.NOT_APPLIED: "yellow",
    Status.DRIFTED: "red",
    Status.OUTDATED: "yellow",
}
# printed to stdout (the rest of the messages are problems: stderr); quiet ones speak only when asked
_GOOD = {
    Status.APPLIED,
    Status.ALREADY_APPLIED,
    Status.REVERTED,
    Status.WOULD_APPLY,
    Status.OBSOLETE,
    Status.NOT_INSTALLED,
}
_QUIET = {Status.APPLIED, Status.ALREADY_APPLIED, Status.NOT_INSTALLED}


def _status_cell(status: str) -> str:
    return f"[{_STYLE.get(status, 'bold red')}]{status}[/]"


def _print_diff(text: str) -> None:
    if out.is_terminal and not out.no_color:
        from rich.syntax import Syntax

        out.print(Syntax(text, "diff", theme="ansi_dark", background_color="default", word_wrap=True))
    else:  # byte-exact, so `fp32patch diff > change.patch` is a patch
        out.file.write(text)
        out.file.flush()


@dataclass(frozen=True)
class Listing:
    """What a table shows of a command's outcomes: the patches whose packages are not in the root are
    counted in one line (unless ``--all``, or named with ``--patch``), short enough for a CI log's line."""

    inv: Invocation
    show_all: bool = False

    def hidden(self, outcomes: list[Outcome]) -> list[Outcome]:
        if self.show_all:
            return []
        return [
            o for o in outcomes if o.status == Status.NOT_INSTALLED and not o.env and o.patch not in self.inv.patches
        ]

    def summary(self, hidden: list[Outcome], roots: int) -> str:
        from fp32patch.patcher.nearby import names

        where = "not in this root" if roots == 1 else f"in none of the {roots} import roots"
        packages = ", ".join(names(o.target.split(":", 1)[0] for o in hidden))
        many = "patches whose packages are" if len(hidden) > 1 else "patch whose package is"
        return f"{len(hidden)} {many} {where} ({packages}); --all lists them"


def _render(
    report: Report,
    *,
    as_json: bool,
    show_diff: bool = False,
    envs: list[Path] | None = None,
    listing: Listing | None = None,
) -> None:
    """Tables and messages; with ``show_diff`` (``diff``) stdout holds the patch alone and the rest goes to stderr."""
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        table = err if show_diff else out
        candidate = report.extra.get("candidate")
        if candidate:
            release = " ".join(str(candidate[k]) for k in ("distribution", "version") if candidate.get(k))
            table.print(f"checking {release or 'a folder'} ({candidate['kind']} {candidate['path']})", soft_wrap=True)
        bases = [Path(e).absolute() for e in envs or []]
        if bases:
            table.print("environments under " + ", ".join(map(str, bases)), soft_wrap=True)
        roots = report.by_root()
        hidden = listing.hidden(report.outcomes) if listing else []
        folded = {id(o) for o in hidden}
        # a missing package is worth a line where --patch asked for it (or check found its file gone)
        named = (lambda o: o.patch in listing.inv.patches) if listing else (lambda o: True)
        shown = [o for o in report.outcomes if id(o) not in folded]
        if shown:
            _table(shown, bases).print(table)
        if hidden and (shown or not report.notes):  # with nothing found, a note says where to look instead
            table.print(escape(listing.summary(hidden, len(roots))), soft_wrap=True)
        if len(roots) > 1:  # many environments: the totals, so a long table need not be read to the end
            totals: dict[str, int] = {}
            for row in roots:  # a folded not-installed row counts once per root it stands for
                for status_, n in row["statuses"].items():
                    totals[status_] = totals.get(status_, 0) + n
            table.print(
                f"{len(roots)} import roots: " + ", ".join(f"{n} {s}" for s, n in totals.items()), soft_wrap=True
            )
        for o in report.outcomes:
            # quiet statuses speak up when they are the problem (check: the file is gone upstream)
            loud = (
                o.status not in _QUIET
                or o.details.get("interrupted")
                or (o.status == Status.NOT_INSTALLED and not report.ok and not o.env and named(o))
            )
            if o.message and loud:
                where = f" in {o.root}" if len(roots) > 1 and os.pathsep not in o.root else ""
                (table if o.status in _GOOD else err).print(
                    f"[bold]{o.patch}[/] ({o.status}){where}: {o.message}", soft_wrap=True
                )
            if show_diff and o.diff:
                _print_diff(o.diff)
        for note in report.notes:
            err.print(escape(note), soft_wrap=True)
    raise typer.Exit(report.exit_code)


def _label(o: Outcome, bases: list[Path]) -> str:
    """How a root is named in a grouped table: an environment relative to its --envs folder."""
    if o.status == Status.NOT_INSTALLED and os.pathsep in o.root:
        return f"(none of {o.root.count(os.pathsep) + 1} roots)"
    for base in bases:
        if o.env and Path(o.env).is_relative_to(base):
            return Path(o.env).relative_to(base).as_posix() or "."
    return o.env or o.root


def _table(outcomes: list[Outcome], bases: list[Path]) -> Grid:
    """One row per patch and root; with several roots, grouped by root, file paths relative to it."""
    roots = list(dict.fromkeys(o.root for o in outcomes))
    grouped = len(roots) > 1
    # an environment found by --envs is named by its folder (its site-packages is in --json)
    first = "environment" if grouped and all(o.env or os.pathsep in o.root for o in outcomes) else "root"
    table = Grid(*([first] if grouped else []), "patch", "status", "version", "file")
    for root in roots:
        rows = [o for o in outcomes if o.root == root]
        for i, o in enumerate(rows):
            paths = o.details.get("drifted") or ([o.path] if o.path else [])  # the files at fault, where known
            if paths and grouped:
                where = "\n".join(p[len(root) + 1 :] if p.startswith(root + "/") else p for p in paths)
            else:
                where = "\n".join(paths) or (o.target if grouped else f"{o.target} (looked in {o.root})")
            cells = [o.patch, _status_cell(str(o.status)), o.version or "-", where]
            label = _label(o, bases) if i == 0 else ""
            table.add_row(*([label] if grouped else []), *cells, end_section=grouped and i == len(rows) - 1)
    return table


def _run(fn, *args, as_json: bool = False, show_diff: bool = False, listing: Listing | None = None, **kwargs) -> None:
    from fp32patch.patcher.spec import SpecError

    try:
        report = fn(*args, **kwargs)
    except KeyboardInterrupt:  # a writer reports its own interruption; this one came while none was writing
        message = f"interrupted (Ctrl-C) while no file was being written; exit {EXIT_INTERRUPTED}"
        if as_json:
            _json_error(message)
        err.print(message, soft_wrap=True)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except (UsageError, SpecError) as exc:
        _usage_error(str(exc), as_json)
    except OSError as exc:  # a file the engine could not read or use (another user's, a broken disk)
        _usage_error(_os_error(exc), as_json)
    with _answering():
        _render(report, as_json=as_json, show_diff=show_diff, envs=kwargs.get("envs") or [], listing=listing)


@contextlib.contextmanager
def _answering():
    """While the answer is printed, Ctrl-C waits: the work is done, and a second answer after half of the
    first would not be one JSON object."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def _os_error(exc: OSError) -> str:
    """One line: the file and the error (an unreadable state folder says what to do)."""
    if str(exc) and not exc.strerror:
        return str(exc)
    if getattr(exc, "message", None):
        return exc.message
    where = f"{exc.filename}: " if exc.filename else ""
    return f"{where}{exc.strerror or exc}"


def _usage_error(message: str, as_json: bool) -> None:
    """Exit 2 with the message (one JSON object too, with ``--json``)."""
    if as_json:
        _json_error(message)
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(EXIT_USAGE) from None


def _listing(site_packages, envs, patch, specs, show_all: bool) -> Listing:
    inv = Invocation(tuple(site_packages or ()), tuple(envs or ()), specs, tuple(patch or ()))
    return Listing(inv, show_all)


@app.command()
def apply(
    site_packages: SitePackages = None,
    envs: Envs = None,
    patch: PatchIds = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would change; write nothing.")] = False,
    as_json: Json = False,
    specs: Specs = None,
    show_all: ShowAll = False,
) -> None:
    """Apply the patches (all or none per import root; exit 3 and nothing written if an anchor is off)."""
    from fp32patch.patcher.apply import apply as apply_patches

    _run(
        apply_patches,
        patch or [],
        site_packages or [],
        dry_run=dry_run,
        spec_dir=specs,
        envs=envs or [],
        as_json=as_json,
        show_diff=dry_run,
        listing=_listing(site_packages, envs, patch, specs, show_all),
    )


def _status(command: str, site_packages, envs, patch, as_json: bool, specs, show_all: bool) -> None:
    """verify and status share the engine's verdicts; only verify fails on a bad one."""
    from fp32patch.patcher.status import status as patch_status

    kwargs = {"spec_dir": specs, "command": command, "envs": envs or [], "as_json": as_json}
    listing = _listing(site_packages, envs, patch, specs, show_all)
    _run(patch_status, patch or [], site_packages or [], listing=listing, **kwargs)


@app.command()
def verify(
    site_packages: SitePackages = None,
    envs: Envs = None,
    patch: PatchIds = None,
    as_json: Json = False,
    specs: Specs = None,
    show_all: ShowAll = False,
) -> None:
    """Check that every installed target is patched and unchanged since (exit 1 if not)."""
    _status("verify", site_packages, envs, patch, as_json, specs, show_all)


@app.command()
def status(
    site_packages: SitePackages = None,
    envs: Envs = None,
    patch: PatchIds = None,
    as_json: Json = False,
    specs: Specs = None,
    show_all: ShowAll = False,
) -> None:
    """Show each patch's state in each import root (always exit 0 unless the input is bad)."""
    _status("status", site_packages, envs, patch, as_json, specs, show_all)


@app.command()
def revert(
    site_packages: SitePackages = None,
    envs: Envs = None,
    patch: PatchIds = None,
    force: Annotated[
        bool, typer.Option("--force", help="Also revert files changed since patching (their bytes are kept).")
    ] = False,
    against: Annotated[
        Path | None,
        typer.Option(
            "--against",
            help="The installed release's wheel, sdist or folder: restores the stock bytes of files patched with no "
            "record (state folder lost), and stands in for a lost kept original; only bytes it can prove.",
            show_default=False,
            metavar="WHEEL|SDIST|DIR",
        ),
    ] = None,
    as_json: Json = False,
    specs: Specs = None,
    show_all: ShowAll = False,
) -> None:
    """Restore the exact original bytes of patched files (sha256-checked)."""
    from fp32patch.patcher.revert import revert as revert_patches

    _run(
        revert_patches,
        patch or [],
        site_packages or [],
        force=force,
        spec_dir=specs,
        envs=envs or [],
        against=against,
        as_json=as_json,
        listing=_listing(site_packages, envs, patch, specs, show_all),
    )


@app.command()
def diff(
    site_packages: SitePackages = None,
    envs: Envs = None,
    patch: PatchIds = None,
    as_json: Json = False,
    specs: Specs = None,
    show_all: ShowAll = False,
) -> None:
    """Show each patch as a unified diff: the change it would make, or the one it made (stdout: the patch only)."""
    from fp32patch.patcher.diff import diff as patch_diff

    listing = _listing(site_packages, envs, patch, specs, show_all)
    kwargs = {"spec_dir": specs, "envs": envs or [], "as_json": as_json, "show_diff": True, "listing": listing}
    _run(patch_diff, patch or [], site_packages or [], **kwargs)


@app.command()
def check(
    against: Annotated[
        Path,
        typer.Option(
            "--against",
            help="The candidate release: a wheel (*.whl), an sdist (*.tar.gz, *.zip) or a folder "
            "(import root, source checkout, unpacked sdist).",
            show_default=False,
            metavar="WHEEL|SDIST|DIR",
        ),
    ],
    patch: PatchIds = None,
    as_json: Json = False,
    specs: Specs = None,
) -> None:
    """Before an upgrade: would each patch apply to this release? (exit 3 if an anchor drifted; nothing installed)."""
    from fp32patch.patcher.check import check as check_candidate

    _run(check_candidate, against, patch or [], spec_dir=specs, as_json=as_json)


@app.command(name="list")
def list_(site_packages: SitePackages = None, envs: Envs = None, as_json: Json = False, specs: Specs = None) -> None:
    """List the patches this fp32patch carries, and the release of each installed in the import roots."""
    from fp32patch.patcher.plan import installed, select_specs

    try:
        loaded = select_specs([], specs)
        where = installed(loaded, site_packages or [], envs or [])
    except UsageError as exc:
        _usage_error(str(exc), as_json)
    except OSError as exc:
        _usage_error(_os_error(exc), as_json)
    if as_json:
        rows = [
            {
                "id": s.id,
                "summary": s.summary,
                "target": f"{s.target.distribution}:{s.target.path}",
                "files": s.target.paths,
                "versions": str(s.target.versions),
                "variants": [{"name": v.name, "versions": str(v.versions)} for v in s.variants],
                "sha256": s.sha256,
                "installed": where[s.id],
            }
            for s in loaded
        ]
        print(json.dumps({"ok": True, "patches": rows}, indent=2))
        return
    table = Grid("patch", "target", "versions", "installed", "summary")
    for s in loaded:
        files = "\n".join(s.target.paths)
        here = "\n".join(
            f"{i['distribution']} {i['version'] or '(version unknown)'}"
            + (f" ({i['variant']})" if i["variant"] else "")
            for i in where[s.id]
        )
        table.add_row(
            s.id, f"{s.target.distribution}:{files}", str(s.target.versions) or "any", here or "-", escape(s.summary)
        )
    table.print(out)


@app.command()
def ops(as_json: Json = False) -> None:
    """List the operations a spec's edits can use, with their fields."""
    from fp32patch.patcher.vocabulary import EDIT_FIELDS, OPERATIONS

    common = ("id", "op", "file", "code", "code_file", "count", "skip_when")
    if as_json:
        rows = [
            {"name": op.name, "description": op.description, "fields": [*common, *op.fields]}
            for op in OPERATIONS.values()
        ]
        print(json.dumps({"ok": True, "operations": rows, "fields": EDIT_FIELDS}, indent=2))
        return
    table = Grid("operation", "what it does", "anchor fields")
    for op in OPERATIONS.values():
        table.add_row(op.name, escape(op.description), ", ".join(op.fields) or "-")
    table.print(out)
    out.print(f"\nEvery edit has: {', '.join(common)}.\n", soft_wrap=True)
    fields = Grid("field", "meaning")
    for name, meaning in EDIT_FIELDS.items():
        fields.add_row(name, escape(meaning))
    fields.print(out)


def _version(value: bool) -> None:
    if value:
        print(f"fp32patch {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[
        bool | None, typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = None,
) -> None:
    """fp32 LM-head logits for vLLM, SGLang, NeMo-RL, verl, TRL, OpenRLHF, slime, Prime-RL, AReaL and SkyRL, patched in at image-build time."""


def main() -> None:
    _catch_ctrl_c()
    try:
        app()
    except KeyboardInterrupt:  # typer turns most into exit 130 itself: this is Ctrl-C outside a command
        message = f"interrupted (Ctrl-C) while no file was being written; exit {EXIT_INTERRUPTED}"
        if _wants_json(sys.argv[1:]):
            _json_error(message)
        err.print(message, soft_wrap=True)
        sys.exit(EXIT_INTERRUPTED)


if _sigint is not None and not _as_command():
    signal.signal(signal.SIGINT, _sigint)
