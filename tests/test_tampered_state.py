"""The state folder is input too: tampering can never make fp32patch read or write outside the root.

Each case tampers with a patched (or pristine) root, points whatever it can at a folder
outside the root, runs the commands, and checks that the outside folder is byte-identical,
that the target is left as it was unless the command legitimately restored checked bytes,
and that the message says what was refused and where.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from fp32patch.patcher.apply import apply as apply_patches
from fp32patch.patcher.spec import load_specs
from tests.conftest import NEMOTRON, tree_digest
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

STATE = ".fp32patch"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return import_root_from_members("vllm", "0.33.0", [NEMOTRON], tmp_path_factory.mktemp("pristine") / "sp")


@pytest.fixture(scope="module")
def patched(pristine, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("patched") / "sp"
    shutil.copytree(pristine, root)
    assert apply_patches([], [root]).ok
    return root


def _entry_change(**fields) -> Callable[[Path, Path], None]:
    def tamper(root: Path, outside: Path) -> None:
        path = root / STATE / "manifest.json"
        data = json.loads(path.read_text())
        data["entries"][0].update(fields)
        path.write_text(json.dumps(data))

    return tamper


def _original_sha(root: Path) -> str:
    return json.loads((root / STATE / "manifest.json").read_text())["entries"][0]["sha256_before"]


def _swap_for_symlink(rel: str, *, keep_content: bool) -> Callable[[Path, Path], None]:
    """Move ``rel`` (in the state folder) outside and leave a symlink to it."""

    def tamper(root: Path, outside: Path) -> None:
        src = root / STATE / rel
        dest = outside / src.name
        if src.exists():
            shutil.move(src, dest)
        elif keep_content:
            raise AssertionError(src)
        else:
            dest.write_text("outside")
        if not keep_content and dest.is_file():
            dest.write_bytes(b"bytes an attacker chose\n")
        src.symlink_to(dest)

    return tamper


def _kept_original_symlinked(keep_content: bool) -> Callable[[Path, Path], None]:
    def tamper(root: Path, outside: Path) -> None:
        kept = root / STATE / "originals" / _original_sha(root)
        dest = outside / "planted"
        dest.write_bytes(kept.read_bytes() if keep_content else b"# planted\n")
        kept.unlink()
        kept.symlink_to(dest)

    return tamper


def _kept_original_changed(root: Path, outside: Path) -> None:
    kept = root / STATE / "originals" / _original_sha(root)
    kept.write_bytes(kept.read_bytes() + b"import os; os.system('echo owned')\n")


def _record_symlinked(root: Path, outside: Path) -> None:
    record = root / "vllm-0.33.0.dist-info" / "RECORD"
    dest = outside / "RECORD"
    shutil.copy(record, dest)
    record.unlink()
    record.symlink_to(dest)


def _pending_entry_through_symlink(root: Path, outside: Path) -> None:
    """An interrupted entry whose path leads, through a symlinked folder, to a file outside."""
    (outside / "pkg").mkdir()
    victim = outside / "pkg" / "m.py"
    victim.write_text("x = 1\n")
    (outside / "pkg" / ".m.py.abcdefgh.fp32patch-tmp").write_text("not ours to delete")
    (root / "evil").symlink_to(outside / "pkg")
    path = root / STATE / "manifest.json"
    data = json.loads(path.read_text())
    entry = dict(data["entries"][0])
    entry.update(
        path="evil/m.py",
        state="pending",
        sha256_before=hashlib.sha256(b"x = 1\n").hexdigest(),
        sha256_after=hashlib.sha256(b"x = 1\n").hexdigest(),
    )
    data["entries"].append(entry)
    path.write_text(json.dumps(data))


def _temp_name_symlinked(root: Path, outside: Path) -> None:
    """A file named like our temp files, but a symlink to something outside: never followed or removed."""
    (outside / "precious").write_text("keep me\n")
    folder = (root / NEMOTRON).parent
    (folder / ".nemotron_h.py.abcdefgh.fp32patch-tmp").symlink_to(outside / "precious")


# name -> (start, tamper, {command: exit code}, message needle ("$ROOT", "$OUT" expand), target afterwards)
CASES: dict[str, tuple] = {
    "manifest path with ..": (
        "patched",
        _entry_change(path="../outside/nemotron_h.py"),
        {"revert": 2, "apply": 2, "verify": 2},
        "entries[0].path: '../outside/nemotron_h.py' is not a relative path inside the import root",
        "patched",
    ),
    "manifest path absolute": (
        "patched",
        _entry_change(path="/etc/passwd"),
        {"revert": 2, "apply": 2, "verify": 2},
        "entries[0].path: '/etc/passwd' is not a relative path inside the import root",
        "patched",
    ),
    "manifest record escaping": (
        "patched",
        _entry_change(record="../outside/RECORD"),
        {"revert": 2, "apply": 2},
        "entries[0].record: '../outside/RECORD' is not a relative path inside the import root",
        "patched",
    ),
    "manifest record not a RECORD": (
        "patched",
        _entry_change(record="vllm/__init__.py"),
        {"revert": 2},
        "entries[0].record: 'vllm/__init__.py' is not a top-level *.dist-info/RECORD",
        "patched",
    ),
    "manifest backup hash is not a sha256": (
        "patched",
        _entry_change(sha256_before="../../outside/planted"),
        {"revert": 2},
        "entries[0].sha256_before: expected a sha256 hex digest",
        "patched",
    ),
    "kept original changed": (
        "patched",
        _kept_original_changed,
        {"revert": 3, "diff": 2, "verify": 1},  # verify fails where revert would refuse
        "does not match its recorded sha256",
        "patched",
    ),
    "kept original is a symlink to the right bytes outside": (
        "patched",
        _kept_original_symlinked(True),
        {"revert": 3, "verify": 1},
        "is a symbolic link; refusing to follow it",
        "patched",
    ),
    "kept original is a symlink to other bytes outside": (
        "patched",
        _kept_original_symlinked(False),
        {"revert": 3, "verify": 1},
        "is a symbolic link; refusing to follow it",
        "patched",
    ),
    "state folder is a symlink": (
        "pristine",
        lambda r, o: ((o / "state").mkdir(), (r / STATE).symlink_to(o / "state"))[-1],
        {"apply": 2, "verify": 2, "revert": 2},
        "$ROOT/.fp32patch is a symbolic link; refusing to use it as fp32patch state",
        "original",
    ),
    "originals folder is a symlink": (
        "patched",
        _swap_for_symlink("originals", keep_content=True),
        {"revert": 2},
        "$ROOT/.fp32patch/originals is a symbolic link",
        "patched",
    ),
    "originals folder is a symlink (fresh apply)": (
        "pristine",
        lambda r, o: (
            (r / STATE).mkdir(),
            (o / "originals").mkdir(),
            (r / STATE / "originals").symlink_to(o / "originals"),
        )[-1],
        {"apply": 2},
        "$ROOT/.fp32patch/originals is a symbolic link",
        "original",
    ),
    "displaced folder is a symlink": (
        "patched",
        lambda r, o: (
            (o / "displaced").mkdir(),
            (r / STATE / "displaced").symlink_to(o / "displaced"),
            (r / NEMOTRON).write_bytes((r / NEMOTRON).read_bytes() + b"# hand edit\n"),
        )[-1],
        {"revert --force": 2},
        "$ROOT/.fp32patch/displaced is a symbolic link",
        "edited",
    ),
    "lock is a symlink": (
        "patched",
        _swap_for_symlink("lock", keep_content=False),
        {"revert": 2, "apply": 0},  # apply has nothing to write, so takes no lock
        "$ROOT/.fp32patch/lock is a symbolic link",
        "patched",
    ),
    "manifest is a symlink": (
        "patched",
        _swap_for_symlink("manifest.json", keep_content=True),
        {"revert": 2, "verify": 2, "apply": 2},
        "$ROOT/.fp32patch/manifest.json is a symbolic link; refusing to follow it",
        "patched",
    ),
    "RECORD is a symlink out of the root": (
        "pristine",
        _record_symlinked,
        {"apply": 2},
        "RECORD is (or is inside) a symbolic link; refusing to rewrite it",
        "original",
    ),
    "interrupted entry leading out through a symlinked folder": (
        "patched",
        _pending_entry_through_symlink,
        {"apply": 0, "revert": 0},
        "",
        "original",  # after revert
    ),
    "a temp-file name that is a symlink": (
        "patched",
        _temp_name_symlinked,
        {"revert": 0},
        "",
        "original",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tampered_state(name, pristine, patched, tmp_path, cli):
    start, tamper, codes, needle, expect = CASES[name]
    root = tmp_path / "sp"
    shutil.copytree(pristine if start == "pristine" else patched, root, symlinks=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    tamper(root, outside)
    before_outside = tree_digest(outside)
    target_before = (root / NEMOTRON).read_bytes()
    needle = needle.replace("$ROOT", str(root)).replace("$OUT", str(outside))
    for command, code in codes.items():
        result = cli(*command.split(), "-s", root)
        text = " ".join((result.stdout + result.stderr).split())
        assert result.exit_code == code, (command, text)
        assert tree_digest(outside) == before_outside, f"{command} touched a file outside the root"
        if code != 0:
            assert needle in text, (command, needle, text)
            assert (root / NEMOTRON).read_bytes() == target_before, f"{command} changed the target"
    data = (root / NEMOTRON).read_bytes()
    forms = {"original": (pristine / NEMOTRON).read_bytes(), "patched": (patched / NEMOTRON).read_bytes()}
    assert data == forms.get(expect, target_before)


def test_revert_restores_only_bytes_matching_the_record(patched, tmp_path, cli):
    """Even a kept original that is swapped for other bytes under the same name is never written."""
    root = tmp_path / "sp"
    shutil.copytree(patched, root)
    kept = root / STATE / "originals" / _original_sha(root)
    good = kept.read_bytes()
    kept.write_bytes(good.replace(b"class NemotronHForCausalLM", b"class Owned", 1))
    code, out = cli.json("revert", "-s", root)
    assert code == 3 and out["patches"][0]["status"] == "error"
    assert f"the kept original {kept} does not match its recorded sha256" in out["patches"][0]["message"]
    kept.write_bytes(good)  # put back the right bytes: now it reverts
    assert cli("revert", "-s", root).exit_code == 0
    assert hashlib.sha256((root / NEMOTRON).read_bytes()).hexdigest() == kept.name


def test_specs_load_only_from_the_package_or_a_named_folder(tmp_path):
    """A spec planted in the working directory or in the import root is never read."""
    evil = (
        'schema = 1\nid = "evil"\nsummary = "planted"\n[target]\ndistribution = "vllm"\n'
        'path = "vllm/__init__.py"\n[[edits]]\nid = "e"\nop = "insert_after_imports"\ncode = "import os"\n'
    )
    for folder in (tmp_path / "fp32patch" / "patches", tmp_path / STATE / "specs", tmp_path / "patches"):
        folder.mkdir(parents=True)
        (folder / "evil.toml").write_text(evil)
    (tmp_path / "fp32patch" / "__init__.py").write_text("")
    exe = shutil.which("fp32patch", path=str(Path(os.sys.executable).parent))
    assert exe is not None
    out = subprocess.run([exe, "list", "--json"], cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    shipped = sorted(s.id for s in load_specs())
    assert sorted(p["id"] for p in json.loads(out)["patches"]) == shipped and "evil" not in shipped
    named = subprocess.run(
        [exe, "list", "--json", "--specs", str(tmp_path / "patches")], capture_output=True, text=True, check=True
    )
    assert [p["id"] for p in json.loads(named.stdout)["patches"]] == ["evil"]  # only when named explicitly
