"""SkyRL's guard (fp32patch.runtime.skyrl.config) on configs shaped as SkyRL 0.4.0's dataclasses
(``SkyRLTrainConfig``: ``trainer`` and ``generator.inference_engine``), plain or as dataclasses,
and its probe's verdicts on the reports vLLM workers give. Pure Python: no torch, no SkyRL."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import pytest

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.skyrl import check_servers, validate_fp32_lm_head_config
from fp32patch.runtime.skyrl.config import requested_mode


def _cfg(trainer: dict | None = None, engine: dict | None = None) -> dict[str, Any]:
    return {
        "trainer": {"strategy": "fsdp", "bf16": True, "fp32_lm_head": "fp32out", **(trainer or {})},
        "generator": {"inference_engine": {"backend": "vllm", "model_dtype": "bfloat16", **(engine or {})}},
    }


def _check(cfg, environ=None, vllm=(0, 30, 0)):
    return validate_fp32_lm_head_config(cfg, environ=environ or {}, vllm_version=vllm)


@dataclasses.dataclass
class _Trainer:
    strategy: str = "megatron"
    fp32_lm_head: Any = True
    fused_lm_head_logprob: bool = False


@dataclasses.dataclass
class _Whole:
    trainer: _Trainer = dataclasses.field(default_factory=_Trainer)


def test_on_off_and_the_dataclasses_skyrl_builds():
    assert _check(_cfg()).mode == "fp32out"
    assert _check(_cfg({"fp32_lm_head": False})).mode is None
    settings = _check(_Whole())
    assert (settings.mode, settings.strategy) == ("fp32", "megatron")
    assert requested_mode(_Whole().trainer) == "fp32"
    with pytest.raises(Fp32LmHeadConfigError, match=r"trainer.fp32_lm_head = 'fp32-out' is not valid"):
        _check(_cfg({"fp32_lm_head": "fp32-out"}))


@pytest.mark.parametrize(
    ("trainer", "engine", "said"),
    [
        ({"strategy": "jax"}, {}, "trainer.strategy='jax'"),
        ({"bf16": False}, {}, "trainer.bf16=false"),
        ({"policy": {"fsdp_config": {"mixed_precision": {"param_dtype": "fp32"}}}}, {}, "param_dtype='fp32'"),
        ({"policy": {"model": {"lora": {"rank": 8, "target_modules": ["q_proj", "lm_head"]}}}}, {}, "LoRA adapter"),
        ({"strategy": "megatron", "fused_lm_head_logprob": True, "algorithm": {"enable_sample_support_replay": True}},
         {}, "enable_sample_support_replay=true"),
        ({}, {"model_dtype": "float16"}, "model_dtype is 'float16'"),
        ({}, {"external_proxy_url": "http://proxy:8080"}, "a proxy hides them"),
        ({}, {"engine_init_kwargs": {"hf_overrides": {"head_dtype": "bfloat16"}}}, "the two disagree"),
        ({}, {"enable_pd": True, "prefill_init_kwargs": {"hf_overrides": {"rope_parameters": {}}}},
         "prefill_init_kwargs.hf_overrides replaces"),
    ],
)  # fmt: skip
def test_refusals_name_what_and_where(trainer, engine, said):
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        _check(_cfg(trainer, engine))
    assert said in str(caught.value)


def test_the_switch_alone_and_against_the_key():
    with pytest.raises(Fp32LmHeadConfigError, match="one side|vLLM would compute fp32 logits"):
        _check(_cfg({"fp32_lm_head": False}), environ={"FP32PATCH_VLLM_LM_HEAD": "1"})
    with pytest.raises(Fp32LmHeadConfigError, match="the two disagree"):
        _check(_cfg(), environ={"NRL_VLLM_FP32_LM_HEAD": "0"})
    with pytest.raises(Fp32LmHeadConfigError, match="but trainer.fp32_lm_head is off"):
        _check(_cfg({"fp32_lm_head": False}, {"engine_init_kwargs": {"hf_overrides": {"head_dtype": "float32"}}}))


def test_vllm_before_head_dtype_is_refused_and_none_defers_to_the_probe():
    with pytest.raises(Fp32LmHeadConfigError, match=r"vLLM here is 0.23.0.*from 0.26"):
        _check(_cfg(), vllm=(0, 23, 0))
    assert _check(_cfg(), vllm=None).mode == "fp32out"


def test_batch_invariance_is_explained_not_refused():
    monkeypatch_env = {"VLLM_BATCH_INVARIANT": "1"}
    settings = _check(_cfg(), environ=monkeypatch_env)
    assert any("different kernels" in note and "bitwise" in note for note in settings.notes)
    assert not _check(_cfg()).notes


def test_a_probe_holds_every_server_to_the_key():
    good = {"dtype": "float32", "way": "native", "host": "h", "pid": 1}
    bad = {"dtype": "bfloat16", "way": "stock", "host": "h", "pid": 2, "reason": "head_dtype not set"}
    flat = check_servers({"http://a:8000": [good], "http://b:8000": [good, good]}, "fp32out", where="t")
    assert [len(f) for f in flat] == [1, 2]
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        check_servers({"http://a:8000": [good], "http://b:8000": [bad]}, "fp32out", where="t")
    text = str(caught.value)
    assert "vLLM server http://b:8000: vLLM worker 0 (host h, pid 2) computes bfloat16 logits" in text
    assert "http://a:8000" not in text
    assert "fell back to the model's dtype" in text and "see the server's log" in text
    # the key off: a server still computing float32 is named, and the line says the key is off once
    stock = {"dtype": "bfloat16", "way": "stock", "host": "h", "pid": 3}
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        check_servers({"http://a:8000": [stock], "http://c:8000": [good]}, None, where="t")
    (line,) = [ln for ln in str(caught.value).splitlines() if ln.startswith("  ")]
    assert line == (
        "  vLLM server http://c:8000: vLLM worker 0 (host h, pid 1) computes float32 logits while "
        "trainer.fp32_lm_head is off; the way is native: -"
    )


def test_the_fused_megatron_path_is_taken_and_off_leaves_it():
    from types import SimpleNamespace

    from fp32patch.runtime.skyrl import wire_megatron

    assert _check(_cfg({"strategy": "megatron", "fused_lm_head_logprob": True})).mode == "fp32out"
    fused = SimpleNamespace(cfg=SimpleNamespace(fp32_lm_head="fp32out"), _fused_lm_head=True, actor_module=[])
    assert wire_megatron(fused) is fused
    off = SimpleNamespace(cfg=SimpleNamespace(fp32_lm_head=False), _fused_lm_head=True, actor_module=object())
    assert wire_megatron(off) is off


class _Owner:
    """A Megatron module as the kit finds it: its output layer converted by fp32patch (the layer's
    forward is not run here: SkyRL's fused path never calls it)."""

    def __init__(self, weight, fusion: bool = False) -> None:
        from fp32patch.runtime.heads.megatron import Fp32ForwardImpl

        self.output_layer = SimpleNamespace(weight=weight, gradient_accumulation_fusion=fusion)
        self.output_layer.__dict__["_forward_impl"] = Fp32ForwardImpl("fp32out")

    def modules(self):
        return [self]


def test_the_fused_path_computes_fp32_log_probs_of_the_wired_head_only():
    """SkyRL's fused LM-head functions for a wired head: the temperature that SkyRL would divide the
    bf16 weight by travels with a view of the weight and divides the fp32 logits; the log-probs
    (with their gradient) and the entropy are float64's within fp32 rounding; another weight's
    call falls through (None) to SkyRL's own kernel."""
    import torch

    from fp32patch.runtime.kit.fused import forget_all, remember
    from fp32patch.runtime.skyrl import fused_entropy, fused_logprobs, fused_mode, scaled_weight

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 16, generator=gen).bfloat16()
    weight = torch.nn.Parameter((torch.randn(40, 16, generator=gen) * 2).bfloat16())
    target = torch.randint(0, 40, (2, 5), generator=gen)
    owner = _Owner(weight)  # held: the kit remembers wired heads weakly
    remember([owner], "megatron")
    try:
        view = scaled_weight(weight, 0.7)
        assert (fused_mode(weight), fused_mode(view), fused_mode(weight.detach().clone())) == ("fp32out",) * 2 + (None,)
        assert fused_logprobs(hidden, weight.detach().clone(), target, 0, None, False) is None
        log_probs = fused_logprobs(hidden, view, target, 0, None, False)
        z = hidden.double() @ weight.double().t() / 0.7
        want = torch.log_softmax(z, -1).gather(-1, target[..., None])[..., 0]
        assert log_probs.dtype == torch.float32 and (log_probs.double() - want).abs().max() < 2e-5
        log_probs.sum().backward()
        assert weight.grad is not None and weight.grad.shape == weight.shape
        entropy = fused_entropy(hidden, weight, None, 0.7)
        p = torch.softmax(z, -1)
        assert (entropy.double() + (p * p.log()).sum(-1)).abs().max() < 2e-5
        assert fused_entropy(hidden, weight.detach().clone(), None, 0.7) is None
        # SkyRL's own way rounds W / T to bf16 and the logits to bf16: far from float64
        stock = torch.log_softmax((hidden @ (weight / 0.7).t()).float(), -1).gather(-1, target[..., None])[..., 0]
        assert (stock.double() - want).abs().max() > 100 * (log_probs.double() - want).abs().max()
    finally:
        forget_all()


def test_the_fused_path_keeps_its_logits_only_for_a_call_within_skyrls_own_chunk(monkeypatch):
    """SkyRL's chunk bounds its own path's memory: a call of more tokens than a chunk never keeps
    its fp32 logits for the backward (the tiles are computed again), one within a chunk (or with
    SkyRL's chunking off) lets the chunked piece choose; the same log-probs either way."""
    import torch

    from fp32patch.runtime.kernels import chunked_logprobs as kernel
    from fp32patch.runtime.kit.fused import forget_all, remember
    from fp32patch.runtime.skyrl import fused_logprobs, scaled_weight
    from fp32patch.runtime.skyrl.megatron import keep_logits

    assert [keep_logits(t, c) for t, c in ((1024, 1024), (1025, 1024), (10, 8), (4096, None))] == [
        None,
        False,
        False,
        None,
    ]
    asked, real = [], kernel.chunked_logprobs

    def spy(*args, **kwargs):
        asked.append(kwargs["keep_logits"])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "chunked_logprobs", spy)
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 5, 16, generator=gen).bfloat16()
    weight = torch.nn.Parameter(torch.randn(40, 16, generator=gen).bfloat16())
    target = torch.randint(0, 40, (2, 5), generator=gen)
    owner = _Owner(weight)
    remember([owner], "megatron")
    try:
        view = scaled_weight(weight, 0.7)
        outs = [fused_logprobs(hidden, view, target, 0, None, False, chunk) for chunk in (1024, 4, None)]
        assert asked == [None, False, None]
        assert all(torch.equal(outs[0], out) for out in outs[1:])
    finally:
        forget_all()


@pytest.mark.parametrize("cap", [None, 6.0])
def test_the_wrappers_chunked_call_gives_the_capped_log_probs_of_a_capping_model(cap):
    """HFModelWrapper's path (``fused.model_call``) on a model that soft-caps its final logits as
    Gemma 2 does (and one that does not): the held log-probs and entropy are float64's of the
    capped logits, the gradient reaches the head; a model that caps at another value than its
    config names is refused."""
    import torch

    from fp32patch.runtime.heads.hf import UnsupportedLmHeadError, apply_fp32_lm_head
    from fp32patch.runtime.skyrl import fused
    from tests.support.openrlhf_actor import TinyCausalLM

    class Capped(TinyCausalLM):
        applies = cap

        def forward(self, input_ids, **kwargs):
            output = super().forward(input_ids, **kwargs)
            if self.applies is not None:
                output["logits"] = torch.tanh(output["logits"] / self.applies) * self.applies
            return output

    model = Capped()
    model.config = SimpleNamespace(final_logit_softcapping=cap)
    apply_fp32_lm_head(model, "fp32out")
    wrapper = SimpleNamespace(model=model)
    fused.mark(wrapper, model, "fp32out", role="policy")
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(3))
    targets = torch.roll(ids, -1, 1)
    output = fused.model_call(wrapper, targets, 0.7, True, True)(ids)
    held = output["logits"].div_(0.7)
    log_probs, entropy = held.log_probs(targets), held.entropy(requires_grad=True)

    hidden = model.hidden(ids).detach().double()
    z = hidden @ model.lm_head.weight.detach().double().t()
    if cap is not None:
        z = torch.tanh(z / cap) * cap
        assert (z - hidden @ model.lm_head.weight.detach().double().t()).abs().max() > 0.3  # the cap bites
    log_p = torch.log_softmax(z / 0.7, -1)
    assert (log_probs.double() - log_p.gather(-1, targets[..., None])[..., 0]).abs().max() < 2e-6
    assert (entropy.double() + (log_p.exp() * log_p).sum(-1)).abs().max() < 2e-6
    (log_probs.sum() + entropy.sum()).backward()
    assert model.lm_head.weight.grad is not None and torch.isfinite(model.lm_head.weight.grad.float()).all()

    if cap is not None:
        model.applies = cap / 2  # caps otherwise than its config says
        with pytest.raises(UnsupportedLmHeadError, match=f"other than its final_logit_softcapping={cap}"):
            fused.model_call(wrapper, targets, 0.7, True, False)(ids)
        model.applies = None  # its config names a cap its forward does not apply
        with pytest.raises(UnsupportedLmHeadError, match=f"names final_logit_softcapping={cap}, but the model"):
            fused.model_call(wrapper, targets, 0.7, True, False)(ids)
