"""Issue 37: the promises a hostile user's campaign broke, each class met as a user meets it.

Every test runs the real CLI (in-process, or ``python -m fp32patch`` where a signal, a kill, a
resource limit or another user is part of the case) on vLLM 0.25.1's own files, laid out as pip
lays them out (its two target files and its dist-info, RECORD included), and asserts what a user
sees: the exit code, the bytes on disk, the JSON.

1. a refusal (exit 2 or 3) writes nothing in any root of the run;
2. a file we patched and recorded that is gone is never ``not-installed``, and no command claims a
   restore it did not make;
3. bad input is exit 2 with a message, never a traceback;
4. a root with nothing of ours in it has no state folder, whatever stopped the last run;
5. a failure names the file and the error that failed, never a rollback of a file never changed,
   and the command it advises carries the roots it was given;
6. a verdict that refuses is reached under the root's lock;
7. under ``--json`` every failure is one JSON object;
8. revert gives back the RECORD it found, byte for byte.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from tests.conftest import LOGITS_PROCESSOR, NEMOTRON, default_sigint, tree_digest

pytestmark = pytest.mark.network

RECORD = "vllm-0.25.1.dist-info/RECORD"
LOGITS_ID = "vllm-fp32-logits"
NOBODY = 65534
REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP32PATCH_CRASH")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**env, **extra}


def _fp32patch(*args, prelude: str = "", user: int | None = None, fsize: int | None = None, **env):
    """``python -m fp32patch ARGS`` in a fresh process (after ``prelude``, Python run first in it)."""
    code = (
        f"{prelude}\nimport runpy, sys\nsys.argv[0] = 'fp32patch'\nrunpy.run_module('fp32patch', run_name='__main__')"
    )
    argv = [sys.executable, "-c", code, *map(str, args)]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]

    def in_child() -> None:
        default_sigint()
        if fsize is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))

    return subprocess.run(
        argv, capture_output=True, text=True, env=_env(**env), timeout=300, cwd="/", preexec_fn=in_child
    )


@contextlib.contextmanager
def immutable(*paths: Path):
    """``chattr +i``: not even root may replace, rename or unlink it (root passes permission bits)."""
    done = []
    try:
        for path in paths:
            if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
                pytest.skip("chattr +i is not available on this file system")
            done.append(path)
        yield
    finally:
        for path in done:
            subprocess.run(["chattr", "-i", str(path)], check=True)


@pytest.fixture
def public(tmp_path):
    """A folder another user can reach (pytest's own tmp folders are root's alone)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a command as another user")
    where = Path(tempfile.mkdtemp(prefix="fp32patch-rel-"))
    where.chmod(0o755)
    yield where
    shutil.rmtree(where)


def _copy(src: Path, dest: Path, owner: int | None = None) -> Path:
    shutil.copytree(src, dest)
    if owner is not None:
        for path in [dest, *dest.rglob("*")]:
            os.chown(path, owner, owner)
    return dest


def _json(result) -> dict:
    """The one JSON object stdout must hold."""
    return json.loads(result.stdout if hasattr(result, "stdout") else result)


def _status(out: dict, patch: str) -> dict:
    return next(p for p in out["patches"] if p["id"] == patch)


def _no_traceback(result) -> None:
    text = (result.stderr or "") + (result.stdout or "")
    assert "Traceback" not in text, text


# ---------------------------------------------------------------- 1. a refusal that wrote


def test_one_root_that_cannot_be_written_leaves_every_root_as_it_was(vllm_root, tmp_path, cli):
    """`apply -s A -s B` where B's target cannot be replaced: exit 2, and A is not patched either."""
    a = vllm_root
    b = shutil.copytree(vllm_root, tmp_path / "b")
    before = {a: tree_digest(a), b: tree_digest(b)}
    with immutable(b / LOGITS_PROCESSOR):
        code, out = cli.json("apply", "-s", a, "-s", b)
    assert code == 2 and not out["ok"]
    assert str(b / LOGITS_PROCESSOR) in out["error"] and "nothing was changed" in out["error"]
    assert {a: tree_digest(a), b: tree_digest(b)} == before  # no state folder either

    # and revert: B's patched file cannot be put back, so A keeps its patch too
    assert cli("apply", "-s", a, "-s", b).exit_code == 0
    patched = {a: tree_digest(a), b: tree_digest(b)}
    with immutable(b / LOGITS_PROCESSOR):
        code, out = cli.json("revert", "-s", a, "-s", b)
    assert code == 2 and str(b / LOGITS_PROCESSOR) in out["error"]
    assert {a: tree_digest(a), b: tree_digest(b)} == patched
    assert cli("verify", "-s", a, "-s", b).exit_code == 0


_SIGINT_WRITING_B = """
import os, signal
import fp32patch.patcher.transaction as _t
_refresh = _t.refresh_bytecode
_sent = []
def _refresh_then_ctrl_c(path):
    _refresh(path)
    if {b!r} in str(path) and not _sent:  # B's first file is replaced: A was written whole before it
        _sent.append(1)
        os.kill(os.getpid(), signal.SIGINT)
_t.refresh_bytecode = _refresh_then_ctrl_c
"""


def test_ctrl_c_in_the_second_root_puts_back_the_first(vllm_root, tmp_path):
    a = vllm_root
    b = shutil.copytree(vllm_root, tmp_path / "b")
    before = {a: tree_digest(a), b: tree_digest(b)}
    result = _fp32patch("apply", "-s", a, "-s", b, prelude=_SIGINT_WRITING_B.format(b=str(b)))
    assert result.returncode == 130
    assert f"while writing {b}: rolled back" in result.stderr
    assert {a: tree_digest(a), b: tree_digest(b)} == before


def test_unprivileged_user_refused_in_one_root_writes_in_none(vllm_root, public):
    """As a user who owns A but not B: exit 2 naming B, and A is untouched."""
    a = _copy(vllm_root, public / "a", owner=NOBODY)
    b = _copy(vllm_root, public / "b")  # root's: nobody may write there
    before = {a: tree_digest(a), b: tree_digest(b)}
    result = _fp32patch("apply", "-s", a, "-s", b, "--json", user=NOBODY)
    assert result.returncode == 2, result.stderr
    assert str(b) in _json(result)["error"]
    assert {a: tree_digest(a), b: tree_digest(b)} == before


def test_a_refused_revert_in_one_root_reverts_no_root(vllm_root, tmp_path, cli):
    """exit 3 means nothing written anywhere: a drifted file in B keeps A patched too."""
    a = vllm_root
    b = shutil.copytree(vllm_root, tmp_path / "b")
    assert cli("apply", "-s", a, "-s", b).exit_code == 0
    with (b / NEMOTRON).open("a") as fh:
        fh.write("# edited after patching\n")
    patched = {a: tree_digest(a), b: tree_digest(b)}
    code, out = cli.json("revert", "-s", a, "-s", b)
    assert code == 3
    assert {a: tree_digest(a), b: tree_digest(b)} == patched
    assert not any(p["status"] == "reverted" for p in out["patches"])


# ---------------------------------------------------------------- 2. "ok" over what is not there


def test_a_recorded_file_that_is_gone_is_never_not_installed(vllm_root, cli):
    assert cli("apply", "-s", vllm_root).exit_code == 0
    (vllm_root / LOGITS_PROCESSOR).unlink()
    gone = str(vllm_root / LOGITS_PROCESSOR)

    for command, expected in (("verify", 1), ("status", 0)):
        code, out = cli.json(command, "-s", vllm_root)
        assert code == expected
        row = _status(out, LOGITS_ID)
        assert row["status"] == "drifted" and gone in row["message"] and "gone" in row["message"]

    before = tree_digest(vllm_root)
    code, out = cli.json("apply", "-s", vllm_root)  # verify would not pass it: nothing is written
    assert code == 3 and _status(out, LOGITS_ID)["status"] == "drifted"
    code, out = cli.json("revert", "-s", vllm_root)
    assert code == 3 and _status(out, LOGITS_ID)["status"] == "drifted"
    assert tree_digest(vllm_root) == before

    code, out = cli.json("revert", "-s", vllm_root, "--force")
    assert code == 0
    row = _status(out, LOGITS_ID)
    assert row["status"] != "reverted" and "restored" not in row["message"] and "nothing to restore" in row["message"]
    assert not (vllm_root / LOGITS_PROCESSOR).exists()  # no restore claimed, none made
    assert not (vllm_root / ".fp32patch").exists()  # the record of it is gone with the rest
    code, out = cli.json("status", "-s", vllm_root)
    assert _status(out, LOGITS_ID)["status"] == "not-installed"


# ---------------------------------------------------------------- 3. tracebacks instead of exit 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("patch", ["vllm-fp32-logits"]), ("version", 25), ("distribution", 3), ("applied_at", 7), ("variant", [1])],
)
@pytest.mark.parametrize("command", ["verify", "status", "revert", "apply"])
def test_a_manifest_field_of_the_wrong_type_is_exit_2(vllm_root, cli, field, value, command):
    assert cli("apply", "-s", vllm_root).exit_code == 0
    manifest = vllm_root / ".fp32patch" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["entries"][0][field] = value
    manifest.write_text(json.dumps(data))
    before = tree_digest(vllm_root)
    code, out = cli.json(command, "-s", vllm_root)
    assert code == 2 and f"entries[0].{field}" in out["error"]
    assert tree_digest(vllm_root) == before


def test_a_deeply_nested_manifest_is_exit_2(vllm_root, cli):
    (vllm_root / ".fp32patch").mkdir()
    (vllm_root / ".fp32patch" / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    for command in ("verify", "revert", "apply"):
        code, out = cli.json(command, "-s", vllm_root)
        assert code == 2 and "manifest.json" in out["error"]


def test_a_deeply_nested_spec_is_exit_2(vllm_root, tmp_path, cli):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "deep.toml").write_text("edits = " + "[" * 50_000 + "]" * 50_000 + "\n")
    code, out = cli.json("verify", "-s", vllm_root, "--specs", specs)
    assert code == 2 and "deep.toml" in out["error"]


def _wheel_with_damaged_member(vllm_stock: Path, dest: Path) -> Path:
    """vLLM 0.25.1's METADATA and logits_processor.py in a wheel whose deflate data for that file is damaged."""
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as wheel:
        wheel.write(vllm_stock / "vllm-0.25.1.dist-info" / "METADATA", "vllm-0.25.1.dist-info/METADATA")
        wheel.write(vllm_stock / LOGITS_PROCESSOR, LOGITS_PROCESSOR)
    with zipfile.ZipFile(dest) as wheel:
        info = wheel.getinfo(LOGITS_PROCESSOR)
    data = bytearray(dest.read_bytes())
    name_len, extra_len = (
        int.from_bytes(data[info.header_offset + 26 : info.header_offset + 28], "little"),
        int.from_bytes(data[info.header_offset + 28 : info.header_offset + 30], "little"),
    )
    start = info.header_offset + 30 + name_len + extra_len
    data[start : start + 64] = b"\xff" * 64  # not a deflate stream any more
    dest.write_bytes(bytes(data))
    with zipfile.ZipFile(dest) as wheel, pytest.raises(Exception) as raised:  # noqa: PT011 - which one is the point
        wheel.read(LOGITS_PROCESSOR)
    assert raised.type.__module__ == "zlib"  # what a user's damaged download raises
    return dest


def test_a_wheel_with_damaged_data_is_exit_2(vllm_stock, vllm_root, tmp_path, cli):
    wheel = _wheel_with_damaged_member(vllm_stock, tmp_path / "vllm-0.25.1-py3-none-any.whl")
    code, out = cli.json("check", "--against", wheel)
    assert code == 2 and str(wheel) in out["error"]
    # revert --against: a patched file with no record, the release given to restore it is damaged
    assert cli("apply", "-s", vllm_root).exit_code == 0
    shutil.rmtree(vllm_root / ".fp32patch")
    before = tree_digest(vllm_root)
    code, out = cli.json("revert", "-s", vllm_root, "--against", wheel)
    assert code == 2 and str(wheel) in out["error"]
    assert tree_digest(vllm_root) == before


# Ctrl-C at the import of a module the CLI loads before it can run a command: a real SIGINT
_SIGINT_AT_IMPORT = """
import importlib.abc, os, signal, sys
class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == {module!r}:
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, _Hook())
"""


@pytest.mark.parametrize("module", ["typer", "rich.table"])
def test_ctrl_c_while_the_cli_loads_is_a_line_not_a_traceback(vllm_root, module):
    for json_flag in ([], ["--json"]):
        result = _fp32patch("verify", "-s", vllm_root, *json_flag, prelude=_SIGINT_AT_IMPORT.format(module=module))
        assert result.returncode == 130
        _no_traceback(result)
        assert "interrupted (Ctrl-C)" in result.stderr
        if json_flag:
            assert _json(result)["ok"] is False


# ---------------------------------------------------------------- 4. state left behind

_SIGINT_BEFORE_WRITING = """
import os, signal, time
import fp32patch.patcher.transaction as _t
_commit = _t.Transaction.commit
def _interrupted(self, *args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(10)
    return _commit(self, *args, **kwargs)
_t.Transaction.commit = _interrupted
"""


def test_ctrl_c_before_the_write_phase_leaves_no_state_folder(vllm_root):
    before = tree_digest(vllm_root)
    result = _fp32patch("apply", "-s", vllm_root, prelude=_SIGINT_BEFORE_WRITING)
    assert result.returncode == 130 and "before this run wrote anything" in result.stderr
    assert tree_digest(vllm_root) == before  # no .fp32patch/{lock,originals/} either


@pytest.mark.parametrize("step", [1, 2])
def test_a_killed_apply_once_settled_leaves_no_state_folder(vllm_root, cli, step):
    """SIGKILL after the originals were kept (1) or the intent recorded (2): revert settles it, and the
    root is as it was, with no state folder, and later commands agree there is no record."""
    before = tree_digest(vllm_root)
    killed = _fp32patch("apply", "-s", vllm_root, FP32PATCH_CRASH_AT=str(step))
    assert killed.returncode == -signal.SIGKILL
    assert (vllm_root / ".fp32patch").is_dir()
    assert cli("revert", "-s", vllm_root).exit_code == 0
    assert tree_digest(vllm_root) == before
    code, out = cli.json("revert", "-s", vllm_root)
    assert code == 0 and all(p["message"] == "no fp32patch record in this root" for p in out["patches"])


# ---------------------------------------------------------------- 5. a wrong diagnosis


def test_an_immutable_target_is_named_with_its_error(vllm_root, cli):
    before = tree_digest(vllm_root)
    with immutable(vllm_root / LOGITS_PROCESSOR):
        code, out = cli.json("apply", "-s", vllm_root)
    assert code == 2
    error = out["error"]
    assert f"Operation not permitted ({vllm_root / LOGITS_PROCESSOR})" in error, error
    assert "rollback" not in error and "nothing was changed" in error
    assert tree_digest(vllm_root) == before


def test_a_file_size_limit_on_the_record_names_the_record(vllm_root):
    """`ulimit -f` below the 572 KB RECORD: the RECORD and "File too large" are named, not a rollback."""
    record = vllm_root / RECORD
    assert record.stat().st_size > 500_000
    before = tree_digest(vllm_root)
    result = _fp32patch("apply", "-s", vllm_root, "--json", fsize=300_000)
    assert result.returncode == 2, result.stderr
    error = _json(result)["error"]
    assert f"File too large ({record})" in error and "rollback" not in error and "nothing was changed" in error
    assert tree_digest(vllm_root) == before


def test_a_root_owned_pycache_is_named_before_anything_is_written(vllm_root, public):
    """A user who owns the root but not a __pycache__ of a target: refused up front, the folder named."""
    root = _copy(vllm_root, public / "sp", owner=NOBODY)
    cache = root / "vllm" / "model_executor" / "layers" / "__pycache__"
    cache.mkdir()
    (cache / "logits_processor.cpython-311.pyc").write_bytes(b"stale")  # root's, in root's folder
    before = tree_digest(root)
    result = _fp32patch("apply", "-s", root, "--json", user=NOBODY)
    assert result.returncode == 2, result.stderr
    error = _json(result)["error"]
    assert f"{cache}: permission denied" in error and "rollback" not in error
    assert tree_digest(root) == before


def test_a_failed_rollback_says_what_failed_first_and_the_command_with_its_root(vllm_root, cli, monkeypatch):
    """The RECORD cannot be written, then the target cannot be put back: the message says both, never
    "nothing was changed", and advises the command with -s; that command settles the root exactly."""
    from fp32patch.patcher import transaction

    before = tree_digest(vllm_root)
    real = transaction.atomic_write
    state = {"patched": False}

    def failing(path, data, **kw):
        if path.name == "RECORD":
            raise OSError(28, "No space left on device", str(path))
        if path.name == "logits_processor.py":
            if state["patched"]:  # the rollback's write back
                raise OSError(5, "Input/output error", str(path))
            state["patched"] = True
        return real(path, data, **kw)

    monkeypatch.setattr(transaction, "atomic_write", failing)
    code, out = cli.json("apply", "-s", vllm_root, "--patch", LOGITS_ID)
    monkeypatch.undo()
    assert code == 2
    error = out["error"]
    assert f"No space left on device ({vllm_root / RECORD})" in error
    assert f"Input/output error ({vllm_root / LOGITS_PROCESSOR})" in error
    assert "nothing was changed" not in error
    advised = f"fp32patch revert -s {vllm_root} --patch {LOGITS_ID}"
    assert advised in error
    code, out = cli.json("verify", "-s", vllm_root)
    assert code == 1 and _status(out, LOGITS_ID).get("interrupted")
    assert cli(*advised.split()[1:]).exit_code == 0
    assert tree_digest(vllm_root) == before


# ---------------------------------------------------------------- 6. a judgement outside the lock


def test_apply_racing_a_revert_judges_under_the_lock(vllm_root, cli, monkeypatch):
    """A revert finishes between apply's first read of a patched root and its judgement of it: the
    root is cleanly original then, so apply patches it (never `original-lost`, exit 3)."""
    from fp32patch.patcher.state import StateDir

    assert cli("apply", "-s", vllm_root).exit_code == 0
    real = StateDir.original
    raced = {"done": False}

    def original(self, digest):
        if not raced["done"]:
            raced["done"] = True
            assert _fp32patch("revert", "-s", vllm_root).returncode == 0  # another process, its own lock
        return real(self, digest)

    monkeypatch.setattr(StateDir, "original", original)
    code, out = cli.json("apply", "-s", vllm_root)
    monkeypatch.undo()
    assert raced["done"]
    assert code == 0, out
    assert {p["status"] for p in out["patches"] if p["status"] != "not-installed"} == {"applied"}
    assert cli("verify", "-s", vllm_root).exit_code == 0


# ---------------------------------------------------------------- 7. --json that prints nothing


@pytest.mark.parametrize(
    "args",
    [
        ["verify", "--bogus"],
        ["check"],
        ["list", "-s", "/nonexistent"],
        ["list", "--envs", "{empty}"],
    ],
)
def test_every_failure_under_json_is_one_json_object(tmp_path, args):
    args = [a.format(empty=tmp_path) for a in args]
    result = _fp32patch(*args, "--json")
    assert result.returncode == 2
    out = _json(result)  # the whole of stdout
    assert out["ok"] is False and out["error"]
    _no_traceback(result)


# ---------------------------------------------------------------- 8. RECORD not given back


def test_revert_gives_back_the_record_row_it_found(vllm_root, cli):
    """A target edited locally (its RECORD row no longer its hash), apply, revert: RECORD byte for byte."""
    target = vllm_root / LOGITS_PROCESSOR
    with target.open("a") as fh:
        fh.write("# a local edit, before fp32patch\n")
    before = tree_digest(vllm_root)
    record = (vllm_root / RECORD).read_bytes()
    assert cli("apply", "-s", vllm_root).exit_code == 0
    assert (vllm_root / RECORD).read_bytes() != record  # apply vouches for the patched bytes
    assert cli("revert", "-s", vllm_root).exit_code == 0
    assert (vllm_root / RECORD).read_bytes() == record
    assert tree_digest(vllm_root) == before


def test_revert_after_a_second_apply_gives_back_the_first_row(vllm_root, cli):
    """One patch, then the other on the same root: the row kept is the one found before the first."""
    with (vllm_root / LOGITS_PROCESSOR).open("a") as fh:
        fh.write("# a local edit\n")
    record = (vllm_root / RECORD).read_bytes()
    assert cli("apply", "-s", vllm_root, "--patch", LOGITS_ID).exit_code == 0
    assert cli("apply", "-s", vllm_root).exit_code == 0
    assert cli("revert", "-s", vllm_root, "--patch", LOGITS_ID).exit_code == 0
    assert cli("revert", "-s", vllm_root).exit_code == 0
    assert (vllm_root / RECORD).read_bytes() == record
