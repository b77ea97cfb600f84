"""TRL 1.14.2, the newest release before chunked log-probs, from its PyPI wheel, patched by
``fp32patch apply`` (variant ``full-logits``) and run over this environment's dependencies: the
switch converts GRPO's policy and reference heads (fp32patch's HF head: fp32 logits within
1e-5 of float64 of the bf16 operands, under TRL's bf16 autocast), and ``use_liger_kernel``,
whose GRPO path reads ``lm_head.weight`` in bf16 tiles in that release, is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from tests.heavy.trl.conftest import REPO
from tests.support.pypi import wheel_file

pytestmark = pytest.mark.xdist_group("trainers")

RELEASE = "1.14.2"


def test_the_full_logits_path_through_the_hf_head(tmp_path, model_dir):
    root = tmp_path / "root"
    with zipfile.ZipFile(wheel_file("trl", RELEASE)) as wheel:
        wheel.extractall(root)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "fp32patch", "apply", "-s", str(root), "--patch", "trl-fp32-lm-head", "--json"],
        cwd=REPO, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    (entry,) = json.loads(done.stdout)["patches"]
    assert (entry["status"], entry["variant"]) == ("applied", "full-logits")
    out = tmp_path / "out.json"
    subprocess.run(
        [sys.executable, "-m", "tests.heavy.trl.full_logits", str(model_dir), str(out)],
        cwd=REPO, env={**env, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}, check=True,
    )  # fmt: skip
    got = json.loads(out.read_text())
    assert got["trl"] == RELEASE and got["trl_file"].startswith(str(root))
    assert got["modes"] == ["fp32out", "fp32out"] and got["marks"] == ["fp32out", "fp32out"]
    assert got["logits_dtypes"] == ["torch.float32", "torch.float32"]
    assert max(got["relative_errors"]) < 1e-5, got["relative_errors"]
    assert "together with use_liger_kernel" in got["liger"] and "bf16 tiles" in got["liger"]
