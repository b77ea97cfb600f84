"""A smoke run on the CPU of what runs on the H200 for Prime-RL's fused head: bench/prime_rl_head.py
(its logic, shapes and JSON; times not read)."""

from __future__ import annotations

import json

import pytest

from bench import lm_head, prime_rl_head


def test_the_benchmark_runs_its_ways_and_writes_its_json(tmp_path, monkeypatch):
    monkeypatch.setattr(lm_head, "DEVICE", "cuda")  # main() sets it to the CPU for --cpu
    out = tmp_path / "prime-rl-head.json"
    argv = ["--cpu", "--quick", "--rounds", "1", "--iters", "1", "--warmup", "0", "--out", str(out)]
    assert prime_rl_head.main(argv) == 0
    results = json.loads(out.read_text())
    assert lm_head.DEVICE == "cpu" and results["settings"]["chunk"] == 8192
    [shape] = results["shapes"]
    assert shape["shape"] == {"tokens": 128, "hidden": 256, "vocab": 2048}
    ways = shape["ways"]
    assert list(ways) == [name for name, *_ in prime_rl_head.WAYS]
    for case in ("", ", per-sample T", ", Gemma cap"):
        ours, theirs = ways[f"fp32patch{case}"], ways[f"prime-rl bf16{case}"]
        # fp32 logits: log-probs more than an order of magnitude closer to float64's than bf16 chunks'
        assert ours["mean_abs_dlogp"] < theirs["mean_abs_dlogp"] / 20, case
        assert ours["dx_rel_err"] <= theirs["dx_rel_err"], case
        assert theirs["fwd_bwd_ratio"] == 1.0 and ours["fwd_bwd_ms"] > 0
    # the per-sample case has two temperatures: its bf16 error is not the one-temperature case's
    assert ways["prime-rl bf16, per-sample T"]["mean_abs_dlogp"] != ways["prime-rl bf16"]["mean_abs_dlogp"]


def test_tokens_picks_the_shapes_and_refuses_one_it_does_not_have(tmp_path, capsys):
    out = tmp_path / "prime-rl-head.json"
    quick = ["--cpu", "--quick", "--rounds", "1", "--iters", "1", "--warmup", "0", "--out", str(out)]
    assert prime_rl_head.main([*quick, "--tokens", "128"]) == 0
    assert [s["shape"]["tokens"] for s in json.loads(out.read_text())["shapes"]] == [128]
    out.unlink()
    with pytest.raises(SystemExit) as stop:
        prime_rl_head.main([*quick, "--tokens", "5"])
    assert stop.value.code == 2
    assert "no shape of [5] tokens" in capsys.readouterr().err and not out.exists()
