"""verl's own CPU tests (the ``*_on_cpu.py`` files its sdist ships) on the patched tree give what
they give on the stock one, test by test.

The sdist of the installed release is downloaded from PyPI into ``$FP32PATCH_TEST_CACHE/sdists``
(nothing of it is committed), its ``tests/`` unpacked to a temp folder, and run twice, side by
side, with the environment's interpreter: beside the installed verl, and beside the copy
``fp32patch apply`` patched (a ``verl`` link next to ``tests/``, as in a checkout). The switch is off in both: a patched image whose config
does not ask for the fp32 head must behave as stock verl does. Tests that fail on the stock tree
too (0.7.1: two YAML files its sdist does not ship) must fail alike.

verl's GPU-marked and distributed tests (the FSDP engine, the legacy dp_actor) are not in the
sdist; ``test_verl_fsdp_engine.py`` runs the FSDP engine itself, and
``FP32PATCH_VERL_CHECKOUT`` runs the dp_actor test of a verl checkout (``test_verl_checkout.py``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from verl_harness import installed_dist_info, patched_root

# verl's own tests pass on the stock tree here in at least these numbers (without the Ray
# tests, 2026-12-02: 0.9.1 307 of 307, 0.7.1 135 of 137, two YAML files its sdist lacks): a run
# that collects nothing cannot pass for "the same"
MIN_PASSED = 100
# verl's Ray worker-group tests (single_controller: local Ray clusters, minutes on two cores)
# drive no file the patch changes; FP32PATCH_VERL_OWN_TESTS=all runs them too
RAY_TESTS = "tests/single_controller/"


def cache() -> Path:
    return Path(os.environ.get("FP32PATCH_TEST_CACHE", Path.home() / ".cache" / "fp32patch-tests")) / "sdists"


def installed_version() -> str:
    return installed_dist_info().name.removeprefix("verl-").removesuffix(".dist-info")


def sdist(version: str) -> Path:
    target = cache() / f"verl-{version}.tar.gz"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "--no-build-isolation"]
            + [f"verl=={version}", "-d", str(target.parent)],
            check=True,
        )
    assert target.is_file(), f"pip left no {target.name} in {target.parent}"
    return target


@pytest.fixture(scope="module")
def own_tests(tmp_path_factory) -> Path:
    version = installed_version()
    where = tmp_path_factory.mktemp("verl-sdist")
    prefix = f"verl-{version}/tests/"
    with tarfile.open(sdist(version)) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        archive.extractall(where, members=members, filter="data")
    return where / f"verl-{version}"


def start(own_tests: Path, tree: Path, out: Path) -> tuple[subprocess.Popen, Path]:
    """verl's own CPU tests, started from a copy of the sdist's ``tests/`` beside a ``verl``
    link to the tree under test (their YAML paths are relative to a checkout's root, and the
    folder they run from comes first on ``sys.path``); returns the run and its report."""
    project = out / "project"
    shutil.copytree(own_tests / "tests", project / "tests")
    (project / "verl").symlink_to(tree / "verl", target_is_directory=True)
    files = sorted(str(p.relative_to(project)) for p in (project / "tests").rglob("*_on_cpu.py"))
    if not os.environ.get("FP32PATCH_VERL_OWN_TESTS") == "all":
        files = [f for f in files if not f.startswith(RAY_TESTS)]
    assert files, f"no *_on_cpu.py under {project / 'tests'}"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NRL_VLLM_FP32_LM_HEAD")}
    where = subprocess.run(
        [sys.executable, "-c", "import verl; print(verl.__file__)"],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
    )
    assert Path(where.stdout.strip()).resolve().is_relative_to(tree.resolve()), (where.stdout, where.stderr[-2000:])
    report = out / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-p", "no:xdist", f"--junitxml={report}"]
    log = open(out / "log.txt", "w")  # noqa: SIM115  (closed with the run)
    run = subprocess.Popen([*command, *files], cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
    return run, report


def outcomes(report: Path) -> dict[str, str]:
    """Each test's outcome (passed, failed, skipped, error) from a junit report."""
    result = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        result[f"{case.get('classname')}::{case.get('name')}"] = kinds[0] if kinds else "passed"
    return result


@pytest.fixture(scope="module")
def runs(own_tests, tmp_path_factory) -> dict[str, dict[str, str]]:
    """The stock and the patched run, side by side (most of their time is Ray starting up)."""
    root = patched_root(tmp_path_factory.mktemp("verl-own-tree"))
    started = {
        "stock": start(own_tests, installed_dist_info().parent, tmp_path_factory.mktemp("verl-own-stock")),
        "patched": start(own_tests, root, tmp_path_factory.mktemp("verl-own-patched")),
    }
    result = {}
    for name, (run, report) in started.items():
        run.wait(timeout=1500)
        assert report.is_file(), f"the {name} run of verl's own tests wrote no report (exit {run.returncode})"
        result[name] = outcomes(report)
    return result


@pytest.fixture(scope="module")
def stock(runs) -> dict[str, str]:
    return runs["stock"]


@pytest.fixture(scope="module")
def patched(runs) -> dict[str, str]:
    return runs["patched"]


def test_verl_own_cpu_tests_run(stock):
    passed = sum(1 for kind in stock.values() if kind == "passed")
    assert passed >= MIN_PASSED, stock


def test_the_patched_tree_gives_each_of_verls_own_tests_the_stock_outcome(stock, patched):
    assert patched.keys() == stock.keys()
    changed = {name: (stock[name], patched[name]) for name in stock if stock[name] != patched[name]}
    assert not changed, changed
