"""A stack patch's release lifecycle beside vLLM's patches: apply, the stack's own checks, verify,
apply again (nothing changes), revert to every byte, verify (not applied).

The release tests of verl, TRL and OpenRLHF call ``lifecycle`` with their own checks of the patched
files (``check(originals, patched)``: the edits where they belong, the gates off and on); the gates
run through ``gate_namespace``."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from tests.conftest import tree_digest


def outside_state(root: Path) -> dict[str, str]:
    """Every file's digest under ``root`` but fp32patch's state folder."""
    return {k: v for k, v in tree_digest(root).items() if not k.startswith(".fp32patch")}


def lifecycle(
    cli,
    root: Path,
    *,
    spec: str,
    version: str,
    variant: str,
    vllm: str,
    vllm_specs: Iterable[str],
    paths: Iterable[str],
    check: Callable[[Mapping[str, bytes], Mapping[str, bytes]], None],
) -> None:
    vllm_specs = tuple(vllm_specs)
    before = outside_state(root)
    originals = {p: (root / p).read_bytes() for p in paths if (root / p).exists()}

    code, out = cli.json("apply", "-s", root)
    assert code == 0, out
    entries = {p["id"]: p for p in out["patches"]}
    assert (entries[spec]["status"], entries[spec]["version"], entries[spec]["variant"]) == (
        "applied",
        version,
        variant,
    )
    for other in vllm_specs:
        assert (entries[other]["status"], entries[other]["version"]) == ("applied", vllm), entries[other]
    patched = {p: (root / p).read_bytes() for p in originals}

    check(originals, patched)

    code, out = cli.json("verify", "-s", root)
    assert code == 0 and out["ok"], out
    statuses = {p["id"]: p["status"] for p in out["patches"] if p["id"] in (spec, *vllm_specs)}
    assert statuses == dict.fromkeys((spec, *vllm_specs), "applied")

    manifest = (root / ".fp32patch" / "manifest.json").read_bytes()
    code, out = cli.json("apply", "-s", root)
    assert code == 0 and {p["id"]: p["status"] for p in out["patches"]}[spec] == "already-applied"
    assert {p: (root / p).read_bytes() for p in originals} == patched
    assert (root / ".fp32patch" / "manifest.json").read_bytes() == manifest

    reverted = cli("revert", "-s", root)
    assert reverted.exit_code == 0, reverted.stdout + reverted.stderr
    assert outside_state(root) == before  # every byte, the dist-info's RECORD included
    code, out = cli.json("verify", "-s", root)
    assert code == 1 and {p["id"]: p["status"] for p in out["patches"]}[spec] == "not-applied"


def checkout_rounds(cli, root: Path, *, spec: str, patched: Mapping[str, str], drift: str, before) -> None:
    """The rest of one patch's lifecycle on a checkout it was just applied to (``patched``: the
    files as apply wrote them; ``before``: ``outside_state`` before apply): verify says applied,
    apply again changes nothing (files and manifest), a local edit of ``drift`` reads drifted,
    revert gives every byte back and verify then says not-applied."""
    code, out = cli.json("verify", "-s", root, "--patch", spec)
    assert code == 0 and out["patches"][0]["status"] == "applied", out
    manifest = (root / ".fp32patch" / "manifest.json").read_bytes()
    code, out = cli.json("apply", "-s", root, "--patch", spec)
    assert code == 0 and out["patches"][0]["status"] == "already-applied"
    assert {p: (root / p).read_text() for p in patched} == dict(patched)
    assert (root / ".fp32patch" / "manifest.json").read_bytes() == manifest

    (root / drift).write_text(patched[drift] + "\n# a local edit\n")
    code, out = cli.json("verify", "-s", root, "--patch", spec)
    assert code == 1 and out["patches"][0]["status"] == "drifted", out
    (root / drift).write_text(patched[drift])

    result = cli("revert", "-s", root, "--patch", spec)
    assert result.exit_code == 0, result.stdout + result.stderr
    assert outside_state(root) == before
    code, out = cli.json("verify", "-s", root, "--patch", spec)
    assert code == 1 and out["patches"][0]["status"] == "not-applied"


def drifted_then_forced(cli, root: Path, *, spec: str, paths: Iterable[str], edit: str) -> None:
    """``spec`` applied on ``root``, then a local change to ``edit``: verify says drifted, revert
    refuses (exit 3), ``revert --force`` gives back every byte of ``paths`` as they were before apply."""
    originals = {p: (root / p).read_bytes() for p in paths}
    code, out = cli.json("apply", "-s", root, "--patch", spec)
    assert code == 0, out
    target = root / edit
    target.write_bytes(target.read_bytes() + b"\n# a local change\n")
    code, out = cli.json("verify", "-s", root, "--patch", spec)
    assert code == 1 and out["patches"][0]["status"] == "drifted", out
    assert cli("revert", "-s", root, "--patch", spec).exit_code == 3
    assert cli("revert", "-s", root, "--patch", spec, "--force").exit_code == 0
    assert {p: (root / p).read_bytes() for p in originals} == originals


def gate_namespace(source: bytes) -> tuple[dict[str, Any], list[str]]:
    """The gate's functions of a patched file (its ``_fp32patch_*`` defs), run in a namespace
    whose imports are recorded: ``(namespace, names imported so far)``."""
    defs = [
        n
        for n in ast.parse(source).body
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("_fp32patch_")
    ]
    imported: list[str] = []
    real_import = builtins.__import__

    def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
        imported.append(name)
        return real_import(name, globals, locals, fromlist, level)

    namespace: dict[str, Any] = {"__builtins__": {**vars(builtins), "__import__": recording_import}}
    exec(compile(ast.Module(body=defs, type_ignores=[]), "gate", "exec"), namespace)  # noqa: S102
    return namespace, imported


def without_ours(node: ast.AST, is_ours: Callable[[ast.stmt], bool]) -> tuple[ast.AST, int]:
    """``node`` with the statements a patch inserted (``is_ours``) taken out, in every block at any
    depth (before looking inside), and how many statements that was."""
    removed = 0
    for field in ("body", "orelse", "finalbody", "handlers"):
        stmts = getattr(node, field, None)
        if isinstance(stmts, list):
            kept = [s for s in stmts if not (isinstance(s, ast.stmt) and is_ours(s))]
            removed += len(stmts) - len(kept)
            setattr(node, field, kept)
            removed += sum(without_ours(s, is_ours)[1] for s in kept)
    return node, removed


def neighbour(scope: ast.AST, anchor: str, where: str) -> str:
    """The statement right after (``where`` "after"), before ("before") or at ("at") the one
    statement in ``scope``, at any depth, that starts with ``anchor``."""
    hits = []
    for node in ast.walk(scope):
        for field in ("body", "orelse", "finalbody"):
            body = getattr(node, field, None)
            if isinstance(body, list):
                hits += [(body, i) for i, s in enumerate(body) if ast.unparse(s).startswith(anchor)]
    assert len(hits) == 1, (anchor, len(hits))
    body, i = hits[0]
    return ast.unparse(body[{"after": i + 1, "before": i - 1, "at": i}[where]])
