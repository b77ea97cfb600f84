"""bench/skyrl_mismatch.py's trainer side and metrics, on the CPU without an engine: SkyRL 0.4.0's
own ``logprobs_from_logits`` (bf16 logits give bf16 log-probs, fp32 logits fp32 ones) and its
``compute_off_policy_correction`` on batches whose answer is known."""

from __future__ import annotations

import math

import pytest
import torch

from bench import skyrl_mismatch


@pytest.fixture(scope="module")
def skyrl():
    logprobs_from_logits, correction, _ = skyrl_mismatch.skyrl_functions()
    return logprobs_from_logits, correction


def test_skyrl_rounds_log_probs_of_bf16_logits_to_bf16(skyrl):
    logprobs_from_logits, _ = skyrl
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(1, 9, 50, generator=gen) * 4
    labels = torch.randint(0, 50, (1, 9), generator=gen)
    exact = torch.log_softmax(z.double(), -1).gather(-1, labels[..., None])[..., 0]
    bf16 = logprobs_from_logits(z.bfloat16(), labels)
    fp32 = logprobs_from_logits(z.clone(), labels)
    assert bf16.dtype == torch.bfloat16 and fp32.dtype == torch.float32
    assert (fp32.double() - exact).abs().max() < 1e-5
    # the stock path's log-probs carry bf16's rounding (of the logits and of the result)
    assert (bf16.double() - exact).abs().max() > 100 * (fp32.double() - exact).abs().max()


def test_metrics_drop_a_sample_off_by_more_than_the_geometric_mask(skyrl):
    _, correction = skyrl
    rollout = [[-1.0, -2.0, -0.5], [-1.0, -2.0]]
    # sample 0: every token 0.001 apart (geometric mean ratio e^0.001, inside 0.99-1.01);
    # sample 1: 0.05 apart (e^0.05 = 1.051, outside): the mask drops one of two samples
    trainer = [[-0.999, -1.999, -0.499], [-0.95, -1.95]]
    got = skyrl_mismatch.metrics(rollout, trainer, correction)
    assert got["geo_sequence_mask_masked_ratio"] == 0.5
    assert got["tokens"] == 5 and got["tis_token_clip_high_ratio"] == 0.0
    assert math.isclose(got["abs_log_ratio_mean"], (3 * 0.001 + 2 * 0.05) / 5, rel_tol=1e-6)
    assert math.isclose(got["is_ratio_mean"], (3 * math.exp(0.001) + 2 * math.exp(0.05)) / 5, rel_tol=1e-5)
    same = skyrl_mismatch.metrics(rollout, rollout, correction)
    assert same["geo_sequence_mask_masked_ratio"] == 0.0 and same["abs_log_ratio_mean"] == 0.0
