"""bench/step_counts.py: a whole step's peak memory, operations and Triton launches from fake
tensors, on the CPU. Its numbers are checked here against what the library says it holds (the
kept logits: 4 bytes a logit and 4 more for the backward's copies; a recomputed tile: the same
per logit of the tile; the stock head: 10 or more) and launches, on a one-layer model whose head
dominates the step. It lives in this suite because this environment carries Triton (imported by
the CUDA path the tool counts, never run)."""

from __future__ import annotations

import pytest
import torch

from bench import step, step_counts
from fp32patch.runtime.kernels import fp32out
from fp32patch.runtime.kernels.chunked_logprobs import choose_tiles

pytest.importorskip("triton")

MIB = 2**20
T, V = 2048, 200_000  # a head of 390M logits beside a one-layer model of a few MiB


@pytest.fixture
def wide_model():
    step.MODELS["wide"] = dict(hidden=64, mlp=128, layers=1, heads=2, kv=1, vocab=V, tied=True)
    yield "wide"
    del step.MODELS["wide"]


def test_peaks_are_what_each_way_holds(wide_model):
    results = step_counts.run([wide_model], [T], ["stock", "fp32patch", "fp32patch-recompute"], [False, True])
    assert step.DEVICE == "cuda" and fp32out.TRITON_DEVICE_TYPES == {"cuda"}  # put back
    by_entropy = {c["entropy"]: {k: v["peak_gib"] * 2**30 for k, v in c["ways"].items()} for c in results["cells"]}
    width = choose_tiles(T, V, 64)[1]
    assert 1 < -(-V // width) < 10  # a short call: a few wide blocks
    for entropy, peak in by_entropy.items():
        kept = 8 * T * V  # the fp32 logits and, in the backward, their two 16-bit copies
        assert kept <= peak["fp32patch"] <= kept + 128 * MIB, (entropy, peak)
        tile = 8 * T * width
        assert tile <= peak["fp32patch-recompute"] <= tile + 128 * MIB, (entropy, peak)
        assert peak["stock"] >= 10 * T * V  # bf16 logits, an fp32 copy, the log-softmax's output...
        assert peak["fp32patch"] < peak["stock"]
    assert by_entropy[True]["stock"] > by_entropy[False]["stock"] + 4 * T * V  # stock's entropy: more [T, V]
    assert abs(by_entropy[True]["fp32patch"] - by_entropy[False]["fp32patch"]) < MIB  # the entropy: [T] vectors


def test_a_short_steps_launches_and_added_operations():
    # the kept-logits step launches one fold, two gradient passes, the gradient's scales from its
    # column maxima and fp32out's three conversions of x, and adds a few dozen operations to the
    # stock step's (a bound, so that the head's host work cannot creep up unseen: 43 and 15 when
    # written, 25 and 11 since the scales are one launch instead of a dozen operations)
    results = step_counts.run(["tiny-tied"], [40], ["stock", "fp32patch"], [False, True])
    assert [(c["tokens"], c["entropy"]) for c in results["cells"]] == [(40, False), (40, True)]
    for cell in results["cells"]:
        stock, ours = cell["ways"]["stock"], cell["ways"]["fp32patch"]
        assert stock["triton_launches"] == 0 and stock["aten_ops"] > 300
        assert ours["launches"] == {
            "fold_kernel": 1, "grad_kernel": 2, "scales_kernel": 2, "convert_kernel": 1, "unscale_kernel": 1,
        }  # fmt: skip
        assert 0 < ours["aten_ops"] - stock["aten_ops"] <= 30, cell
    table = step_counts.table(results)
    assert "| tiny-tied | 40 | off |" in table and "0 → 7" in table


@pytest.mark.parametrize("strips", [None, "0"])
def test_recomputed_blocks_make_the_rows_fp16_copy_once_and_their_scales_in_one_launch(monkeypatch, strips):
    # the recomputing way over several vocabulary blocks of one tile of rows: per block, the
    # strip kernel (the default for a tile it holds: its scales and copies in one launch) or the
    # two gradient passes and the scales, then the unscaling (x's scales and copy once for all)
    from fp32patch.runtime.kernels import chunked_logprobs as cl

    if strips is None:
        monkeypatch.delenv(cl.STRIPS_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(cl.STRIPS_ENV_VAR, strips)
    results = step_counts.run(["tiny-tied"], [40], ["fp32patch@40,64"], [False])
    (cell,) = results["cells"]
    launches = cell["ways"]["fp32patch@40,64"]["launches"]
    blocks = -(-step.MODELS["tiny-tied"]["vocab"] // 64)
    assert blocks > 2
    assert launches["unscale_kernel"] == blocks and launches["convert_kernel"] == 1
    if strips is None:
        assert launches["strip_kernel"] == blocks and "grad_kernel" not in launches
        assert launches["scales_kernel"] == 1
    else:
        assert launches["grad_kernel"] == 2 * blocks and "strip_kernel" not in launches
        assert launches["scales_kernel"] == blocks + 1


def test_counting_stops_above_the_asked_length():
    results = step_counts.run(["tiny-tied"], [40], ["stock"], [False], count_upto=39)
    (cell,) = results["cells"]
    assert set(cell["ways"]["stock"]) == {"peak_gib"}
    assert "| — | — |" not in step_counts.table(results)  # no pair in this run: no table rows
    assert torch.get_default_dtype() == torch.float32
