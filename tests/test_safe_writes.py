"""What apply and revert do to the disk: hardlinks, bytecode, RECORD, modes, all-or-nothing."""

from __future__ import annotations

import importlib.machinery
import os
import py_compile
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fp32patch.patcher import transaction
from tests.conftest import LOGITS_PROCESSOR, NEMOTRON, sha, tree_digest
from tests.support.pypi import import_root_from_members, pip_install_target

pytestmark = pytest.mark.network


@pytest.fixture(scope="module")
def full_root(tmp_path_factory) -> Path:
    """vLLM 0.25.1 (the release NeMo-RL pins) installed whole with pip --target."""
    return pip_install_target("vllm", "0.25.1", tmp_path_factory.mktemp("full") / "site-packages")


@pytest.fixture
def root(full_root, tmp_path) -> Path:
    """A private copy of the full install (hardlinks: the files are shared, the names are not)."""
    dest = tmp_path / "site-packages"
    shutil.copytree(full_root, dest, copy_function=os.link)
    return dest


def test_full_install_round_trip_touches_only_the_targets(root, cli):
    before = tree_digest(root)
    record = root / "vllm-0.25.1.dist-info" / "RECORD"
    assert cli("apply", "-s", root).exit_code == 0
    after = tree_digest(root)
    changed = {p for p in before if before[p] != after.get(p)}
    added = {p.split("/")[0] for p in set(after) - set(before)}
    assert changed == {NEMOTRON, LOGITS_PROCESSOR, "vllm-0.25.1.dist-info/RECORD"}
    assert added == {".fp32patch"}
    # RECORD now vouches for the patched bytes, as `pip` would have written it
    for target in (NEMOTRON, LOGITS_PROCESSOR):
        row = next(line for line in record.read_text().splitlines() if line.startswith(target + ","))
        data = (root / target).read_bytes()
        assert row == f"{target},{transaction.record_hash(data)},{len(data)}"

    assert cli("revert", "-s", root).exit_code == 0
    final = tree_digest(root)
    assert {p: h for p, h in final.items() if not p.startswith(".fp32patch")} == before


def test_hardlinked_target_other_link_untouched(full_root, root, cli):
    shared = full_root / NEMOTRON
    assert os.stat(shared).st_ino == os.stat(root / NEMOTRON).st_ino  # one file, two names
    pristine = sha(shared)
    assert cli("apply", "-s", root).exit_code == 0
    assert sha(shared) == pristine and os.stat(shared).st_ino != os.stat(root / NEMOTRON).st_ino
    assert cli("revert", "-s", root).exit_code == 0
    assert sha(shared) == pristine == sha(root / NEMOTRON)


def _loaded_code_names(path: Path) -> set[str]:
    """The names in the code object Python's import system would load for ``path``."""
    loader = importlib.machinery.SourceFileLoader("nemotron_h_probe", str(path))
    code = loader.get_code("nemotron_h_probe")
    return {c.co_name for c in code.co_consts if hasattr(c, "co_name")}


def test_stale_unchecked_pyc_cannot_hide_the_edit(tmp_path, cli):
    root = import_root_from_members("vllm", "0.33.0", [NEMOTRON], tmp_path / "sp")
    target = root / NEMOTRON
    # a pyc that Python will trust without looking at the source again
    pyc = importlib.util.cache_from_source(str(target))
    py_compile.compile(str(target), cfile=pyc, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    other = Path(pyc).with_name("nemotron_h.cpython-399.pyc")  # another interpreter's
    shutil.copy(pyc, other)
    assert "_fp32patch_lm_head_runtime" not in _loaded_code_names(target)

    assert cli("apply", "-s", root).exit_code == 0
    assert "_fp32patch_lm_head_runtime" in _loaded_code_names(target)
    assert not other.exists()
    # what is cached now checks its source hash
    flags = int.from_bytes(Path(pyc).read_bytes()[4:8], "little")
    assert flags == 0b11  # hash-based, checked

    assert cli("revert", "-s", root).exit_code == 0
    assert "_fp32patch_lm_head_runtime" not in _loaded_code_names(target)


def test_negative_control_plain_write_is_hidden_by_stale_pyc(tmp_path):
    """Without the refresh, the stale bytecode wins: the test above is not vacuous."""
    root = import_root_from_members("vllm", "0.33.0", [NEMOTRON], tmp_path / "sp")
    target = root / NEMOTRON
    pyc = importlib.util.cache_from_source(str(target))
    py_compile.compile(str(target), cfile=pyc, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    target.write_bytes(
        target.read_bytes().replace(
            b"class NemotronHForCausalLM", b"def _edited(): pass\n\n\nclass NemotronHForCausalLM", 1
        )
    )
    assert "_edited" not in _loaded_code_names(target)


def test_file_mode_kept(tmp_path, cli):
    root = import_root_from_members("vllm", "0.33.0", [NEMOTRON], tmp_path / "sp")
    target = root / NEMOTRON
    os.chmod(target, 0o640)
    assert cli("apply", "-s", root).exit_code == 0
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640
    assert cli("revert", "-s", root).exit_code == 0
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o640


def test_failed_write_rolls_back_everything(tmp_path, monkeypatch):
    """A failure after the first file is replaced puts every file (and the manifest) back."""
    from fp32patch.patcher.manifest import Manifest
    from fp32patch.patcher.transaction import Transaction, Write

    root = tmp_path / "root"
    (root / "pkg").mkdir(parents=True)
    files = {f"pkg/m{i}.py": f"x = {i}\n".encode() for i in range(3)}
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    before = tree_digest(root)

    calls = {"n": 0}
    real = transaction.atomic_write

    def flaky(path, data, **kw):
        if path.name == "m1.py" and data.startswith(b"y"):
            raise OSError(28, "No space left on device", str(path))
        calls["n"] += 1
        return real(path, data, **kw)

    monkeypatch.setattr(transaction, "atomic_write", flaky)
    writes = [Write(rel, data, b"y" + data, []) for rel, data in files.items()]
    tx = Transaction(root)
    with tx.state.lock(), pytest.raises(OSError, match="No space"):
        tx.commit(writes, Manifest())
    after = tree_digest(root)
    assert {p: h for p, h in after.items() if not p.startswith(".fp32patch")} == before


def test_console_script_and_module_entry_points(tmp_path):
    exe = Path(sys.executable).with_name("fp32patch")
    for argv in ([str(exe), "--version"], [sys.executable, "-m", "fp32patch", "--version"]):
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        assert out.startswith("fp32patch ")
