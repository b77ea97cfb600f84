"""``--envs DIR``: every Python environment under a folder (Ray per-actor envs), one report per root.

The environments are real (``python -m venv``, and a conda-shaped one), laid out as Ray
lays out runtime_env folders, with real vLLM releases' files in their site-packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import NEMOTRON, tree_digest
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

PY = f"python{sysconfig.get_python_version()}"


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path / "lib" / PY / "site-packages"


def _conda(path: Path) -> Path:
    (path / "conda-meta").mkdir(parents=True)
    sp = path / "lib" / PY / "site-packages"
    sp.mkdir(parents=True)
    return sp


def _install(site_packages: Path, version: str) -> None:
    import_root_from_members("vllm", version, [NEMOTRON], site_packages)


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> tuple[Path, dict[str, tuple[Path, str | None]]]:
    """runtime_resources/ as Ray makes it: env name -> (site-packages, vLLM release or None)."""
    top = tmp_path_factory.mktemp("ray") / "runtime_resources"
    envs = {
        "pip/4f1c/virtualenv": "0.33.0",  # the generation actor
        "uv/9a2b/virtualenv": "0.10.2",  # another actor on an older release
        "conda/77de": "0.25.1",
        "pip/c0ff/virtualenv": None,  # the trainer's env: no vLLM
    }
    made = {}
    for name, version in envs.items():
        sp = (_conda if name.startswith("conda") else _venv)(top / name)
        if version:
            _install(sp, version)
        made[name] = (sp, version)
    # things that are not environments, and a link that would loop
    (top / "working_dir_files" / "pkg" / "site-packages").mkdir(parents=True)
    (top / "loop").symlink_to(top)
    return top, made


@pytest.fixture
def ray(layout, tmp_path) -> tuple[Path, dict[str, tuple[Path, str | None]]]:
    top, made = layout
    copy = tmp_path / "runtime_resources"
    shutil.copytree(top, copy, symlinks=True)
    return copy, {name: (copy / sp.relative_to(top), v) for name, (sp, v) in made.items()}


ID = "nemotron-h-fp32-lm-head"


def _ours(out: dict) -> list[dict]:
    """This patch's entries (the environments hold vLLM, not the other patches' targets)."""
    return [p for p in out["patches"] if p["id"] == ID]


def _by_env(out: dict, top: Path) -> dict[str, dict]:
    return {Path(p["env"]).relative_to(top).as_posix(): p for p in _ours(out)}


def test_apply_verify_revert_across_environments(ray, cli):
    top, envs = ray
    originals = {n: (sp / NEMOTRON).read_bytes() for n, (sp, v) in envs.items() if v}

    code, out = cli.json("apply", "--envs", top)
    assert code == 0, out
    got = _by_env(out, top)
    assert set(got) == set(envs)  # every environment reported, the one without vLLM too
    for name, (sp, version) in envs.items():
        assert got[name]["root"] == str(sp.resolve())
        assert got[name]["status"] == ("applied" if version else "not-installed")
        assert got[name]["version"] == version
    assert got["uv/9a2b/virtualenv"]["variant"] == "with-sampling-metadata"
    assert {r["root"] for r in out["roots"]} == {str(sp.resolve()) for sp, _ in envs.values()}

    code, out = cli.json("verify", "--envs", top, "--patch", "nemotron-h-fp32-lm-head")
    assert code == 0 and all(p["status"] in ("applied", "not-installed") for p in _ours(out))

    # one environment changed by hand: verify names it, and only it
    drifted = envs["conda/77de"][0] / NEMOTRON
    drifted.write_bytes(drifted.read_bytes() + b"# edited in the image\n")
    code, out = cli.json("verify", "--envs", top)
    assert code == 1
    got = _by_env(out, top)
    assert got["conda/77de"]["status"] == "drifted"
    assert [n for n, p in got.items() if p["status"] == "applied"] == ["pip/4f1c/virtualenv", "uv/9a2b/virtualenv"]
    drifted.write_bytes(drifted.read_bytes().replace(b"# edited in the image\n", b""))

    code, out = cli.json("revert", "--envs", top)
    assert code == 0 and sorted(p["status"] for p in _ours(out)) == ["reverted"] * 3
    for name, data in originals.items():
        assert (envs[name][0] / NEMOTRON).read_bytes() == data


def test_the_table_is_grouped_by_root(ray, cli):
    top, envs = ray
    result = cli("status", "--envs", top)
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert lines[0] == f"environments under {top}"
    assert lines[1].split()[0] == "environment"
    rows = [line for line in lines if ID in line]
    assert len(rows) == 4
    for name, (_sp, version) in envs.items():  # each environment once, on its own row, with its release
        [row] = [r for r in rows if r.startswith(name + " ")]
        assert (version or "not-installed") in row
    assert "4 import roots: " in result.stdout and "3 not-applied" in result.stdout


def test_one_refusal_means_nothing_is_written_in_any_environment(ray, cli):
    top, envs = ray
    broken = envs["uv/9a2b/virtualenv"][0] / NEMOTRON
    broken.write_text(broken.read_text().replace("def compute_logits(", "def compute_logits_v2(", 1))
    before = tree_digest(top)
    code, out = cli.json("apply", "--envs", top)
    assert code == 3
    got = _by_env(out, top)
    assert got["uv/9a2b/virtualenv"]["status"] == "anchor-missing"
    assert got["pip/4f1c/virtualenv"]["status"] == "not-applied"  # it would have applied
    assert tree_digest(top) == before


def test_envs_and_site_packages_together(ray, tmp_path, cli):
    top, envs = ray
    extra = tmp_path / "opt-vllm"
    _install(extra, "0.33.0")
    code, out = cli.json("apply", "-s", extra, "--envs", top)
    assert code == 0
    roots = [p["root"] for p in _ours(out)]
    assert roots[0] == str(extra.resolve()) and "env" not in _ours(out)[0]  # -s first, as given
    assert len(roots) == 5


def test_many_environments_of_one_release(tmp_path, cli):
    """A dozen actors on one release: each patched on its own, the file transformed once."""
    top = tmp_path / "envs"
    sps = []
    for i in range(12):
        sp = _venv(top / f"actor-{i:02d}")
        _install(sp, "0.33.0")
        sps.append(sp)
    code, out = cli.json("apply", "--envs", top)
    assert code == 0 and [p["status"] for p in _ours(out)] == ["applied"] * 12
    patched = {(sp / NEMOTRON).read_bytes() for sp in sps}
    assert len(patched) == 1
    for sp in sps:  # each root has its own state: revert of one leaves the others
        assert json.loads((sp / ".fp32patch" / "manifest.json").read_text())["entries"][0]["state"] == "applied"


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda t: t / "nowhere", "--envs {p}: does not exist"),
        (lambda t: (t / "f").write_text("x") and t / "f", "--envs {p}: is not a folder"),
        (lambda t: (t / "plain" / "lib").mkdir(parents=True) or t / "plain", "--envs {p}: no Python environment"),
    ],
)
def test_bad_envs_folder(make, words, tmp_path, cli):
    path = make(tmp_path)
    before = tree_digest(tmp_path)
    for command in ("apply", "verify", "revert"):
        result = cli(command, "--envs", path)
        assert result.exit_code == 2
        assert words.format(p=path) in " ".join(result.stderr.split())
    assert tree_digest(tmp_path) == before


def test_environment_discovery_does_not_follow_links(tmp_path):
    from fp32patch.patcher.envs import find_environments

    top = tmp_path / "top"
    _venv(top / "a" / "venv")
    (top / "a" / "venv" / "lib" / "nested-venv-is-not-looked-for").mkdir()
    os.symlink(top, top / "a" / "up")
    outside = _venv(tmp_path / "outside" / "venv")
    os.symlink(outside.parents[2], top / "linked-venv")
    found = find_environments(top)
    assert [env.relative_to(top).as_posix() for env, _ in found] == ["a/venv"]
