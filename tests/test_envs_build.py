"""The heavy test environments are built from locks kept in the repository.

A lock pins every distribution at an exact version, so a fresh machine tests what passed on
the day the lock was refreshed; a changed lock rebuilds its environment.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

BUILD = Path(__file__).parent / "envs" / "build.py"
PINNED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")


@pytest.fixture
def envs(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("fp32patch_test_envs", BUILD)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("FP32PATCH_TEST_CACHE", str(tmp_path / "cache"))
    return module


def test_every_recipe_has_a_lock_and_every_lock_a_recipe(envs):
    locks = {path.stem for path in envs.LOCKS.glob("*.txt")}
    assert locks == set(envs.RECIPES)


@pytest.mark.parametrize("name", sorted(p.stem for p in (BUILD.parent / "locks").glob("*.txt")))
def test_a_lock_pins_every_distribution_at_one_exact_version(envs, name):
    lines = [line for line in envs.lock_path(name).read_text().splitlines() if line and not line.startswith("#")]
    assert lines, f"{name}: empty lock"
    loose = [line for line in lines if not PINNED.match(line)]
    assert not loose, f"{name}: not pinned exactly: {loose}"
    names = [line.split("==")[0].lower().replace("_", "-") for line in lines]
    assert len(names) == len(set(names)), f"{name}: a distribution listed twice"
    # what the suites themselves need is in every lock, and setuptools: a fresh venv's own
    # (65.5 on Python 3.11) fails pip check under torch 2.14 (setuptools>=77.0.3); pip is not
    # locked, every build upgrades it
    assert {"pytest", "libcst", "typer", "rich", "packaging", "setuptools"} <= set(names)
    assert "pip" not in names


def test_a_changed_lock_rebuilds_its_environment(envs, monkeypatch, tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    monkeypatch.setattr(envs, "LOCKS", locks)
    monkeypatch.setitem(envs.RECIPES, "demo", [])
    (locks / "demo.txt").write_text("six==1.16.0\n")
    target = envs.env_dir("demo")
    (target / "bin").mkdir(parents=True)
    (target / "bin" / "python").symlink_to(sys.executable)
    (target / ".fp32patch-lock").write_text(envs._stamp("demo"))
    assert envs.is_ready("demo")
    (locks / "demo.txt").write_text("six==1.17.0\n")
    assert not envs.is_ready("demo")


def test_an_environment_without_a_lock_is_refused_with_the_command_that_writes_one(envs, monkeypatch, tmp_path):
    monkeypatch.setattr(envs, "LOCKS", tmp_path)
    monkeypatch.setitem(envs.RECIPES, "demo", [])
    with pytest.raises(SystemExit, match=r"no lock .*python tests/envs/build.py --refresh demo"):
        envs.build("demo")


def test_an_unknown_environment_is_refused(envs):
    with pytest.raises(SystemExit, match="unknown test environment 'nope'; known: "):
        envs.build("nope")


def test_a_recipes_install_flags_reach_the_build_from_its_lock(envs, monkeypatch, tmp_path):
    # a lock is installed with --no-deps; a flag the recipe needed to resolve (megatron-core
    # declares a newer Python than some of ours) is needed again to install it
    assert envs.lock_flags("megatron") == ["--ignore-requires-python"]
    assert envs.lock_flags("vllm-0.33") == []
    monkeypatch.setattr(envs, "LOCKS", tmp_path)
    (tmp_path / "megatron.txt").write_text("six==1.16.0\n")
    runs: list[list[str]] = []
    monkeypatch.setattr(envs, "_fresh_venv", lambda target: (target.mkdir(parents=True), ["pip"])[1])
    monkeypatch.setattr(envs.subprocess, "run", lambda args, **kw: runs.append(args))
    envs.build("megatron")
    assert runs[0] == [
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--ignore-requires-python",
        "-r",
        str(tmp_path / "megatron.txt"),
    ]
