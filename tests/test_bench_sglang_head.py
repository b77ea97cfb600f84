"""Smoke runs on the CPU of what the lead runs on the H200 for SGLang's head: bench/sglang_head.py
(its logic, shapes and JSON; times not read) and the device-free tests of tests/gpu/test_sglang_cuda.py."""

from __future__ import annotations

import json

import pytest
import torch

from bench import lm_head, sglang_head
from tests.gpu import test_sglang_cuda as gpu


def test_the_benchmark_runs_its_three_ways_and_writes_its_json(tmp_path, monkeypatch):
    monkeypatch.setattr(lm_head, "DEVICE", "cuda")  # main() sets it back to the CPU for --cpu
    out = tmp_path / "sglang-head.json"
    argv = ["--cpu", "--quick", "--rounds", "2", "--iters", "1", "--warmup", "0", "--out", str(out)]
    assert sglang_head.main(argv) == 0
    results = json.loads(out.read_text())
    assert lm_head.DEVICE == "cpu" and results["settings"]["rounds"] == 2
    [shape] = results["shapes"]
    assert shape["shape"] == {"tokens": 256, "hidden": 512, "vocab": 4096}
    ways = shape["ways"]
    assert list(ways) == ["bf16", "sglang 0.5.3-0.5.17", "fp32out (patched)"]
    assert ways["bf16"]["ratio"] == 1.0 and all(len(ways[w]["ms_rounds"]) == 2 for w in list(ways)[1:])
    assert [ways[w]["logits_dtype"] for w in ways] == ["bfloat16", "float32", "float32"]
    # fp32 logits: log-probs an order of magnitude and more closer to float64's than bf16's
    assert ways["fp32out (patched)"]["mean_abs_dlogp"] < ways["bf16"]["mean_abs_dlogp"] / 100
    # the full run's shapes: bench/lm_head.py's, then decode batches
    assert sglang_head.SHAPES[: len(lm_head.SHAPES)] == lm_head.SHAPES


@pytest.mark.parametrize(
    "test",
    [
        gpu.test_mixed_or_fp32_operands_keep_sglangs_upcast,
        gpu.test_without_fp32patch_the_patched_file_is_sglangs_upcast,
    ],
)
def test_the_cuda_tests_device_free_parts_on_the_cpu(test, monkeypatch):
    monkeypatch.setattr(gpu, "DEVICE", "cpu")
    test(monkeypatch) if "monkeypatch" in test.__code__.co_varnames else test()


def test_the_patched_head_on_the_cpu_is_the_exact_upcast():
    h = torch.randn(8, 32).bfloat16()
    w = torch.randn(64, 32).bfloat16()
    assert torch.equal(gpu._patched_head()(h, w), gpu._sglang_upcast(h, w))
