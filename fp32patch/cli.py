"""The ``fp32patch`` command: parse, call the engine, render. Nothing else lives here.

Results go to stdout (tables, diffs, or one JSON object with ``--json``); diagnostics go
to stderr. Colour follows the terminal and ``NO_COLOR``. Exit codes: 0 success, 1 verify
found a problem, 2 bad usage or input (nothing written), 3 a patch cannot be applied
(nothing written).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.syntax import Syntax
from rich.table import Table

from fp32patch import __version__
from fp32patch.patcher import engine
from fp32patch.patcher.spec import SpecError

app = typer.Typer(
    name="fp32patch",
    help="Patch vLLM and NeMo-RL sources so both engines compute the LM head in fp32.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(highlight=False)
err = Console(stderr=True, highlight=False)
# Piped output is read by people in CI logs and by tools: give tables room, keep diffs raw.
for _console in (out, err):
    if not _console.is_terminal:
        _console.width = 200

SitePackages = Annotated[
    list[Path] | None,
    typer.Option(
        "--site-packages",
        "-s",
        help="An import root (site-packages, a `pip install --target` folder, a source checkout). "
        "Repeatable. Default: this interpreter's site-packages.",
        show_default=False,
    ),
]
Envs = Annotated[
    list[Path] | None,
    typer.Option(
        "--envs",
        help="A folder holding Python environments (venv, virtualenv, uv, conda; e.g. Ray's runtime_resources): "
        "every environment under it is an import root, reported one by one. Repeatable; adds to -s.",
        show_default=False,
    ),
]
PatchIds = Annotated[
    list[str] | None,
    typer.Option("--patch", "-p", help="Only this patch id (repeatable). Default: every patch.", show_default=False),
]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object for machines.")]
Specs = Annotated[
    Path | None,
    typer.Option(
        "--specs", help="Load specs from this folder instead of the ones shipped with fp32patch.", show_default=False
    ),
]

_STYLE = {
    "applied": "green",
    "already-applied": "green",
    "reverted": "green",
    "would-apply": "cyan",
    "obsolete": "blue",
    "not-installed": "dim",
    "not-applied": "yellow",
    "drifted": "red",
    "outdated": "yellow",
}


_GOOD = {"applied", "already-applied", "reverted", "would-apply", "obsolete", "not-installed"}
_QUIET = {"applied", "already-applied", "not-installed"}


def _status_cell(status: str) -> str:
    return f"[{_STYLE.get(status, 'bold red')}]{status}[/]"


def _print_diff(text: str) -> None:
    if out.is_terminal and not out.no_color:
        out.print(Syntax(text, "diff", theme="ansi_dark", background_color="default", word_wrap=True))
    else:  # byte-exact, so `fp32patch diff > change.patch` is a patch
        out.file.write(text)
        out.file.flush()


def _render(report: engine.Report, *, as_json: bool, show_diff: bool = False, envs: list[Path] | None = None) -> None:
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        candidate = report.extra.get("candidate")
        if candidate:
            release = " ".join(str(candidate[k]) for k in ("distribution", "version") if candidate.get(k))
            out.print(f"checking {release or 'a folder'} ({candidate['kind']} {candidate['path']})", soft_wrap=True)
        bases = [Path(e).absolute() for e in envs or []]
        if bases:
            out.print("environments under " + ", ".join(map(str, bases)), soft_wrap=True)
        if report.outcomes:
            out.print(_table(report.outcomes, bases))
        roots = report.by_root()
        if len(roots) > 1:  # many environments: the totals, so a long table need not be read to the end
            totals: dict[str, int] = {}
            for o in report.outcomes:
                totals[o.status] = totals.get(o.status, 0) + 1
            out.print(f"{len(roots)} import roots: " + ", ".join(f"{n} {s}" for s, n in totals.items()))
        for o in report.outcomes:
            # quiet statuses speak up when they are the problem (check: the file is gone upstream)
            loud = (
                o.status not in _QUIET
                or o.details.get("interrupted")
                or (o.status == "not-installed" and not report.ok)
            )
            if o.message and loud:
                where = f" in {o.root}" if len(roots) > 1 else ""
                (out if o.status in _GOOD else err).print(
                    f"[bold]{o.patch}[/] ({o.status}){where}: {o.message}", soft_wrap=True
                )
            if show_diff and o.diff:
                _print_diff(o.diff)
        for note in report.notes:
            err.print(note)
    raise typer.Exit(report.exit_code)


def _label(o: engine.Outcome, bases: list[Path]) -> str:
    """How a root is named in a grouped table: an environment relative to its --envs folder."""
    if o.status == "not-installed" and os.pathsep in o.root:
        return f"(none of {o.root.count(os.pathsep) + 1} roots)"
    for base in bases:
        if o.env and Path(o.env).is_relative_to(base):
            return Path(o.env).relative_to(base).as_posix() or "."
    return o.env or o.root


def _table(outcomes: list[engine.Outcome], bases: list[Path]) -> Table:
    """One row per patch and root; with several roots, grouped by root, file paths relative to it."""
    roots = list(dict.fromkeys(o.root for o in outcomes))
    grouped = len(roots) > 1
    table = Table(show_edge=False, pad_edge=False)
    # an environment found by --envs is named by its folder (its site-packages is in --json)
    first = "environment" if grouped and all(o.env or os.pathsep in o.root for o in outcomes) else "root"
    for column in ([first] if grouped else []) + ["patch", "status", "version", "file"]:
        table.add_column(column, overflow="fold")
    for root in roots:
        rows = [o for o in outcomes if o.root == root]
        for i, o in enumerate(rows):
            if o.path and grouped and o.path.startswith(root + "/"):
                where = o.path[len(root) + 1 :]
            else:
                where = o.path or (o.target if grouped else f"{o.target} (looked in {o.root})")
            cells = [o.patch, _status_cell(o.status), o.version or "-", where]
            label = _label(o, bases) if i == 0 else ""
            table.add_row(*([label] if grouped else []), *cells, end_section=grouped and i == len(rows) - 1)
    return table


def _run(fn, *args, as_json: bool = False, show_diff: bool = False, **kwargs) -> None:
    try:
        report = fn(*args, **kwargs)
    except (engine.UsageError, SpecError) as exc:
        if as_json:
            print(json.dumps({"ok": False, "error": str(exc), "patches": []}, indent=2))
        err.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        raise typer.Exit(engine.EXIT_USAGE) from None
    _render(report, as_json=as_json, show_diff=show_diff, envs=kwargs.get("envs") or [])


@app.command()
def apply(
    site_packages: SitePackages = None,
    envs: Envs = None,
    patch: PatchIds = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would change; write nothing.")] = False,
    as_json: Json = False,
    specs: Specs = None,
) -> None:
    """Apply the patches (all or none per import root; exit 3 and nothing written if an anchor is off)."""
    _run(
        engine.apply,
        patch or [],
        site_packages or [],
        dry_run=dry_run,
        spec_dir=specs,
        envs=envs or [],
        as_json=as_json,
        show_diff=dry_run,
    )


def _status(command: str, site_packages, envs, patch, as_json: bool, specs) -> None:
    """verify and status share the engine's verdicts; only verify fails on a bad one."""
    kwargs = {"spec_dir": specs, "command": command, "envs": envs or [], "as_json": as_json}
    _run(engine.status, patch or [], site_packages or [], **kwargs)


@app.command()
def verify(
    site_packages: SitePackages = None,
    envs: Envs = None,
    patch: PatchIds = None,
    as_json: Json = False,
    specs: Specs = None,
) -> None:
    """Check that every installed target is patched and unchanged since (exit 1 if not)."""
    _status("verify", site_packages, envs, patch, as_json, specs)


@app.command()
def status(
    site_packages: SitePackages = None,
    envs: Envs = None,
    patch: PatchIds = None,
    as_json: Json = False,
    specs: Specs = None,
) -> None:
    """Show each patch's state in each import root (always exit 0 unless the input is bad)."""
    _status("status", site_packages, envs, patch, as_json, specs)


@app.command()
def revert(
    site_packages: SitePackages = None,
    envs: Envs = None,
    patch: PatchIds = None,
    force: Annotated[
        bool, typer.Option("--force", help="Also revert files changed since patching (their bytes are kept).")
    ] = False,
    as_json: Json = False,
    specs: Specs = None,
) -> None:
    """Restore the exact original bytes of patched files (sha256-checked)."""
    _run(engine.revert, patch or [], site_packages or [], force=force, spec_dir=specs, envs=envs or [], as_json=as_json)


@app.command()
def diff(
    site_packages: SitePackages = None,
    envs: Envs = None,
    patch: PatchIds = None,
    as_json: Json = False,
    specs: Specs = None,
) -> None:
    """Show each patch as a unified diff: the change it would make, or the one it made."""
    _run(
        engine.diff, patch or [], site_packages or [], spec_dir=specs, envs=envs or [], as_json=as_json, show_diff=True
    )


@app.command()
def check(
    against: Annotated[
        Path,
        typer.Option(
            "--against",
            help="The candidate release: a wheel (*.whl), an sdist (*.tar.gz, *.zip) or a folder "
            "(import root, source checkout, unpacked sdist).",
            show_default=False,
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
def list_(as_json: Json = False, specs: Specs = None) -> None:
    """List the patches this fp32patch carries."""
    try:
        loaded = engine.spec_table(specs)
    except engine.UsageError as exc:
        err.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        raise typer.Exit(engine.EXIT_USAGE) from None
    if as_json:
        rows = [
            {
                "id": s.id,
                "summary": s.summary,
                "target": f"{s.target.distribution}:{s.target.path}",
                "versions": str(s.target.versions),
                "variants": [{"name": v.name, "versions": str(v.versions)} for v in s.variants],
                "sha256": s.sha256,
            }
            for s in loaded
        ]
        print(json.dumps({"ok": True, "patches": rows}, indent=2))
        return
    table = Table(show_edge=False, pad_edge=False)
    for column in ("patch", "target", "versions", "summary"):
        table.add_column(column, overflow="fold")
    for s in loaded:
        table.add_row(s.id, f"{s.target.distribution}:{s.target.path}", str(s.target.versions) or "any", s.summary)
    out.print(table)


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
    """fp32patch: fp32 LM-head logits for NeMo-RL, patched in at image-build time."""


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        err.print("interrupted")
        sys.exit(130)
