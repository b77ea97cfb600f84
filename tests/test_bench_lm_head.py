"""The LM-head benchmark's measuring logic on the CPU: interleaved rounds, per-round ratios,
and a stock bf16 baseline whose gradients are Megatron's."""

from __future__ import annotations

import pytest
import torch

from bench import lm_head
from fp32patch.runtime import hf_lm_head


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lm_head, "DEVICE", "cpu")


def test_rounds_rotate_the_order_and_pair_every_way_with_a_bf16_time(
    cpu: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    fake = iter(range(100))
    monkeypatch.setattr(lm_head, "time_ms", lambda fn, warmup, iters, min_ms: (fn(), float(next(fake)))[1])
    fns = {name: (lambda name=name: calls.append(name)) for name in ("bf16", "a", "b")}
    times, paired = lm_head.time_rounds(fns, warmup=0, iters=1, rounds=3)
    # each round starts one way later; bf16 is timed right before each way in even rounds,
    # right after it in odd ones
    assert calls == ["bf16", "a", "bf16", "b", "b", "bf16", "a", "bf16", "bf16", "a", "bf16", "b"]
    assert times == {"bf16": [0.0, 2.0, 5.0, 7.0, 8.0, 10.0], "a": [1.0, 6.0, 9.0], "b": [3.0, 4.0, 11.0]}
    assert paired == {"a": [0.0, 7.0, 8.0], "b": [2.0, 5.0, 10.0], "bf16": times["bf16"]}


def test_time_ms_runs_at_least_min_ms(cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter(x * 0.001 for x in range(0, 10_000, 2))  # each call takes 2 ms
    monkeypatch.setattr(lm_head.time, "perf_counter", lambda: next(clock))
    calls: list[int] = []
    assert lm_head.time_ms(lambda: calls.append(1), warmup=1, iters=3, min_ms=0) == pytest.approx(2.0)
    assert len(calls) == 1 + 3
    calls.clear()
    lm_head.time_ms(lambda: calls.append(1), warmup=0, iters=3, min_ms=20)
    assert len(calls) == 10


def test_ratios_are_per_round_medians_against_the_paired_bf16_time() -> None:
    rows = {"bf16": {}, "x": {}}
    # the bf16 time drifts; x is always 1.1x the bf16 time taken next to it
    times = {"bf16": [10.0, 9.0, 20.0, 21.0, 12.0], "x": [11.0, 22.0, 13.2]}
    paired = {"bf16": times["bf16"], "x": [10.0, 20.0, 12.0]}
    lm_head._add_times(rows, times, paired)
    assert rows["bf16"]["ratio"] == 1.0
    assert rows["x"]["ratio"] == pytest.approx(1.1)
    assert (rows["x"]["ratio_min"], rows["x"]["ratio_max"]) == (pytest.approx(1.1), pytest.approx(1.1))
    assert rows["x"]["ms"] == 13.2  # the median time, reported beside the ratio
    assert rows["x"]["ms_rounds"] == [11.0, 22.0, 13.2]
    assert rows["bf16"]["ms"] == 12.0


def test_stock_linear_gives_megatrons_gradients() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 8, generator=gen).bfloat16().requires_grad_(True)
    w = torch.randn(5, 8, generator=gen).bfloat16().requires_grad_(True)
    g = torch.randn(6, 5, generator=gen).bfloat16()
    lm_head.StockLinear.apply(x, w).backward(g)
    assert torch.equal(x.grad, g @ w.detach())
    assert torch.equal(w.grad, g.t() @ x.detach())
    assert w.grad.is_contiguous()


def test_training_bench_runs_every_way_on_the_cpu(cpu: None) -> None:
    block = lm_head.bench_training((64, 32, 128), warmup=0, iters=1, rounds=2)
    ways = block["ways"]
    assert list(ways) == lm_head.TRAIN_WAYS
    assert block["rounds"] == 2
    assert ways["bf16"]["ratio"] == 1.0
    for way, row in ways.items():
        # bf16 is timed next to each of the other ways, in every round
        assert len(row["ms_rounds"]) == 2 * (len(ways) - 1 if way == "bf16" else 1)
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    # the weight gradient: fp32out at or below TF32's error, far below bf16's
    assert ways["fp32out"]["rel_err_dw_main_grad"] < ways["bf16"]["rel_err_dw_main_grad"] / 4
    assert ways["fp32"]["rel_err_dw_main_grad"] < 1e-6


def test_plot_labels_of_close_points_are_stacked() -> None:
    class Axes:
        def __init__(self) -> None:
            self.labels: dict[str, tuple[int, int]] = {}

        def scatter(self, *args: object, **kwargs: object) -> None:
            pass

        def annotate(self, name: str, xy: object, textcoords: str, xytext: tuple[int, int]) -> None:
            self.labels[name] = xytext

    ax = Axes()
    lm_head._points(ax, [("bf16", 1.0, 4.6e-4), ("casts", 1.1, 4.6e-4), ("bf16grad", 1.05, 4.6e-4), ("far", 2.4, 6e-5)])
    # same error, close in time: each next label one line lower; a distant point is left alone
    assert ax.labels == {"bf16": (6, 4), "casts": (6, -8), "bf16grad": (6, -20), "far": (6, 4)}


def test_hf_head_bench_runs_every_way_on_the_cpu(cpu: None) -> None:
    block = lm_head.bench_hf_head((64, 32, 128, True), warmup=0, iters=1, rounds=2)
    assert block["shape"] == {"tokens": 64, "hidden": 32, "vocab": 128, "tied": True}
    for part in ("inference", "training"):
        ways = block[part]
        assert list(ways) == lm_head.HF_WAYS and ways["bf16"]["ratio"] == 1.0
        for way, row in ways.items():
            assert len(row["ms_rounds"]) == 2 * (len(ways) - 1 if way == "bf16" else 1)
            assert row["extra_bytes_persistent"] == 0
    # the converted heads give fp32 logits: log-probs far closer to float64's than the stock head's
    inference = block["inference"]
    assert inference["fp32out"]["mean_abs_dlogp"] * 100 < inference["bf16"]["mean_abs_dlogp"]


def test_hf_head_ways_are_the_stock_head_and_the_converted_one(cpu: None) -> None:
    h = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    stock, ours = lm_head.HfCausalLM(w, tied=True), lm_head.HfCausalLM(w, tied=True)
    assert stock.lm_head.weight is stock.embed_tokens.weight
    hf_lm_head.apply_fp32_lm_head(ours, "fp32out")
    with torch.no_grad():
        assert torch.equal(lm_head.hf_logits(stock, h), (h.bfloat16() @ w.t()).float())
        assert torch.equal(lm_head.hf_logits(ours, h), h.bfloat16().float() @ w.float().t())


def test_replot_draws_the_plot_an_earlier_run_has_data_for(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    import json
    import sys

    drawn: list[tuple[str, object]] = []
    monkeypatch.setattr(lm_head, "plot", lambda results, path: drawn.append(("plot", path)))
    monkeypatch.setattr(lm_head, "plot_hf", lambda results, path: drawn.append(("plot_hf", path)))
    hf_only = tmp_path / "hf.json"
    hf_only.write_text(json.dumps({"inference": [], "training": [], "hf": [{"shape": {}}]}))
    full = tmp_path / "full.json"
    full.write_text(json.dumps({"inference": [{"shape": {}}], "training": [], "hf": [{"shape": {}}]}))
    for source in (hf_only, full):
        monkeypatch.setattr(sys, "argv", ["lm_head.py", "--replot", str(source), "--plot", str(tmp_path / "p.png")])
        assert lm_head.main() == 0
    assert drawn == [("plot_hf", tmp_path / "p.png"), ("plot", tmp_path / "p.png")]
    monkeypatch.setattr(sys, "argv", ["lm_head.py", "--replot", str(full)])
    with pytest.raises(SystemExit):
        lm_head.main()  # --replot needs --plot
