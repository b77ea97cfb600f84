"""The whole-step benchmark (bench/step.py) on the CPU: a smoke run of the grid on a tiny
Qwen2-shaped model, tied and untied; the ways it compares compute the same log-probs and
entropy (fp32patch's at fp32 grade); a way that runs out of memory is recorded as such and the
others still run; choose_tiles' table comes out of a head sweep's numbers."""

from __future__ import annotations

import gc
import json
import statistics

import pytest
import torch

from bench import step
from fp32patch.runtime.kernels.chunked_logprobs import DEFAULT_CHUNK_ROWS, DEFAULT_CHUNK_VOCAB, choose_tiles


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(step, "DEVICE", "cpu")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny products: a second thread only spins
    yield
    torch.set_num_threads(threads)


MODELS = ["tiny-tied", "tiny-untied"]


def test_smoke_run_times_every_way_and_writes_the_tables(tmp_path, capsys) -> None:
    out = tmp_path / "step.json"
    ways = ["stock", "fp32patch", "fp32patch-recompute", "verl-fused", "trl-chunked", "fp32patch-trl"]
    ways += ["prime-rl-fused", "fp32patch-prime-rl", "skyrl-fused", "fp32patch-skyrl", "fp32patch-trl-bf16grad"]
    ways += ["fp32patch-trl-rows4k", "fp32patch-trl-bf16grad-rows4k", "fp32patch-trl-strips"]
    ways += ["fp32patch-recompute-strips", "fp32patch-trl-passes", "fp32patch-recompute-passes"]
    try:
        assert step.main(["--cpu", "--models", *MODELS, "--tokens", "24", "--out", str(out), "--ways", *ways]) == 0
    finally:
        step.DEVICE = "cuda"
    results = json.loads(out.read_text())
    cells = {(c["model"], c["entropy"]): c for c in results["cells"]}
    assert set(cells) == {(m, e) for m in MODELS for e in (False, True)}
    for (_, entropy), cell in cells.items():
        # TRL's chunked path gives log-probs only: it sits out the entropy cells
        expected = {w for w in ways if not entropy or step.WAYS[w][1]}
        assert set(cell["ways"]) == expected
        assert all(r["ms"] > 0 and len(r["ms_steps"]) == 1 for r in cell["ways"].values())
        assert not any("device_ms" in r for r in cell["ways"].values())  # the device's busy time: CUDA's
        assert cell["tiles"] == list(choose_tiles(24, step.MODELS["tiny-tied"]["vocab"], 32))
    printed = capsys.readouterr().out
    assert "| tiny-untied | 24 | on |" in printed and "| tiny-tied | 24 | off |" in printed
    assert " | — | — | " in printed  # no busy time on the CPU, said as such
    for stack, _, _ in [*step.PAIRS[:3], *step.PAIRS[4:]]:
        assert f"### {stack}" in printed


@pytest.mark.parametrize("name", ["tiny-tied", "tiny-untied"])
def test_the_ways_compute_the_same_log_probs(cpu: None, name: str) -> None:
    model = step.build_model(name, "torch")
    cell = step.Cell(model, 20, step.MODELS[name]["vocab"], seed=3)
    with torch.no_grad():
        # logits of real models' size (max |z| ~ 10-20), not the init's ~0.1 (a tied head scales
        # the embedding too, which then dominates the one-layer body)
        model.lm_head.weight.mul_(10 if step.MODELS[name]["tied"] else 40)
        hidden = model.model(cell.ids).last_hidden_state[0]
        z = (hidden.double() @ model.lm_head.weight.double().t()) / step.TEMPERATURE
        ref = torch.log_softmax(z, dim=-1)
        ref_logp = ref.gather(1, cell.targets[0, :, None])[:, 0]
        ref_ent = -(ref.exp() * ref).sum(-1)
        got = {w: step.way(w)[0](model, cell.ids, cell.targets, True) for w in ("stock", "fp32patch", "verl-fused")}
    logp, ent = got["fp32patch"]
    assert (logp[0].double() - ref_logp).abs().max() < 1e-5  # an exact upcast on the CPU
    assert (ent[0].double() - ref_ent).abs().max() < 1e-5
    assert ref_logp.abs().mean() > 2 and ref_ent.mean() > 0.5  # neither uniform nor one-hot
    for w in ("stock", "verl-fused"):  # the bf16 head's logits: bf16 grade
        assert (got[w][0][0].double() - ref_logp).abs().max() < 0.25
        assert (got[w][1][0].double() - ref_ent).abs().max() < 0.25
    for w in ("trl-chunked", "skyrl-fused"):  # log-probs only, from bf16 logits
        lp = step.way(w)[0](model, cell.ids, cell.targets, False)[0]
        assert (lp[0].double() - ref_logp).abs().max() < 0.25
        assert (lp[0].double() - ref_logp).abs().max() > 1e-4  # and not fp32 grade
    with torch.no_grad():
        prime_logp, prime_ent = step.way("fp32patch-prime-rl")[0](model, cell.ids, cell.targets, True)
        bf16_logp, bf16_ent = step.way("prime-rl-fused")[0](model, cell.ids, cell.targets, True)
    assert (prime_logp[0].double() - ref_logp).abs().max() < 1e-5  # fp32patch's head for Prime-RL
    assert (prime_ent[0].double() - ref_ent).abs().max() < 1e-5
    assert (bf16_logp[0].double() - ref_logp).abs().max() < 0.25  # Prime-RL's own: bf16 tiles
    assert (bf16_ent[0].double() - ref_ent).abs().max() < 0.25


def test_a_way_out_of_memory_is_recorded_and_the_others_still_run(cpu: None, monkeypatch) -> None:
    def oom(model, ids, targets, entropy):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")

    monkeypatch.setitem(step.WAYS, "stock", (oom, True))
    model = step.build_model("tiny-tied", "torch")
    cell = step.Cell(model, 16, step.MODELS["tiny-tied"]["vocab"])
    out = step.measure_cell(cell, step._optimizer(model), ["stock", "fp32patch"], False, 16)
    assert out["stock"]["oom"] and "out of memory" in out["stock"]["error"]
    assert out["fp32patch"]["ms"] > 0
    row = {"model": "tiny-tied", "tokens": 16, "entropy": False, "tiles": [1, 1], "ways": out}
    text = step.table({"cells": [row]})
    assert "| tiny-tied | 16 | off | out of memory |" in text
    assert "| — | OOM → 0.0 |" in text
    assert all(p.grad is None for p in model.parameters())  # the failed step left no gradients


def test_a_way_out_of_memory_after_its_warm_up_is_recorded_too(cpu: None, monkeypatch) -> None:
    calls = []
    fits = step.way("fp32patch")[0]

    def third_step_ooms(model, ids, targets, entropy):
        calls.append(1)
        if len(calls) == 3:  # two warm-up steps fit, the first timed one does not
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return fits(model, ids, targets, entropy)

    monkeypatch.setitem(step.WAYS, "stock", (third_step_ooms, True))
    monkeypatch.setattr(step, "plan", lambda tokens: (2, 2, 2))
    model = step.build_model("tiny-untied", "torch")
    cell = step.Cell(model, 16, step.MODELS["tiny-untied"]["vocab"])
    out = step.measure_cell(cell, step._optimizer(model), ["stock", "fp32patch"], False, 16)
    assert out["stock"]["oom"] and out["stock"]["after_warmup"]
    assert len(calls) == 3  # not tried again in the next round
    assert len(out["fp32patch"]["ms_steps"]) == 4


def test_the_rule_takes_the_fastest_tile_within_the_stock_peak() -> None:
    def cell(tokens, entropy, ways):
        return {"hidden": 896, "vocab": 151936, "tokens": tokens, "entropy": entropy, "ways": ways}

    def r(ms, peak):
        return {"ms": ms, "peak_gib": peak}

    results = {
        "cells": [
            # the one tile is fastest but over stock's peak with the entropy on: the next fits
            cell(4096, False, {"stock": r(10, 5.0), "8192x16384": r(12, 1.0), "0x0": r(7, 4.0), "8192x0": r(9, 3.0)}),
            cell(4096, True, {"stock": r(14, 5.5), "8192x16384": r(13, 1.0), "0x0": r(8, 6.0), "8192x0": r(10, 3.0)}),
            # stock out of memory: the fastest that ran
            cell(65536, False, {"stock": {"oom": True}, "8192x16384": r(90, 8.0), "0x0": {"oom": True}}),
            cell(65536, True, {"stock": {"oom": True}, "8192x16384": r(95, 8.0), "0x0": {"oom": True}}),
        ]
    }
    assert step.rule_from_head(results) == {(896, 4096): (8192, 0), (896, 65536): (8192, 16384)}


def test_the_keep_limit_is_the_largest_size_where_kept_logits_win_everywhere_below() -> None:
    def cell(tokens, hidden, keep, again, stock=(20.0, 9.0), keep_peak=1.0):
        ways = {"keep": {"ms": keep, "peak_gib": keep_peak}, "recompute": {"ms": again, "peak_gib": 0.5}}
        ways["stock"] = {"oom": True} if stock is None else {"ms": stock[0], "peak_gib": stock[1]}
        return {"hidden": hidden, "vocab": 1000, "tokens": tokens, "entropy": False, "ways": ways}

    results = {
        "cells": [
            cell(1024, 896, 5, 8),
            cell(1024, 3584, 9, 10),
            cell(2048, 896, 9, 12),
            cell(2048, 3584, 18, 19),
            cell(4096, 896, 20, 21),
            cell(4096, 3584, 31, 30),  # recomputing wins here: the limit stops below 4096 tokens
            cell(8192, 896, 30, 40),
        ]
    }
    assert step.keep_limit_from_head(results) == 2048 * 1000 * 4
    # over the stock head's peak, or out of memory, stops it too
    results["cells"][2] = cell(2048, 896, 9, 12, keep_peak=10.0)
    assert step.keep_limit_from_head(results) == 1024 * 1000 * 4
    results["cells"][0]["ways"]["keep"] = {"oom": True}
    assert step.keep_limit_from_head(results) == 0
    # stock out of memory: the kept logits' peak is not held to it
    assert step.keep_limit_from_head({"cells": [cell(1024, 896, 5, 8, stock=None, keep_peak=50.0)]}) == 4096000


def test_choose_tiles_widens_short_calls_blocks_within_the_long_tiles_logits() -> None:
    from fp32patch.runtime.kernels.chunked_logprobs import TILE_LOGITS

    # from 8192 tokens: the tile measured at long context
    for tokens in (8192, 16384, 65536):
        assert choose_tiles(tokens, 151936, 896) == (DEFAULT_CHUNK_ROWS, DEFAULT_CHUNK_VOCAB)
    # below: as few equal blocks as the tile's logits allow (Qwen2's vocabulary)
    widths = {1024: 75968, 2048: 50688, 4096: 30400}
    for tokens, width in widths.items():
        assert choose_tiles(tokens, 151936, 896) == (DEFAULT_CHUNK_ROWS, width)
        assert tokens * width <= TILE_LOGITS and width % 64 == 0
    assert choose_tiles(512, 151936, 896) == (DEFAULT_CHUNK_ROWS, 151936)  # one block
    assert choose_tiles(3, 11, 8) == (DEFAULT_CHUNK_ROWS, 11)
    blocks = [-(-151936 // choose_tiles(t, 151936, 896)[1]) for t in (256, 1024, 2048, 4096, 6000, 8192)]
    assert blocks == sorted(blocks) and blocks[0] == 1 and blocks[-1] == 10
    # a tensor-parallel shard: its own vocabulary
    assert choose_tiles(1024, 151936 // 4, 896) == (DEFAULT_CHUNK_ROWS, 151936 // 4)


def test_choose_tiles_gives_the_measured_defaults_and_explicit_tiles_win() -> None:
    assert choose_tiles(8192, 151936, 896) == (DEFAULT_CHUNK_ROWS, DEFAULT_CHUNK_VOCAB)
    from fp32patch.runtime.kernels import chunked_logprobs as module

    x = torch.randn(5, 8).bfloat16()
    w = torch.randn(11, 8).bfloat16()
    plan = module._plan(
        x, w, torch.zeros(5, dtype=torch.long), "fp32out", 1.0, False, None, None, False, False, 2, None
    )
    assert (plan.chunk_rows, plan.chunk_vocab) == (2, choose_tiles(5, 11, 8)[1])


def test_table_reads_grid_files_and_gives_each_wall_ratio_its_interval(tmp_path, capsys) -> None:
    def way(steps, device, peak):
        return {"ms_steps": steps, "ms": statistics.median(steps), "device_ms": device, "peak_gib": peak}

    tight = [100.0, 101.0, 99.0, 100.5]
    cells = [
        {"model": "m", "tokens": 1024, "entropy": False, "tiles": [1, 1],
         "ways": {"stock": way(tight, 30.0, 4.6), "fp32patch": way([x * 1.5 for x in tight], 24.0, 4.5)}},
        {"model": "m", "tokens": 4096, "entropy": True, "tiles": [1, 1],
         "ways": {"stock": way([100.0, 180.0, 60.0, 240.0], 77.0, 10.0), "fp32patch": way([101.0, 99.0, 240.0, 70.0], 68.0, 7.7)}},
    ]  # fmt: skip
    paths = []
    for i, cell in enumerate(cells):
        paths.append(tmp_path / f"grid{i}.json")
        paths[-1].write_text(json.dumps({"cells": [cell]}))
    assert step.main(["--table", *map(str, paths)]) == 0
    text = capsys.readouterr().out
    assert (
        "| m | 1,024 | off | 100.2 ms | 150.4 ms | 1.500 (1.48-1.52) | 30.0 ms → 24.0 ms | 0.800 | 4.6 → 4.5 |" in text
    )
    # a host-bound spread: the interval is wide, and holds the ratio of medians
    wide = step.ratio_interval([100.0, 180.0, 60.0, 240.0], [101.0, 99.0, 240.0, 70.0])
    assert wide[0] < 100.0 / 140.0 < wide[1] and wide[1] - wide[0] > 0.5
    assert f"| m | 4,096 | on | 140.0 ms | 100.0 ms | 0.714 ({wide[0]:.2f}-{wide[1]:.2f}) |" in text
    assert "Host time per step" not in text  # these runs recorded none


def test_host_table_gives_each_ways_host_and_collector_time(tmp_path, capsys) -> None:
    def way(ms, host, collecting):
        return {"ms_steps": [ms], "ms": ms, "host_ms": host, "gc_ms": collecting, "peak_gib": 1.0}

    cell = {"model": "m", "tokens": 1024, "entropy": False, "tiles": [1, 1],
            "ways": {"stock": way(240.0, 231.5, 0.0), "fp32patch": way(252.0, 233.0, 9.25),
                     "trl-chunked": {"oom": True}, "fp32patch-trl": way(250.0, 240.0, 1.0)}}  # fmt: skip
    path = tmp_path / "grid.json"
    path.write_text(json.dumps({"cells": [cell]}))
    assert step.main(["--table", str(path)]) == 0
    text = capsys.readouterr().out
    host = text[text.index("#### Host time per step") :]
    assert "| m | 1,024 | off | 240.0 ms → 252.0 ms | 231.5 ms → 233.0 ms | 0.00 → 9.25 ms |" in host
    assert "| m | 1,024 | off | — | — | — |" in host  # TRL's own ran out of memory


def test_more_rounds_time_more_steps_of_each_way(cpu: None, monkeypatch) -> None:
    monkeypatch.setattr(step, "plan", lambda tokens: (1, 2, 2))
    model = step.build_model("tiny-tied", "torch")
    cell = step.Cell(model, 16, step.MODELS["tiny-tied"]["vocab"])
    planned = step.measure_cell(cell, step._optimizer(model), ["stock", "fp32patch"], False, 16)
    more = step.measure_cell(cell, step._optimizer(model), ["stock", "fp32patch"], False, 16, rounds=5)
    assert [len(planned[w]["ms_steps"]) for w in ("stock", "fp32patch")] == [4, 4]
    assert [len(more[w]["ms_steps"]) for w in ("stock", "fp32patch")] == [10, 10]


def test_each_step_says_its_host_time_and_the_collectors_time(cpu: None, monkeypatch) -> None:
    # the host thread's CPU time and the cyclic collector's pauses beside each step's wall time:
    # a collection forced inside one step shows in that step's gc time, and in no other
    monkeypatch.setattr(step, "plan", lambda tokens: (1, 1, 3))
    model = step.build_model("tiny-tied", "torch")
    cell = step.Cell(model, 16, step.MODELS["tiny-tied"]["vocab"])
    real_step, calls = cell.step, []

    def step_collecting_once(fn, entropy, opt):
        calls.append(fn)
        if len(calls) == 3:  # the warm-up is the first call; the second timed step collects
            junk = [[i] for i in range(200_000)]  # a heap worth scanning
            gc.collect()
            del junk
        return real_step(fn, entropy, opt)

    monkeypatch.setattr(cell, "step", step_collecting_once)
    out = step.measure_cell(cell, step._optimizer(model), ["stock"], False, 16)["stock"]
    assert len(out["host_ms_steps"]) == len(out["gc_ms_steps"]) == len(out["ms_steps"]) == 3
    assert all(0 < h <= w * 1.5 + 5 for h, w in zip(out["host_ms_steps"], out["ms_steps"], strict=True))
    assert out["gc_ms_steps"][1] > 0 and out["gc_ms_steps"][1] > max(out["gc_ms_steps"][0], out["gc_ms_steps"][2])
    assert out["gc_ms"] == pytest.approx(sum(out["gc_ms_steps"]) / 3)
    assert out["host_ms"] == sorted(out["host_ms_steps"])[1]


def test_gc_freeze_freezes_what_the_model_holds_and_is_recorded(tmp_path, monkeypatch) -> None:
    frozen = []
    monkeypatch.setattr(step.gc, "freeze", lambda: frozen.append(True))
    out = tmp_path / "step.json"
    try:
        assert step.main(["--cpu", "--models", "tiny-tied", "--tokens", "16", "--entropy", "off", "--gc-freeze",
                          "--ways", "stock", "--out", str(out)]) == 0  # fmt: skip
    finally:
        step.DEVICE = "cuda"
    results = json.loads(out.read_text())
    assert frozen == [True] and results["gc_freeze"] is True
    assert {"host_ms", "gc_ms"} <= set(results["cells"][0]["ways"]["stock"])


def test_skyrls_bf16_path_has_the_gradients_of_its_log_probs() -> None:
    # the re-implementation of SkyRL's fused path (bench/fused_logprobs.py): its hand-written
    # backward against float64 autograd of the same log-probs (temperature folded into the
    # weight), at bf16 grade, over several chunks
    from bench.fused_logprobs import SkyrlBf16, skyrl_bf16

    gen = torch.Generator().manual_seed(5)
    t, h, v = 40, 16, 300
    x = (torch.randn(t, h, generator=gen)).bfloat16().requires_grad_()
    w = (torch.randn(v, h, generator=gen) * 0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (t,), generator=gen)
    grad = torch.randn(t, generator=gen)
    chunk = SkyrlBf16.CHUNK
    SkyrlBf16.CHUNK = 16  # three chunks, the last one short
    try:
        lp = skyrl_bf16(x, w, targets, 0.7)
        (lp * grad).sum().backward()
    finally:
        SkyrlBf16.CHUNK = chunk
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = torch.log_softmax(x64 @ (w64 / 0.7).t(), -1).gather(1, targets[:, None])[:, 0]
    (ref * grad.double()).sum().backward()
    assert (lp.double() - ref).abs().max() < 0.1
    for got, want in ((x.grad, x64.grad), (w.grad, w64.grad)):
        assert got.dtype == torch.bfloat16
        assert ((got.double() - want).norm() / want.norm()).item() < 3e-2


def test_the_paired_ratio_takes_each_rounds_own_ratio_and_ignores_drift_between_rounds(tmp_path, capsys) -> None:
    # a host whose speed drifts between rounds (100 ms, then 200, then 150) under a way that costs
    # exactly 2% more in every round: the ratio of medians sees the drift, the paired ratio 1.02
    base = [100.0, 100.0, 200.0, 200.0, 150.0, 150.0, 120.0, 120.0, 180.0, 180.0]
    ours = [x * 1.02 for x in base]
    ours[2], ours[3] = 140.0, 140.0  # ... the third round's pair ran while the host was faster for ours
    ours_shuffled = ours[2:] + ours[:2]  # the same steps, each a round earlier: unpaired

    def way(steps):
        return {"ms_steps": steps, "ms": statistics.median(steps), "peak_gib": 1.0, "rounds": 5, "per_round": 2}

    ratio, low, high = step.paired_ratio(way(base), way(ours))
    assert ratio == pytest.approx(1.02) and low == pytest.approx(0.7) and high == pytest.approx(1.02)
    assert step.round_means(way(base)) == [100.0, 200.0, 150.0, 120.0, 180.0]
    assert step.paired_ratio(way(base), way(ours_shuffled))[0] == pytest.approx(122.4 / 150.0)
    # runs that did not record their rounds, or ran out of memory part way: no paired ratio
    assert step.paired_ratio({"ms_steps": base}, {"ms_steps": ours}) is None
    assert step.paired_ratio(way(base), {**way(ours[:8])}) is None
    assert step.paired_ratio({**way(base[:4]), "rounds": 2}, {**way(ours[:4]), "rounds": 2}) is None  # < 3 rounds
    cell = {"model": "m", "tokens": 1024, "entropy": False, "tiles": [1, 1],
            "ways": {"stock": way(base), "fp32patch": way(ours)}}  # fmt: skip
    (tmp_path / "grid.json").write_text(json.dumps({"cells": [cell]}))
    assert step.main(["--table", str(tmp_path / "grid.json")]) == 0
    assert f"| 1.020 ({low:.2f}-{high:.2f}) p |" in capsys.readouterr().out


def test_per_round_one_alternates_the_ways_step_by_step(cpu: None, monkeypatch) -> None:
    monkeypatch.setattr(step, "plan", lambda tokens: (1, 2, 4))
    model = step.build_model("tiny-tied", "torch")
    cell = step.Cell(model, 16, step.MODELS["tiny-tied"]["vocab"])
    order = []
    real_step = cell.step
    monkeypatch.setattr(cell, "step", lambda fn, entropy, opt: (order.append(fn), real_step(fn, entropy, opt)))
    out = step.measure_cell(cell, step._optimizer(model), ["stock", "fp32patch"], False, 16, rounds=6, per_round=1)
    timed = order[2 : 2 + 12]  # after each way's warm-up step, before the device-time runs
    assert [timed[i] is timed[i + 2] for i in range(10)] == [False, False] * 5  # a round is one step of each, rotated
    assert all(out[w]["rounds"] == 6 and out[w]["per_round"] == 1 and len(out[w]["ms_steps"]) == 6 for w in out)
