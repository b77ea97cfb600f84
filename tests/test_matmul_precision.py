"""TF32 is allowed (tf32 mode) or forbidden (fp32 mode) only around the head's GEMMs, in
whichever of torch's two flag APIs the trainer uses, and restored afterwards."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from fp32patch.runtime.lm_head_gemm import lm_head_linear
from fp32patch.runtime.matmul_precision import cuda_tf32

matmul = torch.backends.cuda.matmul


@pytest.fixture
def legacy_flag():
    """The legacy flag as this process has it, put back after the test."""
    before = matmul.allow_tf32
    yield
    matmul.allow_tf32 = before


@pytest.mark.parametrize("trainer_setting", [False, True])
@pytest.mark.parametrize("enabled", [False, True])
def test_legacy_flag_is_set_inside_and_restored(legacy_flag, trainer_setting, enabled):
    matmul.allow_tf32 = trainer_setting
    with cuda_tf32(enabled):
        assert matmul.allow_tf32 is enabled
    assert matmul.allow_tf32 is trainer_setting


def test_legacy_flag_is_restored_when_the_block_raises(legacy_flag):
    matmul.allow_tf32 = False
    with pytest.raises(RuntimeError, match="boom"), cuda_tf32(True):
        raise RuntimeError("boom")
    assert matmul.allow_tf32 is False


@pytest.mark.parametrize(("mode", "trainer_setting", "inside"), [("tf32", False, True), ("fp32", True, False)])
def test_the_head_sets_the_flag_only_around_its_gemms(legacy_flag, monkeypatch, mode, trainer_setting, inside):
    seen: list[bool] = []
    real_mm = torch.mm

    def spy(*args, **kwargs):
        seen.append(matmul.allow_tf32)
        return real_mm(*args, **kwargs)

    matmul.allow_tf32 = trainer_setting
    monkeypatch.setattr(torch, "mm", spy)
    x = torch.randn(4, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, 8, dtype=torch.bfloat16, requires_grad=True)
    out = lm_head_linear(x, w, None, mode)
    assert matmul.allow_tf32 is trainer_setting  # between forward and backward
    out.sum().backward()
    assert matmul.allow_tf32 is trainer_setting
    assert seen == [inside] * 3  # forward, input gradient, weight gradient


def test_a_trainer_on_the_new_api_keeps_working():
    # Once a process sets fp32_precision, reading allow_tf32 raises: the helper must speak
    # the new API then. Run apart: the setting would leak into the other tests.
    script = textwrap.dedent(
        """
        import torch
        from fp32patch.runtime.matmul_precision import cuda_tf32
        m = torch.backends.cuda.matmul
        m.fp32_precision = "ieee"
        with cuda_tf32(True):
            assert m.fp32_precision == "tf32", m.fp32_precision
        assert m.fp32_precision == "ieee", m.fp32_precision
        with cuda_tf32(False):
            assert m.fp32_precision == "ieee"
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
