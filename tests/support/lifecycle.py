"""A stack patch's release lifecycle beside vLLM's patches: apply, the stack's own checks, verify,
apply again (nothing changes), revert to every byte, verify (not applied).

The release tests of verl and TRL call ``lifecycle`` with their own checks of the patched files
(``check(originals, patched)``: the edits where they belong, the gates off and on)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

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
