"""``fp32patch check --against``: a candidate release (wheel, sdist, folder) read in place, never installed.

The real artifacts are vLLM's own: its 0.25.1 wheel (the release NeMo-RL pins; shared
with the safe-writes tests), its 0.10.2 sdist, and small wheels and sdists laid out
exactly like PyPI's around a real release's nemotron_h.py and dist-info (what an
upgrade would bring: a new signature, a second class, an upstream fix).
"""

from __future__ import annotations

import io
import shutil
import tarfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import LOGITS_PROCESSOR, NEMOTRON, tree_digest
from tests.support.pypi import member_files, sdist_file, wheel_file

pytestmark = pytest.mark.network


def _members(version: str) -> dict[str, bytes]:
    """The release's nemotron_h.py and logits_processor.py (where it has them) and dist-info
    METADATA/RECORD/WHEEL, by archive path."""
    return {
        name: path.read_bytes() for name, path in member_files("vllm", version, [NEMOTRON, LOGITS_PROCESSOR]).items()
    }


def _entry(out: dict, patch: str = "nemotron-h-fp32-lm-head") -> dict:
    return next(p for p in out["patches"] if p["id"] == patch)


def _relabel(members: dict[str, bytes], old: str, new: str) -> dict[str, bytes]:
    out = {}
    for name, data in members.items():
        name = name.replace(f"vllm-{old}.dist-info", f"vllm-{new}.dist-info")
        if name.endswith("METADATA"):
            data = data.replace(f"Version: {old}".encode(), f"Version: {new}".encode())
        out[name] = data
    return out


def _edit(members: dict[str, bytes], change: Callable[[str], str]) -> dict[str, bytes]:
    out = dict(members)
    out[NEMOTRON] = change(out[NEMOTRON].decode()).encode()
    return out


def _wheel(folder: Path, version: str, members: dict[str, bytes]) -> Path:
    path = folder / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in sorted(members.items()):
            wheel.writestr(name, data)
    return path


def _sdist(folder: Path, version: str, members: dict[str, bytes], *, fmt: str = "tar.gz") -> Path:
    """An sdist as setuptools lays it out: <name>-<version>/PKG-INFO and the sources."""
    top = f"vllm-{version}"
    meta = next(data for name, data in members.items() if name.endswith(".dist-info/METADATA"))
    files = {f"{top}/PKG-INFO": meta, f"{top}/pyproject.toml": b'[project]\nname = "vllm"\ndynamic = ["version"]\n'}
    files.update({f"{top}/{name}": data for name, data in members.items() if ".dist-info/" not in name})
    path = folder / f"{top}.{fmt}"
    if fmt == "zip":
        with zipfile.ZipFile(path, "w") as archive:
            for name, data in files.items():
                archive.writestr(name, data)
        return path
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


NEW_SIGNATURE = (
    "        hidden_states: torch.Tensor,\n    ) -> torch.Tensor | None:",
    "        hidden_states: torch.Tensor,\n        spec_step_idx: int = 0,\n    ) -> torch.Tensor | None:",
)


def _second_class(text: str) -> str:
    return text + "\n\n" + "class NemotronHForCausalLM" + text.split("\nclass NemotronHForCausalLM", 1)[1]


def _upstream_fix(text: str) -> str:
    return text.replace(
        "    def compute_logits(",
        '    _fp32_switch = "NRL_VLLM_FP32_LM_HEAD"  # upstream reads the switch itself\n\n    def compute_logits(',
        1,
    )


def test_real_wheel_of_the_pinned_release(tmp_path, cli, monkeypatch):
    wheel = wheel_file("vllm", "0.25.1")
    before = (wheel.stat().st_size, wheel.stat().st_mtime_ns)
    monkeypatch.chdir(tmp_path)
    code, out = cli.json("check", "--against", wheel)
    assert code == 0 and out["ok"] and out["command"] == "check"
    assert out["candidate"] == {"path": str(wheel), "kind": "wheel", "distribution": "vllm", "version": "0.25.1"}
    assert {p["id"] for p in out["patches"]} == {"nemotron-h-fp32-lm-head", "vllm-fp32-logits"}
    entry = _entry(out)
    assert entry["status"] == "would-apply" and entry["variant"] == "hidden-states-only"
    assert entry["edits"] == ["runtime-gate", "route-compute-logits", "refit-notify"]
    assert entry["path"] == f"{wheel}!{NEMOTRON}"
    logits = _entry(out, "vllm-fp32-logits")
    assert (logits["status"], logits["variant"]) == ("would-apply", "head-gemm")
    assert logits["edits"] == ["runtime-gate", "route-head", "processor-way"]
    assert logits["path"] == f"{wheel}!{LOGITS_PROCESSOR}"
    assert (wheel.stat().st_size, wheel.stat().st_mtime_ns) == before
    assert list(tmp_path.iterdir()) == []  # nothing extracted where it ran

    shown = cli("check", "--against", wheel)
    assert shown.exit_code == 0
    assert "checking vllm 0.25.1 (wheel" in shown.stdout and "would-apply" in shown.stdout


def test_real_sdist(tmp_path, cli, monkeypatch):
    sdist = sdist_file("vllm", "0.10.2")
    monkeypatch.chdir(tmp_path)
    code, out = cli.json("check", "--against", sdist)
    assert code == 0, out
    assert out["candidate"]["kind"] == "sdist" and out["candidate"]["version"] == "0.10.2"
    entry = _entry(out)
    assert entry["status"] == "would-apply" and entry["variant"] == "with-sampling-metadata"
    assert entry["path"] == f"{sdist}!vllm-0.10.2/{NEMOTRON}"
    assert _entry(out, "vllm-fp32-logits")["status"] == "would-apply"
    assert list(tmp_path.iterdir()) == []


# candidate (built around a real release) -> (exit code, status, words the message must have)
CASES: dict[str, tuple[Callable[[Path], Path], int, str, list[str]]] = {
    "wheel, older variant": (
        lambda d: _wheel(d, "0.10.2", _members("0.10.2")),
        0,
        "would-apply",
        ["variant with-sampling-metadata"],
    ),
    "wheel, new signature": (
        lambda d: _wheel(
            d, "0.34.0", _edit(_relabel(_members("0.33.0"), "0.33.0", "0.34.0"), lambda t: t.replace(*NEW_SIGNATURE))
        ),
        3,
        "anchor-missing",
        [
            f"cannot patch {NEMOTRON} (vllm 0.34.0)",
            "edit route-compute-logits",
            "params (self, hidden_states)",
            "found instead: NemotronHForCausalLM.compute_logits(self, hidden_states, spec_step_idx)",
        ],
    ),
    "wheel, class defined twice": (
        lambda d: _wheel(d, "0.34.0", _edit(_relabel(_members("0.33.0"), "0.33.0", "0.34.0"), _second_class)),
        3,
        "anchor-ambiguous",
        ["matched 2 times, expected 1"],
    ),
    "wheel, fixed upstream": (
        lambda d: _wheel(d, "0.34.0", _edit(_relabel(_members("0.33.0"), "0.33.0", "0.34.0"), _upstream_fix)),
        0,
        "obsolete",
        ["already has the upstream fix"],
    ),
    "wheel, file removed upstream": (
        lambda d: _wheel(d, "0.9.0", _members("0.9.0")),
        3,
        "not-installed",
        [f"vllm 0.9.0 has no {NEMOTRON}", "moved or was removed upstream"],
    ),
    "wheel, files under .data/purelib": (
        lambda d: _wheel(
            d,
            "0.33.0",
            {(f"vllm-0.33.0.data/purelib/{k}" if k == NEMOTRON else k): v for k, v in _members("0.33.0").items()},
        ),
        0,
        "would-apply",
        ["variant hidden-states-only"],
    ),
    "sdist, new signature": (
        lambda d: _sdist(
            d, "0.34.0", _edit(_relabel(_members("0.33.0"), "0.33.0", "0.34.0"), lambda t: t.replace(*NEW_SIGNATURE))
        ),
        3,
        "anchor-missing",
        ["found instead: NemotronHForCausalLM.compute_logits(self, hidden_states, spec_step_idx)"],
    ),
    "zip sdist": (lambda d: _sdist(d, "0.33.0", _members("0.33.0"), fmt="zip"), 0, "would-apply", []),
}


@pytest.mark.parametrize("name", list(CASES))
def test_candidate(name, tmp_path, cli):
    build, code, status, words = CASES[name]
    folder = tmp_path / "dist"
    folder.mkdir()
    candidate = build(folder)
    before = tree_digest(tmp_path)
    got, out = cli.json("check", "--against", candidate)
    assert got == code, out
    entry = _entry(out)
    assert entry["status"] == status
    message = " ".join(entry["message"].split())
    for word in words:
        assert word in message, (word, message)
    assert tree_digest(tmp_path) == before


def test_folders(tmp_path, cli):
    members = _members("0.33.0")
    root = tmp_path / "site-packages"
    for name, data in members.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    code, out = cli.json("check", "--against", root)
    assert code == 0 and out["candidate"]["kind"] == "folder" and _entry(out)["status"] == "would-apply"

    # an already patched root: nothing to do, and check says so
    assert cli("apply", "-s", root).exit_code == 0
    before = tree_digest(root)
    code, out = cli.json("check", "--against", root)
    assert code == 0 and _entry(out)["status"] == "already-applied"
    assert tree_digest(root) == before

    # an unpacked sdist: the version comes from PKG-INFO
    sdist = _sdist(tmp_path, "0.10.2", _members("0.10.2"))
    with tarfile.open(sdist) as archive:  # unpacked by hand: extractall's filter= is not on every 3.10/3.11
        for member in archive.getmembers():
            dest = tmp_path / "unpacked" / member.name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(archive.extractfile(member).read())
    code, out = cli.json("check", "--against", tmp_path / "unpacked" / "vllm-0.10.2")
    assert code == 0 and _entry(out)["version"] == "0.10.2"
    assert _entry(out)["variant"] == "with-sampling-metadata"

    # a source checkout (dynamic version): the release is unknown, the first variant that fits is used
    checkout = tmp_path / "vllm-checkout"
    shutil.copytree(tmp_path / "unpacked" / "vllm-0.10.2", checkout)
    (checkout / "PKG-INFO").unlink()
    code, out = cli.json("check", "--against", checkout)
    assert code == 0 and _entry(out)["version"] is None
    assert _entry(out)["variant"] == "with-sampling-metadata"

    # a checkout of vLLM that lost the file
    (checkout / NEMOTRON).unlink()
    code, out = cli.json("check", "--against", checkout)
    assert code == 3 and _entry(out)["status"] == "not-installed"


BAD = {
    "missing": (lambda d: d / "vllm-0.34.0.whl", "does not exist"),
    "not an archive": (lambda d: (d / "x.txt").write_text("x") and d / "x.txt", "not a wheel (*.whl), an sdist"),
    "broken wheel": (
        lambda d: (
            (d / "vllm-1.0-py3-none-any.whl").write_bytes(b"PK\x03\x04 truncated") and d / "vllm-1.0-py3-none-any.whl"
        ),
        "cannot be read as a wheel",
    ),
    "wheel without METADATA": (
        lambda d: _wheel(d, "1.0", {"vllm/__init__.py": b""}),
        "a wheel without a *.dist-info/METADATA",
    ),
    "another distribution": (
        lambda d: _wheel(d, "2.0", {"torch-2.0.dist-info/METADATA": b"Name: torch\nVersion: 2.0\n"}),
        "no patch targets torch 2.0 (the patches target: ",
    ),
    "a folder that is nothing": (lambda d: d, "no patch targets anything in it"),
    "tar without PKG-INFO": (
        lambda d: _tar_without_pkg_info(d),
        "an sdist without <name>-<version>/PKG-INFO",
    ),
}


def _tar_without_pkg_info(d: Path) -> Path:
    path = d / "vllm-1.0.tar.gz"
    with tarfile.open(path, "w:gz") as archive:
        info = tarfile.TarInfo("vllm-1.0/setup.py")
        archive.addfile(info, io.BytesIO(b""))
    return path


@pytest.mark.parametrize("name", list(BAD))
def test_bad_candidate(name, tmp_path, cli):
    make, words = BAD[name]
    candidate = make(tmp_path)
    result = cli("check", "--against", candidate)
    assert result.exit_code == 2
    assert words in " ".join(result.stderr.split())
    result = cli("check", "--against", candidate, "--patch", "no-such-patch")
    assert result.exit_code == 2 and "unknown patch id" in result.stderr
