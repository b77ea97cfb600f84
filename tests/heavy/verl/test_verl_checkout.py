"""Opt-in: verl's own dp_actor test from a verl checkout, on two gloo ranks (torchrun), over the
patched tree, with the switch off and on.

    FP32PATCH_VERL_CHECKOUT=/path/to/verl FP32PATCH_HEAVY=1 PYTHONPATH=$PWD \\
      ~/.cache/fp32patch-tests/envs/verl-0.7.1/bin/python -m pytest tests/heavy/verl/test_verl_checkout.py

verl's sdist does not carry ``tests/workers/actor/test_special_dp_actor.py`` (and CI reaches only
PyPI), so this runs where a checkout is given. Off: the test passes on the patched tree as on
the stock one. On (``dp_actor_fp32.py``): every Hugging Face model verl's ``DataParallelPPOActor``
is handed gets fp32patch's head the way the patched legacy worker wires it, at temperature 0.7;
the test passes, and every logits tensor the head returned is fp32.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from verl_harness import REPO, installed_dist_info, patched_root

CHECKOUT = os.environ.get("FP32PATCH_VERL_CHECKOUT")
TEST = "tests/workers/actor/test_special_dp_actor.py"
HERE = Path(__file__).resolve().parent

# the legacy dp_actor the test drives is 0.7's (0.6.1-0.7.1 train through it by default); on
# 0.9.1 the test of a January 2026 checkout fails on the stock tree too
LEGACY = installed_dist_info().name.startswith(("verl-0.6.", "verl-0.7."))
pytestmark = [
    pytest.mark.skipif(not CHECKOUT, reason="FP32PATCH_VERL_CHECKOUT names no verl checkout"),
    pytest.mark.skipif(not LEGACY, reason="verl's dp_actor test is run against 0.6/0.7, whose legacy workers use it"),
]


@pytest.fixture(scope="module")
def test_file(tmp_path_factory) -> Path:
    source = Path(CHECKOUT) / TEST
    assert source.is_file(), f"{source} is not there: FP32PATCH_VERL_CHECKOUT must be a verl checkout"
    target = tmp_path_factory.mktemp("verl-dp-actor") / source.name
    shutil.copy(source, target)
    return target


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return patched_root(tmp_path_factory.mktemp("verl-dp-actor-tree"))


def torchrun(test_file: Path, tree: Path | None, *plugin: str, report: Path | None = None):
    path = [str(p) for p in (tree, REPO, HERE) if p is not None] if plugin else [str(p) for p in (tree,) if p]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "NRL_VLLM_FP32_LM_HEAD")}
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1")
    if report is not None:
        env["FP32PATCH_DP_ACTOR_REPORT"] = str(report)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command += ["-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q", *plugin, str(test_file)]
    return subprocess.run(command, cwd=test_file.parent, env=env, capture_output=True, text=True, timeout=300)


def passed(result) -> str:
    assert result.returncode == 0, (result.stdout + result.stderr)[-5000:]
    return result.stdout


def test_stock_tree(test_file):
    assert "5 passed" in passed(torchrun(test_file, None))


def test_patched_tree_switch_off(test_file, root):
    assert "5 passed" in passed(torchrun(test_file, root))


def test_patched_tree_switch_on(test_file, root, tmp_path):
    report = tmp_path / "report"
    assert "5 passed" in passed(torchrun(test_file, root, "-p", "dp_actor_fp32", report=report))
    for rank in (0, 1):
        record = json.loads(Path(f"{report}.rank{rank}").read_text())
        assert record["wired"] >= 1, record  # the Qwen3 test's model
        assert set(record["not_wired"]) <= {"MockTransformerModel"}, record
        assert record["dtypes"] and set(record["dtypes"]) == {"torch.float32"}, record
        assert record["temperatures"] and set(record["temperatures"]) == {0.7}
