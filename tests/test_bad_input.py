"""Bad input: a clear message naming what and where, a non-zero exit, and not a byte written.

Every case runs each command it applies to and compares the whole tree (and anything
outside it the case points at) before and after. Unusual but valid targets (CRLF, BOM,
tabs, no final newline) are not bad input: they are patched, keep their form, and revert
byte-exactly.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest

from fp32patch.patcher import atomic
from fp32patch.patcher.apply import apply as apply_patches
from tests.conftest import NEMOTRON, tree_digest
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

VERSION = "0.33.0"
ALL = ("apply", "verify", "status", "diff", "revert")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return import_root_from_members("vllm", VERSION, [NEMOTRON], tmp_path_factory.mktemp("pristine") / "sp")


@pytest.fixture(scope="module")
def patched(pristine, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("patched") / "sp"
    shutil.copytree(pristine, root)
    assert apply_patches([], [root]).ok
    return root


def _ours(out: dict) -> dict:
    """The nemotron patch's entry (a vLLM root lacks the other patches' targets)."""
    return next(p for p in out["patches"] if p["id"] == "nemotron-h-fp32-lm-head")


def _manifest(root: Path) -> Path:
    return root / ".fp32patch" / "manifest.json"


def _rewrite_manifest(root: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(_manifest(root).read_text())
    change(data)
    _manifest(root).write_text(json.dumps(data))


def _shipped_spec() -> str:
    return (Path(atomic.__file__).parent.parent / "patches" / "nemotron-h-fp32-lm-head.toml").read_text()


def _spec_dir(tmp: Path, text: str) -> Path:
    folder = tmp / "specs"
    folder.mkdir()
    (folder / "bad.toml").write_text(text)
    return folder


# case -> (start from "pristine"|"patched", setup(root, tmp) -> extra args, {command: exit code}, needles)
# A needle "$ROOT"/"$TMP" stands for the root / the test's tmp folder.
Case = tuple[str, Callable[[Path, Path], list[str]], dict[str, int], list[str]]


def _syntax_error(root: Path, tmp: Path) -> list[str]:
    target = root / NEMOTRON
    target.write_text(target.read_text().replace("class NemotronHForCausalLM(", "class NemotronHForCausalLM((", 1))
    return []


def _symlink_out(root: Path, tmp: Path) -> list[str]:
    outside = tmp / "outside" / "nemotron_h.py"
    outside.parent.mkdir()
    (root / NEMOTRON).rename(outside)
    (root / NEMOTRON).symlink_to(outside)
    return []


def _folder_symlink_out(root: Path, tmp: Path) -> list[str]:
    models = (root / NEMOTRON).parent
    shutil.move(models, tmp / "outside-models")
    models.symlink_to(tmp / "outside-models")
    return []


CASES: dict[str, Case] = {
    "unknown patch id": (
        "pristine",
        lambda r, t: ["--patch", "no-such-patch"],
        dict.fromkeys(ALL, 2),
        ["unknown patch id 'no-such-patch'; known: ", "nemotron-h-fp32-lm-head"],
    ),
    "nonexistent root": (
        "pristine",
        lambda r, t: ["-s", str(t / "no-such-root")],
        dict.fromkeys(ALL, 2),
        ["import root $TMP/no-such-root does not exist"],
    ),
    "root is a file": (
        "pristine",
        lambda r, t: (t.joinpath("file").write_text("x"), ["-s", str(t / "file")])[1],
        dict.fromkeys(ALL, 2),
        ["import root $TMP/file is not a folder"],
    ),
    "syntax error in the target": (
        "pristine",
        _syntax_error,
        {"apply": 3, "verify": 1, "diff": 3},
        ["cannot patch " + NEMOTRON, "not Python this tool can parse", "line"],
    ),
    "target not UTF-8": (
        "pristine",
        lambda r, t: ((r / NEMOTRON).write_bytes((r / NEMOTRON).read_bytes() + b"# caf\xe9\n"), [])[1],
        {"apply": 3, "verify": 1, "diff": 3},
        ["cannot patch " + NEMOTRON, "not Python this tool can parse", "utf-8"],
    ),
    "target is a symlink out of the root": (
        "pristine",
        _symlink_out,
        dict.fromkeys(ALL, 2),
        [f"$ROOT/{NEMOTRON} is a symbolic link to $TMP/outside/nemotron_h.py", "outside the import root $ROOT"],
    ),
    "target folder is a symlink out of the root": (
        "pristine",
        _folder_symlink_out,
        dict.fromkeys(ALL, 2),
        [f"$ROOT/{NEMOTRON} leads (through a symlinked folder) to $TMP/outside-models", "outside the import root"],
    ),
    "target is a symlink loop": (
        "pristine",
        lambda r, t: ((r / NEMOTRON).unlink(), (r / NEMOTRON).symlink_to("nemotron_h.py"))[-1] or [],
        dict.fromkeys(ALL, 2),
        [f"$ROOT/{NEMOTRON} is a symbolic link that leads to no file (-> nemotron_h.py)", "a broken link or a loop"],
    ),
    "truncated manifest": (
        "patched",
        lambda r, t: (_manifest(r).write_bytes(_manifest(r).read_bytes()[:150]), [])[1],
        dict.fromkeys(ALL, 2),
        ["$ROOT/.fp32patch/manifest.json: not valid JSON", "truncated or corrupted", "Move the state folder"],
    ),
    "corrupted manifest": (
        "patched",
        lambda r, t: (_manifest(r).write_bytes(os.urandom(300)), [])[1],
        dict.fromkeys(ALL, 2),
        ["$ROOT/.fp32patch/manifest.json: not valid JSON"],
    ),
    "another tool's JSON as manifest": (
        "patched",
        lambda r, t: (_manifest(r).write_text('{"tool": "pip", "entries": []}'), [])[1],
        dict.fromkeys(ALL, 2),
        ["$ROOT/.fp32patch/manifest.json: not an fp32patch manifest"],
    ),
    "manifest from a newer fp32patch": (
        "patched",
        lambda r, t: (_rewrite_manifest(r, lambda d: d.update(tool_version="99.0.0")), [])[1],
        dict.fromkeys(ALL, 2),
        ["manifest.json: written by fp32patch 99.0.0", "newer than this fp32patch", "upgrade fp32patch"],
    ),
    "manifest with a newer schema": (
        "patched",
        lambda r, t: (_rewrite_manifest(r, lambda d: d.update(schema=2)), [])[1],
        dict.fromkeys(ALL, 2),
        ["manifest.json: written by fp32patch", "(schema 2)"],
    ),
    "manifest entry with a wrong field": (
        "patched",
        lambda r, t: (_rewrite_manifest(r, lambda d: d["entries"][0].update(sha256_before="beef")), [])[1],
        dict.fromkeys(ALL, 2),
        ["manifest.json: entries[0].sha256_before: expected a sha256 hex digest, got 'beef'"],
    ),
    "manifest entry with an unknown field": (
        "patched",
        lambda r, t: (_rewrite_manifest(r, lambda d: d["entries"][0].update(colour="red")), [])[1],
        dict.fromkeys(ALL, 2),
        ["manifest.json: entries[0]:", "colour"],
    ),
    "state folder is a file": (
        "pristine",
        lambda r, t: ((r / ".fp32patch").write_text("not a folder"), [])[1],
        dict.fromkeys(ALL, 2),
        ["$ROOT/.fp32patch is not a folder"],
    ),
    "spec with a wrong field": (
        "pristine",
        lambda r, t: ["--specs", str(_spec_dir(t, _shipped_spec().replace("\nscope = ", "\nscoep = ", 1)))],
        dict.fromkeys(ALL, 2),
        ["$TMP/specs/bad.toml: edits[1].scoep: unknown field"],
    ),
    "spec that is not TOML": (
        "pristine",
        lambda r, t: ["--specs", str(_spec_dir(t, "id = [unclosed"))],
        dict.fromkeys(ALL, 2),
        ["$TMP/specs/bad.toml: not valid TOML"],
    ),
    "spec folder that does not exist": (
        "pristine",
        lambda r, t: ["--specs", str(t / "nowhere")],
        dict.fromkeys(ALL, 2),
        ["$TMP/nowhere: not a directory of specs"],
    ),
}


def _everything(root: Path, tmp: Path) -> dict[str, str]:
    """Digest of the test's whole tmp folder: the root and anything a case put beside it."""
    return tree_digest(tmp)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, pristine, patched, tmp_path, cli, bad_inputs_tried):
    start, setup, codes, needles = CASES[name]
    root = tmp_path / "sp"
    shutil.copytree(pristine if start == "pristine" else patched, root, symlinks=True)
    extra = setup(root, tmp_path)
    args = extra if "-s" in extra else ["-s", str(root), *extra]
    before = _everything(root, tmp_path)
    needles = [n.replace("$ROOT", str(root)).replace("$TMP", str(tmp_path)) for n in needles]
    for command, code in codes.items():
        result = cli(command, *args)
        text = " ".join((result.stdout + result.stderr).split())
        assert result.exit_code == code, (command, text)
        for needle in needles:
            assert needle in text, (command, needle, text)
        assert _everything(root, tmp_path) == before, f"{command} wrote something"
        if code == 2:  # the JSON form says the same, as one object
            result = cli(command, *args, "--json")
            out = json.loads(result.stdout)
            assert result.exit_code == 2 and out["ok"] is False
            assert all(n in " ".join(out["error"].split()) for n in needles), out["error"]
            assert _everything(root, tmp_path) == before
        bad_inputs_tried.append((name, command))


@pytest.fixture(scope="module")
def bad_inputs_tried():
    tried: list = []
    yield tried
    print(f"\nbad inputs tried: {len(tried)} (case x command)")


# ---------------------------------------------------------------- a root that cannot be written


def _can_remount_read_only() -> bool:
    with tempfile.TemporaryDirectory() as d:
        probe = ["unshare", "-m", "sh", "-c", f"mount --bind {d} {d} && mount -o remount,ro,bind {d} {d}"]
        try:
            return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False


def _fp32patch_read_only(root: Path, *args: str) -> subprocess.CompletedProcess:
    """``fp32patch ARGS`` in a mount namespace where ``root`` is a read-only bind mount (real EROFS)."""
    command = " ".join([sys.executable, "-m", "fp32patch", *args])
    script = f"mount --bind {root} {root} && mount -o remount,ro,bind {root} {root} && exec {command}"
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not _can_remount_read_only(), reason="needs `unshare -m` and bind mounts (root in a container)")
def test_read_only_root_real_mount(pristine, patched, tmp_path):
    root = tmp_path / "sp"
    shutil.copytree(pristine, root)
    before = tree_digest(root)
    result = _fp32patch_read_only(root, "apply", "-s", str(root))
    assert result.returncode == 2, result.stderr
    message = " ".join(result.stderr.split())
    assert f"cannot write in {root}: {root}: read-only file system; nothing was changed" in message
    assert tree_digest(root) == before

    done = tmp_path / "done"
    shutil.copytree(patched, done)
    before = tree_digest(done)
    result = _fp32patch_read_only(done, "revert", "-s", str(done))
    assert result.returncode == 2 and "read-only file system" in result.stderr
    # an image that is already patched and mounted read-only re-applies and verifies cleanly
    result = _fp32patch_read_only(done, "apply", "-s", str(done), "--json")
    assert result.returncode == 0 and _ours(json.loads(result.stdout))["status"] == "already-applied"
    assert _fp32patch_read_only(done, "verify", "-s", str(done)).returncode == 0
    assert tree_digest(done) == before


AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _can_run_as_nobody() -> bool:
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return False
    probe = subprocess.run([*AS_NOBODY, sys.executable, "-c", "import fp32patch.cli"], capture_output=True, cwd="/")
    return probe.returncode == 0


@pytest.mark.skipif(not _can_run_as_nobody(), reason="needs root, setpriv, and this Python usable by uid 65534")
def test_root_without_write_permission_as_another_user(pristine):
    """As uid 65534 in a root-owned 0o555 folder (os.access is honest for a non-root user)."""
    with tempfile.TemporaryDirectory() as d:
        os.chmod(d, 0o755)
        root = Path(d) / "sp"
        shutil.copytree(pristine, root)
        for path in [root, *root.rglob("*")]:
            os.chmod(path, 0o555 if path.is_dir() else 0o444)
        before = tree_digest(root)
        result = subprocess.run(
            [*AS_NOBODY, sys.executable, "-m", "fp32patch", "apply", "-s", str(root)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        assert f"cannot write in {root}: {root}: permission denied (uid 65534)" in " ".join(result.stderr.split())
        assert tree_digest(root) == before
        os.chmod(root, 0o755)


# The OS refusing a write that the pre-check let through (root on a 0o555 folder can write,
# an immutable file, a network file system, a full disk): each errno at each kind of write
# gives a clear message and leaves every file as it was. Simulated where the OS call is made.
ERRNOS = {
    errno.EACCES: "Permission denied",
    errno.EROFS: "Read-only file system",
    errno.EPERM: "Operation not permitted",
    errno.ENOSPC: "No space left on device",
}
POINTS = {
    # the temp file beside the target cannot be created
    "mkstemp beside the target": ("mkstemp", NEMOTRON, 1),
    # the rename onto the target fails: originals and intent are already on disk
    "replace of the target": ("replace", NEMOTRON, 1),
    # the target is replaced, then its RECORD fails: the target must be put back
    "replace of RECORD": ("replace", f"vllm-{VERSION}.dist-info/RECORD", 1),
    # everything is written and the manifest cannot be settled: all must be put back
    "settling the manifest": ("replace", ".fp32patch/manifest.json", 2),
}


@pytest.mark.parametrize("point", list(POINTS))
@pytest.mark.parametrize("code", list(ERRNOS), ids=[errno.errorcode[c] for c in ERRNOS])
def test_os_refuses_a_write(point, code, pristine, tmp_path, cli, monkeypatch, bad_inputs_tried):
    root = tmp_path / "sp"
    shutil.copytree(pristine, root)
    before = tree_digest(root)
    call, rel, nth = POINTS[point]
    victim = root / rel
    seen = {"n": 0}
    real_replace, real_mkstemp = os.replace, tempfile.mkstemp

    def hit(path: Path) -> bool:
        if path != victim:
            return False
        seen["n"] += 1
        return seen["n"] == nth

    def replace(src, dst, *a, **kw):
        if call == "replace" and hit(Path(dst)):
            raise OSError(code, os.strerror(code), str(dst))
        return real_replace(src, dst, *a, **kw)

    def mkstemp(*a, prefix=None, dir=None, **kw):
        if call == "mkstemp" and hit(Path(dir) / prefix[1:-1]):
            raise OSError(code, os.strerror(code), str(dir))
        return real_mkstemp(*a, prefix=prefix, dir=dir, **kw)

    monkeypatch.setattr(atomic.os, "replace", replace)
    monkeypatch.setattr(atomic.tempfile, "mkstemp", mkstemp)
    result = cli("apply", "-s", root)
    monkeypatch.undo()

    message = " ".join(result.stderr.split())
    assert result.exit_code == 2, message
    assert seen["n"] >= nth  # the failure did happen where the case says
    assert f"cannot write in {root}: {ERRNOS[code]}" in message and "nothing was changed" in message
    after = tree_digest(root)
    state = {p: h for p, h in after.items() if p.startswith(".fp32patch")}
    assert {p: h for p, h in after.items() if p not in state} == before
    # what may remain is the empty state folder and its lock: no manifest, no kept bytes
    assert set(state) <= {".fp32patch", ".fp32patch/lock", ".fp32patch/originals"}
    assert not list(root.rglob("*fp32patch-tmp*"))
    # and the next run, with the OS willing, works
    assert cli("apply", "-s", root).exit_code == 0 and cli("verify", "-s", root).exit_code == 0
    bad_inputs_tried.append((point, errno.errorcode[code]))


# ---------------------------------------------------------------- unusual but valid targets


def _tabs(data: bytes) -> bytes:
    out = []
    for line in data.decode().splitlines(keepends=True):
        body = line.lstrip(" ")
        n = len(line) - len(body)
        out.append("\t" * (n // 4) + " " * (n % 4) + body)
    return "".join(out).encode()


FORMS: dict[str, Callable[[bytes], bytes]] = {
    "crlf": lambda b: b.replace(b"\n", b"\r\n"),
    "bom": lambda b: b"\xef\xbb\xbf" + b,
    "tabs": _tabs,
    "no final newline": lambda b: b.rstrip(b"\n"),
    "crlf + bom + no final newline": lambda b: b"\xef\xbb\xbf" + b.replace(b"\n", b"\r\n").rstrip(b"\r\n"),
}


def _form_kept(name: str, data: bytes) -> None:
    text = data.decode("utf-8-sig")
    compile(text, "nemotron_h.py", "exec")
    if "crlf" in name:
        assert not re.search(rb"(?<!\r)\n", data), "a bare LF in a CRLF file"
    if "bom" in name:
        assert data.startswith(b"\xef\xbb\xbf") and not data.startswith(b"\xef\xbb\xbf" * 2)
    if "no final newline" in name:
        assert not data.endswith((b"\n", b"\r"))
    if name == "tabs":
        indents = [line[: len(line) - len(line.lstrip())] for line in text.splitlines() if line.strip()]
        assert not [i for i in indents if i.startswith(" ")], "a space-indented line in a tab-indented file"


@pytest.mark.parametrize("name", list(FORMS))
def test_unusual_valid_target_keeps_its_form(name, pristine, tmp_path, cli):
    root = tmp_path / "sp"
    shutil.copytree(pristine, root)
    target = root / NEMOTRON
    original = FORMS[name](target.read_bytes())
    target.write_bytes(original)

    result = cli("apply", "-s", root)
    assert result.exit_code == 0, result.stdout + result.stderr
    patched = target.read_bytes()
    assert patched != original
    _form_kept(name, patched)
    for marker in ("[runtime-gate]", "[route-compute-logits]", "[refit-notify]"):
        assert patched.count(marker.encode()) == 1
    code, out = cli.json("verify", "-s", root)
    assert code == 0 and _ours(out)["status"] == "applied"
    code, out = cli.json("apply", "-s", root)
    assert code == 0 and _ours(out)["status"] == "already-applied"
    assert cli("revert", "-s", root).exit_code == 0
    assert target.read_bytes() == original


def test_modes_of_state_under_umasks(pristine, tmp_path):
    """The state folder, its files and the lock are never wider than the root or the umask."""
    seen = []
    for umask in (0o022, 0o077, 0o002, 0o000):
        for root_mode in (0o755, 0o700, 0o775):
            root = tmp_path / f"sp-{umask:03o}-{root_mode:03o}"
            shutil.copytree(pristine, root)
            os.chmod(root, root_mode)
            old = os.umask(umask)
            try:
                assert apply_patches([], [root]).ok
            finally:
                os.umask(old)
            ceiling = root_mode & ~umask
            for path in (root / ".fp32patch").rglob("*"):
                bits = stat.S_IMODE(path.lstat().st_mode)
                assert bits & ~ceiling == 0, (oct(umask), oct(root_mode), path.name, oct(bits))
                assert not bits & 0o022 or root_mode & ~umask & 0o022  # no group/other write unless both allow
            state_bits = stat.S_IMODE((root / ".fp32patch").stat().st_mode)
            assert state_bits & ~0o755 == 0  # never group- or world-writable
            assert stat.S_IMODE((root / ".fp32patch" / "lock").stat().st_mode) & 0o077 == 0
            seen.append(state_bits)
    assert 0o700 in seen and 0o755 in seen
