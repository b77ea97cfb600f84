"""The agreement benchmark: NeMo-RL's metric definitions on hand-made log-probs, the flip
finder, the CLI's refusals, and (where transformers is installed) the whole run on a tiny
model on the CPU."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from bench import agreement
from bench import agreement_metrics as m


def test_identical_log_probs_agree_exactly() -> None:
    logp = torch.log_softmax(torch.randn(4, 7, 50), -1)[..., 0]
    assert m.token_mult_prob_error(logp, logp.clone()) == 1.0
    assert m.gen_kl_error(logp, logp.clone()) == 0.0
    row = m.agreement(logp, logp.clone())
    assert row["rms_dlogp"] == row["mean_abs_dlogp"] == row["max_abs_dlogp"] == 0.0
    assert row["rollout_probs_diff_mean"] == 0.0 and row["rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)


def test_metrics_on_hand_made_log_probs() -> None:
    gen = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    train = torch.tensor([-0.9, -2.2, -0.5, -3.0])  # delta = +0.1, -0.2, 0, 0
    row = m.agreement(train, gen)
    assert row["token_mult_prob_error"] == pytest.approx((math.exp(0.1) + math.exp(0.2) + 2) / 4)
    assert row["gen_kl_error"] == pytest.approx((math.exp(0.1) - 1.1 + math.exp(-0.2) - 0.8) / 4)
    assert row["rms_dlogp"] == pytest.approx(math.sqrt((0.01 + 0.04) / 4))
    assert row["mean_abs_dlogp"] == pytest.approx(0.075)
    assert row["max_abs_dlogp"] == pytest.approx(0.2)
    # verl's: |p_train - p_gen| in probabilities, and their Pearson correlation
    diffs = [abs(math.exp(t) - math.exp(g)) for t, g in zip(train.tolist(), gen.tolist(), strict=True)]
    assert row["rollout_probs_diff_mean"] == pytest.approx(sum(diffs) / 4)
    p_t, p_g = torch.exp(train.double()), torch.exp(gen.double())
    p_t, p_g = p_t - p_t.mean(), p_g - p_g.mean()
    assert row["rollout_actor_probs_pearson_corr"] == pytest.approx(
        ((p_t * p_g).sum() / (p_t.norm() * p_g.norm())).item()
    )


def test_gen_kl_error_is_k3_of_trainer_minus_generation() -> None:
    # NeMo-RL's calculate_kl(logprobs=generation, logprobs_reference=trainer): r = train - gen
    gen = torch.zeros(1)
    assert m.gen_kl_error(gen + 0.5, gen) == pytest.approx(math.exp(0.5) - 1.5)
    assert m.gen_kl_error(gen - 0.5, gen) == pytest.approx(math.exp(-0.5) - 0.5)
    # k3 is not symmetric: swapping the engines changes the value
    assert m.gen_kl_error(gen, gen + 0.5) != pytest.approx(m.gen_kl_error(gen + 0.5, gen))


def test_k3_is_never_negative() -> None:
    gen = torch.log_softmax(torch.randn(2000, 30) * 3, -1)[:, 0]
    train = gen + torch.randn(2000) * 0.3
    per_token = torch.expm1(train - gen) - (train - gen)
    assert bool((per_token >= 0).all())
    assert m.gen_kl_error(train, gen) > 0


def test_masked_tokens_do_not_count() -> None:
    gen = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    train = torch.tensor([[-1.0, -5.0], [-1.2, -1.0]])
    mask = torch.tensor([[1, 0], [1, 1]])
    assert m.token_mult_prob_error(train, gen, mask) == pytest.approx((1 + math.exp(0.2) + 1) / 3)
    with pytest.raises(ValueError, match="mask of shape"):
        m.agreement(train, gen, mask[:, :1])
    with pytest.raises(ValueError, match="different shapes"):
        m.agreement(train, gen[:1])


def test_spread_over_seeds() -> None:
    s = m.spread([1.0, 2.0, 3.0])
    assert (s["mean"], s["std"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 1.0, 3.0, 3)
    assert s["se"] == pytest.approx(1 / math.sqrt(3))


def test_crossings_find_where_one_sided_turns_from_worse_to_better() -> None:
    # (divergence, margin = one-sided - neither, standard error); unordered on purpose
    points = [(1e-1, -0.002, 1e-4), (0.0, 0.02, 1e-4), (1e-2, 0.005, 1e-4), (1.0, -0.01, 1e-4)]
    (flip,) = m.crossings(points)
    assert flip["direction"] == "worse->better" and flip["clear"]
    assert flip["between"] == [1e-2, 1e-1]
    assert flip["x"] == pytest.approx(10 ** (-2 + 0.005 / 0.007))  # interpolated in log x
    assert m.crossings([(0.0, 0.01, 0.0), (0.1, 0.002, 0.0)]) == []
    # a crossing inside the seeds' spread is reported, but not as clear
    (weak,) = m.crossings([(0.1, 1e-5, 1e-4), (1.0, -1e-5, 1e-4)])
    assert weak["direction"] == "worse->better" and not weak["clear"]
    # from x = 0 the interpolation is linear
    (first,) = m.crossings([(0.0, 0.03, 0.0), (0.2, -0.01, 0.0)])
    assert first["x"] == pytest.approx(0.15)


# ---------------------------------------------------------------- the script

HAS_TRANSFORMERS = all(importlib.util.find_spec(name) for name in ("transformers", "tokenizers"))


def test_cli_refuses_bad_input(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    with pytest.raises(SystemExit) as exc:
        agreement.main(["--smoke", "--out", str(tmp_path / "a.json"), "--seeds", "1"])
    assert exc.value.code == 2
    assert "--seeds 1: at least 2" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        agreement.main(["--out", str(tmp_path / "a.json")])
    assert exc.value.code == 2
    assert "no CUDA device here" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        agreement.main(["--smoke", "--out", str(tmp_path)])
    assert exc.value.code == 2
    assert "is a folder; name the JSON file" in capsys.readouterr().err
    if importlib.util.find_spec("fp32patch.runtime.hf_lm_head") is None:
        with pytest.raises(SystemExit) as exc:
            agreement.main(["--smoke", "--out", str(tmp_path / "a.json"), "--trainer-head", "hf"])
        assert exc.value.code == 2
        assert "hf_lm_head is not in this checkout" in capsys.readouterr().err
    (tmp_path / "other.json").write_text('{"models": {"x": {}}}')
    with pytest.raises(SystemExit) as exc:
        agreement.main(["--from-json", str(tmp_path / "other.json")])
    assert exc.value.code == 2
    assert "not this benchmark's results" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--real-engine"], "--real-engine needs --vllm-python"),
        (["--vllm-python", "/bin/sh"], "--vllm-python goes with --real-engine"),
        (["--real-engine", "--vllm-python", "/no/such/python"], "--vllm-python /no/such/python: not an executable"),
        (["--real-engine", "--vllm-python", "/bin/sh", "--smoke"], "--real-engine runs on the CPU, at its own size"),
        (["--real-engine", "--vllm-python", "/bin/sh", "--device", "cuda"], "--real-engine runs on the CPU"),
    ],
)
def test_cli_refuses_a_real_engine_run_it_cannot_do(capsys, tmp_path, args, says) -> None:
    with pytest.raises(SystemExit) as exc:
        agreement.main(["--out", str(tmp_path / "a.json"), *args])
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="the smoke run needs transformers and tokenizers")
def test_smoke_run_scores_every_combination_on_both_models(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "agreement.json"
    assert agreement.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert "trainer hidden states" in printed
    assert set(results["models"]) == {"trained", agreement.SHARP, "control"}
    trained = results["models"]["trained"]
    assert trained["training"]["loss_last"] < trained["training"]["loss_first"]
    assert trained["params"] > 0
    assert results["corpus"]["vocab"] == agreement.SMOKE.vocab
    for model in results["models"].values():
        assert len(model["per_seed"]) == agreement.SMOKE.seeds
        variants = model["variants"]
        assert {"shared", "sdpa", "eager", "fp32-residual", "noise 0.001", "noise 0.1"} <= set(variants)
        for v in variants.values():
            assert set(v["combos"]) == set(agreement.COMBOS)
            for combo in v["combos"].values():
                assert combo["token_mult_prob_error"]["mean"] >= 1.0
                assert combo["gen_kl_error"]["min"] >= 0.0
        shared = variants["shared"]["combos"]
        # the same hidden states: fp32 on both sides agrees to fp32's rounding, and one bf16
        # head alone shows its whole rounding, which bf16 on both sides shares
        assert shared["fp32out / fp32out"]["token_mult_prob_error"]["mean"] < 1 + 1e-5
        assert variants["shared"]["divergence_rms_dlogp"] < 1e-5
        for one_side in ("fp32out / bf16", "bf16 / fp32out"):
            one = shared[one_side]["token_mult_prob_error"]["mean"]
            assert one > shared["bf16 / bf16"]["token_mult_prob_error"]["mean"]
            assert one > shared["fp32out / fp32out"]["token_mult_prob_error"]["mean"]
        # the trainer's own forward diverges from the decode; noise makes it diverge more
        assert variants["sdpa"]["hidden_rel_rms"]["mean"] > 0
        assert variants["noise 0.1"]["divergence_rms_dlogp"] > variants["noise 0.001"]["divergence_rms_dlogp"]
        assert model["rounding_rms_dlogp"] > 0
        assert set(model["verdicts"]) == {"shared", "sdpa", "eager", "fp32-residual"}
        for metric in ("token_mult_prob_error", "rms_dlogp"):
            assert model["verdicts"]["shared"][metric]["one_sided"] == "worse than neither"
            assert model["verdicts"]["shared"][metric]["clear"]
    # the table is drawn again from the JSON alone
    assert agreement.main(["--from-json", str(out)]) == 0
    again = capsys.readouterr().out.strip()
    assert "flip in token_mult_prob_error" in again or "no flip in token_mult_prob_error" in again
    assert again in printed
    sharp = results["models"][agreement.SHARP]
    assert sharp["distribution"]["mean_max_logit"] == pytest.approx(
        2 * trained["distribution"]["mean_max_logit"], rel=0.02
    )
    control = results["models"]["control"]
    # the control's head is scaled to the trained model's mean max logit
    assert control["distribution"]["mean_max_logit"] == pytest.approx(
        trained["distribution"]["mean_max_logit"], rel=0.05
    )
