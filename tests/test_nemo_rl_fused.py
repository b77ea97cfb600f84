"""NeMo-RL's fused log-prob path at fp32 grade (``fp32patch.runtime.nemo_rl.fused``), on the CPU.

The GPTModel here is a stand-in with what the fused path reads of one (its output layer, as
fp32patch's Megatron head leaves it when wired, its config, the tied embedding); the real
megatron-core model, at TP=1 and TP=2, is the heavy megatron suite's (test_nemo_rl_fused.py,
and NeMo-RL's own checkout in test_nemo_rl_checkout_fused.py). What a user would notice:

- an output layer fp32patch did not wire gives None: NeMo-RL's own fused path runs;
- a wired one (or NeMo-RL's own fp32 head, ``logit_dtype``) gives NeMo-RL's layout of log-probs,
  [b, s - 1] in fp32, of softmax(z / T) with z the fp32 logits, differentiable;
- the temperature handed over before the forward is the one applied, once: the patched
  ``train.py`` does not divide the fused log-probs again, where stock NeMo-RL's divides them
  (log p / T); a temperature that did not reach the fused forward is refused, not trained on.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fp32patch.runtime.heads.megatron import Fp32ForwardImpl
from fp32patch.runtime.nemo_rl import check_fused_temperature, fused_logprobs, fused_temperature
from fp32patch.runtime.nemo_rl.fused import UPSTREAM_HEAD_MODE, fused_mode
from tests.fixtures.nemo_rl_shapes import SHAPES, TRAIN, checkout
from tests.nemo_rl_harness import cli, load_module

S, B, H, V = 6, 2, 16, 40


class OutputLayer(torch.nn.Module):
    def __init__(self, weight: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = None if weight is None else torch.nn.Parameter(weight)


class GPT(torch.nn.Module):
    """What the fused path reads of a GPTModel."""

    def __init__(self, tied: bool = False, mode: str | None = None, logit_dtype=None) -> None:
        super().__init__()
        weight = (torch.randn(V, H, generator=torch.Generator().manual_seed(1)) * 0.5).bfloat16()
        self.share_embeddings_and_output_weights = tied
        self.embedding_weight = torch.nn.Parameter(weight.clone()) if tied else None
        self.output_layer = OutputLayer(None if tied else weight)
        if mode is not None:
            self.output_layer._forward_impl = Fp32ForwardImpl(mode)  # as fp32patch's wiring leaves it
        self.config = SimpleNamespace(sequence_parallel=False, context_parallel_size=1, logit_dtype=logit_dtype)

    def shared_embedding_or_output_weight(self) -> torch.Tensor:
        return self.embedding_weight


def _inputs():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(S, B, H, generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=gen)
    return hidden, labels


def _reference(model: GPT, hidden: torch.Tensor, labels: torch.Tensor, temperature: float) -> torch.Tensor:
    weight = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else model.output_layer.weight
    )
    z = hidden.detach().double() @ weight.detach().double().t() / temperature  # [s, b, v]
    logp = torch.log_softmax(z, dim=-1)[:-1].gather(-1, labels.t()[1:, :, None])[..., 0]
    return logp.t()  # [b, s - 1]


def test_an_output_layer_fp32patch_did_not_wire_keeps_the_stock_path():
    hidden, labels = _inputs()
    assert fused_logprobs(GPT(), hidden, labels) is None
    assert fused_mode(GPT()) is None


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("mode", ["fp32out", "fp32", "fp32out-bf16grad"])
def test_a_wired_output_layer_gives_fp32_log_probs_of_the_scaled_logits(tied, mode):
    model = GPT(tied=tied, mode=mode)
    hidden, labels = _inputs()
    fused_temperature(SimpleNamespace(temperature=0.7))
    out = fused_logprobs(model, hidden, labels)
    assert out.shape == (B, S - 1) and out.dtype == torch.float32
    assert out._fp32patch_temperature == 0.7
    assert (out.double() - _reference(model, hidden, labels, 0.7)).abs().max() < 1e-5
    out.sum().backward()
    weight = model.embedding_weight if tied else model.output_layer.weight
    assert hidden.grad is not None and weight.grad is not None and weight.grad.any()


def test_nemo_rls_own_fp32_head_gets_its_precision():
    # after NeMo-RL's rework Megatron's head is the provider's logit_dtype: fp32 output, bf16 grad
    model = GPT(logit_dtype=torch.float32)
    assert fused_mode(model) == UPSTREAM_HEAD_MODE == "fp32out-bf16grad"
    assert fused_mode(GPT(logit_dtype=torch.bfloat16)) is None
    hidden, labels = _inputs()
    out = fused_logprobs(model, hidden, labels)
    assert (out.double() - _reference(model, hidden, labels, 1.0)).abs().max() < 1e-5


def test_a_temperature_is_applied_once_and_a_missing_one_is_refused():
    model = GPT(mode="fp32out")
    hidden, labels = _inputs()
    fused_temperature(SimpleNamespace(temperature=0.7))
    first = fused_logprobs(model, hidden, labels)
    check_fused_temperature(first, SimpleNamespace(temperature=0.7))  # the train step's own: passes
    # the hand-over is for one forward: the next without one computes at 1, and says so
    second = fused_logprobs(model, hidden, labels)
    assert second._fp32patch_temperature == 1.0
    check_fused_temperature(second, None)
    check_fused_temperature(second, SimpleNamespace(temperature=1.0))
    with pytest.raises(RuntimeError, match=r"computed at temperature 1\.0 but the training temperature is 0\.7"):
        check_fused_temperature(second, SimpleNamespace(temperature=0.7))
    fused_temperature(None)
    assert fused_logprobs(model, hidden, labels)._fp32patch_temperature == 1.0


def test_context_parallelism_is_refused_as_nemo_rl_refuses_it():
    model = GPT(mode="fp32out")
    model.config.context_parallel_size = 2
    with pytest.raises(NotImplementedError, match="context parallelism"):
        fused_logprobs(model, *_inputs())


# ---------------------------------------------------------------- train.py, stock and patched


@pytest.fixture(scope="module")
def trains(tmp_path_factory) -> dict:
    """The newest stand-in train.py, stock and as fp32patch apply leaves it."""
    stock = checkout(SHAPES[0].name, tmp_path_factory.mktemp("stock"))
    patched = checkout(SHAPES[0].name, tmp_path_factory.mktemp("patched"))
    code, data = cli("apply", "-s", str(patched), "--patch", "nemo-rl-fp32-lm-head")
    assert code == 0, data
    return {"stock": stock / TRAIN, "patched": patched / TRAIN}


class FusedModel:
    """A model whose fused forward is the patched model_utils.py's: fp32patch's log-probs of a
    wired GPTModel where it is asked for them (the real forward runs in the heavy suite)."""

    def __init__(self, wired: bool) -> None:
        self.gpt = GPT(mode="fp32out" if wired else None)
        self.hidden = _inputs()[0]

    def __call__(self, *, input_ids, return_logprobs_for_linear_ce_fusion=False, labels=None, **kwargs):
        assert return_logprobs_for_linear_ce_fusion and labels is input_ids
        ours = fused_logprobs(self.gpt, self.hidden, labels)
        if ours is not None:
            return ours
        # the stock path's numbers, at T=1 (NeMo-RL's fused forward does not know the temperature)
        return _reference(self.gpt, self.hidden, labels, 1.0).float()


def _step(train_path: Path, wired: bool, temperature: float) -> tuple[torch.Tensor, FusedModel]:
    train = load_module(train_path)
    model = FusedModel(wired)
    labels = _inputs()[1]
    microbatch = {"input_ids": labels, "position_ids": None, "attention_mask": None}
    out, _ = train.forward_with_post_processing_fn(
        iter([microbatch]),
        model,
        lambda mb: None,
        sampling_params=SimpleNamespace(temperature=temperature),
        use_fused_linear_logprobs=True,
    )
    return out, model


def test_stock_nemo_rl_divides_the_fused_log_probs_by_the_temperature(trains):
    out, model = _step(trains["stock"], wired=False, temperature=0.7)
    labels = _inputs()[1]
    assert torch.allclose(out.double(), _reference(model.gpt, model.hidden, labels, 1.0) / 0.7, atol=1e-5)
    assert not torch.allclose(out.double(), _reference(model.gpt, model.hidden, labels, 0.7), atol=1e-2)


def test_patched_the_fused_log_probs_are_those_of_the_scaled_logits(trains):
    out, model = _step(trains["patched"], wired=True, temperature=0.7)
    labels = _inputs()[1]
    assert (out.double() - _reference(model.gpt, model.hidden, labels, 0.7)).abs().max() < 1e-5
    # unwired, the patched train.py divides as the stock one does
    stock, _ = _step(trains["stock"], wired=False, temperature=0.7)
    unwired, _ = _step(trains["patched"], wired=False, temperature=0.7)
    assert torch.equal(stock, unwired)


def test_the_patched_train_step_imports_no_fp32patch_where_nothing_asks(trains):
    script = textwrap.dedent(
        f"""
        import sys
        from types import SimpleNamespace
        import torch
        from tests.nemo_rl_harness import load_module
        train = load_module(__import__("pathlib").Path({str(trains["patched"])!r}))
        logits = torch.ones(1, 3, 5)
        out, _ = train.forward_with_post_processing_fn(
            iter([{{"input_ids": None, "position_ids": None, "attention_mask": None}}]),
            lambda **kw: logits, lambda mb: None, sampling_params=SimpleNamespace(temperature=0.5),
        )
        assert torch.equal(out, torch.full((1, 3, 5), 2.0))  # logits divided in place, as stock
        assert not [m for m in sys.modules if m.startswith("fp32patch")], sorted(sys.modules)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=Path(__file__).parents[1]
    )
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------- kit.fused: wired heads found by their weight


class Chunk(torch.nn.Module):
    """A Megatron chunk as get_model hands it over: the GPTModel inside a wrapper (DDP's .module)."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.module = gpt


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_kit_finds_a_wired_megatron_head_by_the_weight_its_fused_path_reads(tied):
    import gc

    from fp32patch.runtime.kit.fused import remember, wired_mode

    gpt = GPT(tied=tied, mode="fp32out")
    assert remember([Chunk(gpt)], "megatron") == 1
    read = gpt.shared_embedding_or_output_weight() if tied else gpt.output_layer.weight
    assert wired_mode(read) == "fp32out" and wired_mode(read, trainer="hf") is None
    other = GPT(tied=tied)  # not wired
    assert wired_mode(other.shared_embedding_or_output_weight() if tied else other.output_layer.weight) is None
    del gpt
    gc.collect()
    assert wired_mode(read) is None  # a model that is gone is forgotten
