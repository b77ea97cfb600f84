"""NeMo-RL's train/generation mismatch metrics, and what the agreement benchmark derives from them.

Pure torch (no transformers), so the definitions are testable anywhere. ``logp_train`` and
``logp_gen`` are the log-probabilities of the sampled tokens as the trainer's log-prob pass
and the generation engine computed them; ``mask`` (optional) marks the tokens that count, as
NeMo-RL's token mask does (prompt and padding left out).

* ``token_mult_prob_error``: mean over tokens of exp(|log p_train - log p_gen|), NeMo-RL's
  ``train/token_mult_prob_error`` (1.0 when the engines agree exactly).
* ``gen_kl_error``: NeMo-RL's ``train/gen_kl_error``, the k3 estimate of KL(P_gen || P_train)
  on tokens the generation engine sampled: the mean of exp(r) - 1 - r with
  r = log p_train - log p_gen (NeMo-RL's ``calculate_kl`` with the generation log-probs as
  ``logprobs`` and the trainer's as the reference; no clamping, as for this metric there).
  Every term is >= 0.
* RMS and mean of |log p_train - log p_gen|, and the largest.
* ``rollout_probs_diff_mean``: verl's ``training/rollout_probs_diff_mean``, the mean over tokens
  of |p_train - p_gen| in probabilities (its docstring says "logprob diff"; its code takes the
  exp first); ``rollout_actor_probs_pearson_corr``: verl's Pearson correlation of the two
  probabilities over the same tokens.
"""

from __future__ import annotations

import itertools
import math
import statistics

import torch


def _deltas(logp_train: torch.Tensor, logp_gen: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if logp_train.shape != logp_gen.shape:
        raise ValueError(
            f"log-probs of different shapes: trainer {tuple(logp_train.shape)}, generation {tuple(logp_gen.shape)}"
        )
    delta = logp_train.double() - logp_gen.double()
    if mask is None:
        return delta.flatten()
    if mask.shape != delta.shape:
        raise ValueError(f"mask of shape {tuple(mask.shape)} for log-probs of shape {tuple(delta.shape)}")
    return delta[mask.bool()]


def _probs(logp: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    p = torch.exp(logp.double())
    return p.flatten() if mask is None else p[mask.bool()]


def token_mult_prob_error(logp_train: torch.Tensor, logp_gen: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """Mean of exp(|log p_train - log p_gen|) over the (masked) tokens."""
    return torch.exp(_deltas(logp_train, logp_gen, mask).abs()).mean().item()


def gen_kl_error(logp_train: torch.Tensor, logp_gen: torch.Tensor, mask: torch.Tensor | None = None) -> float:
    """k3 estimate of KL(P_gen || P_train): mean of exp(r) - 1 - r, r = log p_train - log p_gen."""
    r = _deltas(logp_train, logp_gen, mask)
    return (torch.expm1(r) - r).mean().item()


def agreement(logp_train: torch.Tensor, logp_gen: torch.Tensor, mask: torch.Tensor | None = None) -> dict[str, float]:
    """Every metric of one pair of log-prob tensors."""
    delta = _deltas(logp_train, logp_gen, mask)
    p_train, p_gen = _probs(logp_train, mask), _probs(logp_gen, mask)
    return {
        "token_mult_prob_error": torch.exp(delta.abs()).mean().item(),
        "rollout_probs_diff_mean": (p_train - p_gen).abs().mean().item(),
        "rollout_actor_probs_pearson_corr": torch.corrcoef(torch.stack([p_train, p_gen]))[0, 1].item(),
        "gen_kl_error": (torch.expm1(delta) - delta).mean().item(),
        "rms_dlogp": delta.pow(2).mean().sqrt().item(),
        "mean_abs_dlogp": delta.abs().mean().item(),
        "max_abs_dlogp": delta.abs().max().item(),
    }


def spread(values: list[float]) -> dict[str, float]:
    """Mean, sample standard deviation, standard error of the mean, min and max of per-seed values."""
    if not values:
        raise ValueError("no values to summarise")
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {
        "mean": statistics.fmean(values),
        "std": std,
        "se": std / math.sqrt(len(values)),
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def crossings(points: list[tuple[float, float, float]]) -> list[dict[str, float | str | bool]]:
    """Where ``margin`` changes sign along ``x``, for (x, margin, standard error) points.

    Here x is a divergence (>= 0) and margin = one-sided error - neither's error: positive
    where fp32 on one side alone is worse than bf16 on both. Each crossing is interpolated
    linearly in log x (linearly in x from x = 0), says which way it goes, and is ``clear``
    when the margins on both sides of it are more than two standard errors from zero.
    """
    ordered = sorted(points)
    out: list[dict[str, float | str | bool]] = []
    for (x0, m0, se0), (x1, m1, se1) in itertools.pairwise(ordered):
        if (m0 > 0) == (m1 > 0):
            continue
        t = m0 / (m0 - m1)
        if x0 > 0 and x1 > 0:
            x = math.exp(math.log(x0) + t * (math.log(x1) - math.log(x0)))
        else:
            x = x0 + t * (x1 - x0)
        out.append(
            {
                "x": x,
                "between": [x0, x1],
                "direction": "worse->better" if m0 > 0 else "better->worse",
                "clear": abs(m0) > 2 * se0 and abs(m1) > 2 * se1,
            }
        )
    return out
