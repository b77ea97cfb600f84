"""Prime-RL's own LM heads in a training step on the CPU, with fp32patch's forward on them
(opt-in: Prime-RL is not on PyPI; its files are read from a checkout):

    FP32PATCH_PRIME_RL_CHECKOUT=/path/to/prime-rl FP32PATCH_HEAVY=1 PYTHONPATH=$PWD \\
      $(.venv/bin/python tests/envs/build.py --path transformers) -m pytest tests/heavy/transformers/test_prime_rl_step.py

Prime-RL's ``inject_prime_lm_head`` (its ``lm_head.py`` and ``lm_head_gemma.py``, imported from the
checkout; its ``trainer/models/__init__.py``, which imports every model and torchtitan, is skipped,
and its loguru logger stood in by the standard library's where loguru is missing)
puts its head and its forward on a tiny real transformers model: Qwen2 (untied), Llama (tied),
Gemma2 (soft-capped: Prime-RL's Gemma heads). fp32patch's ``wire_trainer`` (what the patched
``rl/train.py`` calls, with the trainer's key unset: Prime-RL's switch's default) installs its
forward. One step as Prime-RL's trainer runs it: a packed batch-1 input of two sequences
(positions restart), per-token temperatures (0.7 and 1.0, and one for all), Prime-RL's
``cast_float_and_contiguous``, the vanilla kinds' logits divided by the temperatures, a policy
loss's backward. The log-probs are within 1e-4 of float64 over the head's own bf16 inputs (the
stock heads' are not), and the gradient that reaches the hidden states is within bf16's rounding of
float64's.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hf_harness import V, tiny

CHECKOUT = os.environ.get("FP32PATCH_PRIME_RL_CHECKOUT")
pytestmark = pytest.mark.skipif(not CHECKOUT, reason="set FP32PATCH_PRIME_RL_CHECKOUT to a Prime-RL checkout")
T = 12  # tokens per packed sequence


@pytest.fixture(scope="module")
def prime():
    """Prime-RL's own head module, from the checkout."""
    src = Path(CHECKOUT) / "src"
    sys.path.insert(0, str(src))
    models = ModuleType("prime_rl.trainer.models")  # its __init__ imports every model (torchtitan, flash-attn)
    models.__path__ = [str(src / "prime_rl" / "trainer" / "models")]
    sys.modules["prime_rl.trainer.models"] = models
    try:
        import loguru  # noqa: F401  (Prime-RL's logger; not in this environment's lock)
    except ImportError:  # a named stand-in: Prime-RL's heads only log which head they inject
        logger = ModuleType("prime_rl.utils.logger")
        logger.get_logger = lambda: logging.getLogger("prime_rl")
        sys.modules["prime_rl.utils.logger"] = logger
    yield importlib.import_module("prime_rl.trainer.models.layers.lm_head")
    sys.path.remove(str(src))
    for name in [n for n in sys.modules if n == "prime_rl" or n.startswith("prime_rl.")]:
        del sys.modules[name]


def packed(uniform: bool):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (1, 2 * T), generator=gen)
    positions = torch.cat([torch.arange(T), torch.arange(T)])[None]
    labels = torch.roll(ids, -1, dims=1)
    temps = torch.full((1, 2 * T), 0.7) if uniform else torch.cat([torch.full((1, T), 0.7), torch.ones(1, T)], 1)
    advantages = torch.randn(1, 2 * T, generator=gen)
    return ids, positions, labels, temps, advantages


def step(prime, model, uniform: bool):
    """One step as Prime-RL's trainer runs it; returns the log-probs, the head's input, the
    gradient that came back into it, and the head's weight."""
    ids, positions, labels, temps, advantages = packed(uniform)
    seen = {}

    def pre_hook(module, args):
        x = args[0]
        seen["x"] = x.detach().clone()
        x.register_hook(lambda g: seen.__setitem__("grad", g.detach().clone()))

    model.lm_head.register_forward_pre_hook(pre_hook)
    out = prime.cast_float_and_contiguous(
        model(input_ids=ids, position_ids=positions, labels=labels, temperature=temps)
    )
    if out.get("logprobs") is None:  # the vanilla heads: Prime-RL's trainer scales the logits itself
        log_p = torch.log_softmax(out["logits"] / temps.unsqueeze(-1), dim=-1)
        out["logprobs"] = log_p.gather(-1, labels[..., None])[..., 0]
    (-(out["logprobs"] * advantages).sum()).backward()
    return out["logprobs"].detach(), seen, model.lm_head.weight.detach(), (labels, temps, advantages)


def float64(x, weight, labels, temps, advantages, softcap):
    x64 = x.double().requires_grad_()
    z = x64 @ weight.double().t()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temps.double()[..., None], dim=-1).gather(-1, labels[..., None])[..., 0]
    (-(log_p * advantages.double()).sum()).backward()
    return log_p.detach(), x64.grad


@pytest.mark.parametrize("uniform", [False, True], ids=["per-sample-temperatures", "one-temperature"])
@pytest.mark.parametrize("chunk", [5, None], ids=["fused", "vanilla"])
@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma2"])
def test_prime_rl_heads_compute_at_fp32_grade_in_a_step(prime, family, chunk, uniform):
    from fp32patch.runtime.prime_rl import wire_trainer

    results = {}
    for wired in (False, True):
        model = tiny(family).train()
        prime.inject_prime_lm_head(model, chunk_size=chunk)
        if wired:
            wire_trainer(model, {"model": {"fp32_lm_head": None}})
        expected = ("Gemma" if family == "gemma2" else "") + ("Fused" if chunk else "Vanilla") + "OutputLinear"
        assert type(model.lm_head).__name__ == expected
        results[wired] = step(prime, model, uniform)
    softcap = 30.0 if family == "gemma2" else None
    errors = {}
    for wired, (logprobs, seen, weight, (labels, temps, advantages)) in results.items():
        ref, ref_grad = float64(seen["x"], weight, labels, temps, advantages, softcap)
        err = (logprobs.double() - ref).abs().max().item()
        grad_err = ((seen["grad"].double() - ref_grad).norm() / ref_grad.norm()).item()
        errors[wired] = (err, grad_err)
    (ours, ours_grad), (stock, _) = errors[True], errors[False]
    print(
        f"{family} {'fused' if chunk else 'vanilla'}: log-prob error {ours:.2e} (stock {stock:.2e}), grad {ours_grad:.2e}"
    )
    assert ours < 1e-4 and stock > 10 * ours
    assert ours_grad < 2.0**-7
