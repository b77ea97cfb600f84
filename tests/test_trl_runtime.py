"""TRL's glue: the guard's rules, the chunked log-probs at fp32 grade, the wiring of the trainer's
models, the colocated vLLM's switch, ``trl vllm-serve``'s command line and the startup probe.

The trainers are stand-ins with TRL's names and attributes (a class named ``GRPOTrainer`` in a
``trl.`` module, a config with TRL's fields): the guard reads only those. The models are
``tests.support.tiny_lm``'s (torch only). TRL's own classes meet this runtime in the heavy suite
(tests/heavy/trl: a real GRPO run with a real vLLM engine).
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import fp32patch
from fp32patch.runtime import trl as runtime
from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.heads.hf import UnsupportedLmHeadError, fp32_lm_head_mode
from fp32patch.runtime.kit.probe import PROBE_EXTENSION, PROBE_RPC, ProbeWorkerExtension, server_reports
from fp32patch.runtime.trl.config import TrlSettings, validate_fp32_lm_head_config
from fp32patch.runtime.trl.fused import MARK, ChunkedLogProbs, mark
from fp32patch.runtime.trl.wiring import WORKER_EXTENSION_FLAG, serve_command, set_vllm_env, wire_trainer
from tests.support import spies
from tests.support.tiny_lm import CausalLM

GATE = Path(fp32patch.__file__).parent / "patches" / "snippets" / "trl_gate.py"


def _trainer_class(name: str, module: str = "trl.trainer.x_trainer", base: type = object) -> type:
    return type(name, (base,), {"__module__": module})


GRPO = _trainer_class("GRPOTrainer", "trl.trainer.grpo_trainer")
RLOO = _trainer_class("RLOOTrainer", "trl.trainer.rloo_trainer")
SFT = _trainer_class("SFTTrainer", "trl.trainer.sft_trainer")
DISTILLATION = _trainer_class("DistillationTrainer", "trl.trainer.distillation_trainer")
GMPO = _trainer_class("GMPOTrainer", "trl.experimental.gmpo.gmpo_trainer", GRPO)
MINE = _trainer_class("GRPOTrainer", "my_project.trainers")  # TRL's name, someone else's class


@dataclasses.dataclass
class Args:
    """The fields of TRL's configs the guard reads (GRPOConfig's; RLOOConfig has no cast)."""

    fp32_lm_head: Any = "fp32out"
    cast_lm_head_to_fp32: bool = False
    use_vllm: bool = True
    vllm_mode: str = "colocate"
    bf16: bool = True
    fp16: bool = False
    use_liger_kernel: bool = False


def validate(args: Args, trainer: type = GRPO, path: str = "fused", model_dtype: Any = "float32", environ=None):
    return validate_fp32_lm_head_config(
        args, trainer=trainer, path=path, model_dtype=model_dtype, environ={} if environ is None else environ
    )


# ---------------------------------------------------------------- the guard's rules


@pytest.mark.parametrize(
    ("args", "kw", "expected"),
    [
        (Args(fp32_lm_head=None), {}, TrlSettings(None, rollout="colocate")),
        (Args(fp32_lm_head=False, use_vllm=False), {}, TrlSettings(None)),
        (Args(), {}, TrlSettings("fp32out", "GRPOTrainer", "fused", "colocate", "1")),
        (Args(fp32_lm_head=True), {"trainer": RLOO}, TrlSettings("fp32", "RLOOTrainer", "fused", "colocate", "1")),
        (Args(vllm_mode="server"), {"path": "logits"}, TrlSettings("fp32out", "GRPOTrainer", "logits", "server")),
        # a subclass of a wired trainer runs its __init__, and so its wiring
        (Args(fp32_lm_head="tf32"), {"trainer": GMPO}, TrlSettings("tf32", "GRPOTrainer", "fused", "colocate", "1")),
        # TRL's command line hands the field as a string; its booleans read as TRL reads them
        (Args(fp32_lm_head="true"), {}, TrlSettings("fp32", "GRPOTrainer", "fused", "colocate", "1")),
        (Args(fp32_lm_head="False"), {}, TrlSettings(None, rollout="colocate")),
        (Args(fp32_lm_head="no"), {}, TrlSettings(None, rollout="colocate")),
        # a variable that names vLLM's way is kept for the colocated engine
        (Args(), {"environ": {"FP32PATCH_VLLM_LM_HEAD": "copy"}}, TrlSettings("fp32out", "GRPOTrainer", "fused", "colocate", "copy")),
        # bf16 weights without autocast compute in bf16; fp16 autocast too
        (Args(bf16=False), {"model_dtype": torch.bfloat16}, TrlSettings("fp32out", "GRPOTrainer", "fused", "colocate", "1")),
        (Args(bf16=False, fp16=True), {}, TrlSettings("fp32out", "GRPOTrainer", "fused", "colocate", "1")),
        # from TRL 1.15 use_liger_kernel applies layer kernels only; the log-probs are the chunked path's
        (Args(use_liger_kernel=True), {}, TrlSettings("fp32out", "GRPOTrainer", "fused", "colocate", "1")),
        (Args(use_liger_kernel=True), {"path": "logits", "trainer": RLOO}, TrlSettings("fp32out", "RLOOTrainer", "logits", "colocate", "1")),
        # off in a server's trainer: the trainer's environment reaches no vLLM
        (Args(fp32_lm_head=None, vllm_mode="server"), {"environ": {"NRL_VLLM_FP32_LM_HEAD": "1"}}, TrlSettings(None, rollout="server")),
    ],
)  # fmt: skip
def test_valid_configs_and_what_they_ask_for(args, kw, expected):
    assert validate(args, **kw) == expected


@pytest.mark.parametrize(
    ("args", "kw", "fragments"),
    [
        (Args(), {"trainer": SFT}, ["fp32_lm_head is 'fp32out' but SFTTrainer is not a trainer fp32patch wires",
                                    "GRPOTrainer, RLOOTrainer and their subclasses", "set fp32_lm_head to false"]),
        (Args(), {"trainer": DISTILLATION}, ["DistillationTrainer is not a trainer fp32patch wires"]),
        (Args(), {"trainer": MINE}, ["GRPOTrainer is not a trainer fp32patch wires"]),
        (Args(cast_lm_head_to_fp32=True), {}, ["together with cast_lm_head_to_fp32",
                                               "from the fp32 master weights, which vLLM never sees", "Set one"]),
        (Args(bf16=False), {}, ["the trainer computes in float32 throughout", "Turn bf16 on"]),
        (Args(use_liger_kernel=True), {"path": "logits"}, ["together with use_liger_kernel", "bf16 tiles",
                                                           "Set use_liger_kernel to false"]),
        (Args(), {"environ": {"FP32PATCH_VLLM_LM_HEAD": "0"}}, [
            "fp32_lm_head is 'fp32out' but the environment variable FP32PATCH_VLLM_LM_HEAD is \"0\": the two disagree"]),
        (Args(fp32_lm_head=None), {"environ": {"NRL_VLLM_FP32_LM_HEAD": "1"}}, [
            'the environment variable NRL_VLLM_FP32_LM_HEAD is "1" but fp32_lm_head is off: the colocated vLLM would '
            "compute fp32 logits and the trainer bf16 ones", "measured (bench/RESULTS.md", "remove NRL_VLLM_FP32_LM_HEAD"]),
        (Args(fp32_lm_head=None), {"environ": {"NRL_VLLM_FP32_LM_HEAD": "1", "FP32PATCH_VLLM_LM_HEAD": "0"}}, [
            "FP32PATCH_VLLM_LM_HEAD='0' and NRL_VLLM_FP32_LM_HEAD='1' disagree"]),
        (Args(fp32_lm_head="TF32"), {}, ['fp32_lm_head = \'TF32\' is not valid (did you mean "tf32"?']),
        (Args(fp32_lm_head=1), {}, ["fp32_lm_head = 1 is not valid; valid values: false, true, \"fp32\""]),
    ],
)  # fmt: skip
def test_refusals_name_the_setting_and_what_to_do(args, kw, fragments):
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        validate(args, **kw)
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    ("args", "kw", "fragment"),
    [
        (Args(fp32_lm_head=None, cast_lm_head_to_fp32=True), {}, "cast_lm_head_to_fp32 alone is one-sided"),
        (Args(use_vllm=False), {}, "without vLLM (use_vllm is false): the trainer's log-probs are fp32"),
        (Args(vllm_mode="server"), {"environ": {"FP32PATCH_VLLM_LM_HEAD": "1"}}, "which vLLM's server does not read"),
    ],
)
def test_notes(args, kw, fragment):
    notes = validate(args, **kw).notes
    assert len(notes) == 1 and fragment in notes[0], notes


def test_cast_alone_without_vllm_is_no_one_sided_case():
    assert validate(Args(fp32_lm_head=None, cast_lm_head_to_fp32=True, use_vllm=False)).notes == ()


def test_a_config_without_the_field_is_off():
    assert validate(types.SimpleNamespace(use_vllm=True, vllm_mode="colocate")) == TrlSettings(None, rollout="colocate")


@pytest.fixture
def log_lines(caplog):
    caplog.set_level(logging.INFO, logger="trl.fp32patch")
    return lambda: [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "trl.fp32patch"]


def test_check_config_names_where_it_ran_logs_what_runs_and_the_notes(log_lines):
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        runtime.check_config(Args(), trainer=SFT, path="fused", where="SFTTrainer", environ={})
    assert str(caught.value).startswith("fp32patch (SFTTrainer): fp32_lm_head is 'fp32out' but SFTTrainer ")
    assert log_lines() == []
    runtime.check_config(Args(use_vllm=False), trainer=GRPO, path="fused", where="GRPOTrainer", environ={})
    runtime.check_config(Args(vllm_mode="server"), trainer=RLOO, path="logits", where="RLOOTrainer", environ={})
    assert log_lines() == [
        ("WARNING", "fp32patch (GRPOTrainer): fp32_lm_head='fp32out' without vLLM (use_vllm is false): the trainer's "
         "log-probs are fp32, generation runs in transformers and no engine's log-probs are compared with them"),
        ("INFO", "fp32patch (GRPOTrainer): fp32 chunked log-probs 'fp32out' for the policy and the reference model; no vLLM"),
        ("INFO", "fp32patch (RLOOTrainer): fp32 LM head 'fp32out' for the policy and the reference model; the vLLM "
         "server, probed at startup"),
    ]  # fmt: skip


# ---------------------------------------------------------------- the chunked log-probs


def _reference(hidden, weight, targets, temperature, dtype=torch.bfloat16, scale=1.0, cap=None):
    """float64 log-probs and entropy of the ``dtype``-rounded operands: the logits times ``scale``,
    capped at ``cap * tanh(z / cap)``, divided by the temperature (TRL's kernel's order)."""
    logits = (hidden.to(dtype).double() @ weight.to(dtype).double().T) * scale
    if cap is not None:
        logits = cap * torch.tanh(logits / cap)
    logits = logits / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _inputs(rows=24, hidden=64, vocab=300, seed=0, weight_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=gen) * 2
    w = (torch.randn(vocab, hidden, generator=gen) * 0.5).to(weight_dtype)
    return h, w, torch.randint(0, vocab, (rows,), generator=gen)


def test_the_chunked_log_probs_are_fp32_grade_under_trls_bf16_autocast():
    """fp32 master weights under TRL's bf16 autocast: computed from their bf16 copy (the values vLLM
    receives), fp32 products: float64's answer for those operands, where TRL's own tiles are bf16."""
    h, w, t = _inputs()
    weight = torch.nn.Parameter(w)
    hidden = h.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logp, ent, *rest = ChunkedLogProbs("fp32out").apply(
            hidden, weight, None, t, 0.7, 4096, None, 1.0, ("log_probs", "entropy")
        )
    want_logp, want_ent = _reference(h, w, t, 0.7)
    assert logp.dtype == ent.dtype == torch.float32 and rest == [None, None, None]
    assert torch.allclose(logp.double(), want_logp, atol=1e-5, rtol=0)
    assert torch.allclose(ent.double(), want_ent, atol=1e-5, rtol=0)
    bf16_logits = (h.bfloat16() @ w.bfloat16().T).float() / 0.7  # what TRL's tiles hold
    stock = torch.log_softmax(bf16_logits.double(), -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    assert (stock - want_logp).abs().max() > 100 * (logp.double() - want_logp).abs().max()

    (logp.sum() + 0.1 * ent.sum()).backward()
    ref_h, ref_w = h.double().requires_grad_(), w.bfloat16().double().requires_grad_()
    want_logp, want_ent = _reference(ref_h, ref_w, t, 0.7, dtype=torch.float64)
    (want_logp.sum() + 0.1 * want_ent.sum()).backward()
    assert weight.grad.dtype == torch.float32  # back through the autocast copy to the master weight
    assert (weight.grad.double() - ref_w.grad).abs().max() / ref_w.grad.abs().max() < 1e-2
    assert (hidden.grad.double() - ref_h.grad).abs().max() / ref_h.grad.abs().max() < 2e-2


def test_bf16_weights_without_autocast_and_the_log_probs_alone():
    h, w, t = _inputs(weight_dtype=torch.bfloat16)
    logp, ent, *_ = ChunkedLogProbs("fp32out").apply(h.bfloat16(), w, None, t, 1.0, 4096)
    assert ent is not None  # TRL's default outputs ask for every field it knows; ours: log-probs and entropy
    logp, ent, *_ = ChunkedLogProbs("fp32").apply(h.bfloat16(), w, None, t, 1.0, 4096, outputs=("log_probs",))
    assert ent is None
    assert torch.allclose(logp.double(), _reference(h, w, t, 1.0)[0], atol=1e-5, rtol=0)


def test_trls_path_takes_the_tile_measured_against_trls_own(monkeypatch):
    from fp32patch.runtime.kernels import chunked_logprobs as cl
    from fp32patch.runtime.trl import fused

    seen = spies.keyword_arguments(monkeypatch, cl, "chunked_logprobs")
    h, w, t = _inputs(weight_dtype=torch.bfloat16)
    ChunkedLogProbs("fp32out").apply(h.bfloat16(), w, None, t, 1.0, 4096, outputs=("log_probs",))
    # TRL's chunk_size is not ours: the tile has TRL's own rows and fewer logits (ours hold 8 bytes
    # a logit at the backward's peak, TRL's about 6: bench/RESULTS.md, the H100 step of 2026-12-05),
    # widened for a short call within them
    assert fused.TILE == (4096, 32768)
    assert (seen["chunk_rows"], seen["chunk_vocab"]) == fused.tile(t.numel(), w.shape[0], w.shape[1])
    assert 8 * 4096 * 22528 <= 0.7 * 2**30 < 0.76 * 2**30  # TRL's tile cost its step 0.76 GiB
    assert fused.tile(1024, 151936, 896) == (16384, 75968)  # two blocks instead of seven
    assert fused.tile(4096, 151936, 896) == (16384, 21760)  # TRL's rows: seven equal blocks
    # longer calls: taller tiles of the same logits, one row tile a block up to 16,384 tokens
    assert fused.tile(8192, 151936, 896) == (16384, 10880)
    assert fused.tile(16384, 151936, 896) == (16384, 5632)
    assert fused.tile(65536, 151936, 896) == (16384, 5632)
    for tokens in (1, 1000, 4096, 5000, 8192, 16384, 20000, 65536):
        rows, width = fused.tile(tokens, 151936, 896)
        assert min(rows, tokens) * width <= fused.TILE_LOGITS


def test_a_logit_scale_multiplies_the_logits_before_the_temperature_divides_them():
    h, w, t = _inputs(weight_dtype=torch.bfloat16)
    logp, *_ = ChunkedLogProbs("fp32out").apply(h.bfloat16(), w, None, t, 0.8, 4096, None, 0.25, ("log_probs",))
    assert torch.allclose(logp.double(), _reference(h, w, t, 0.8 / 0.25)[0], atol=1e-5, rtol=0)


def test_a_soft_cap_and_a_scale_are_applied_to_the_fp32_logits_as_trls_kernel_orders_them():
    """Gemma's final soft-cap with a scale and a temperature: the scale, the cap, then the
    temperature, on fp32 logits from the bf16 operands: float64's log-probs, entropy and gradients
    of the same arithmetic, where TRL's own tiles cap bf16-rounded logits."""
    h, w, t = _inputs(weight_dtype=torch.bfloat16)
    hidden = h.bfloat16().requires_grad_()
    weight = torch.nn.Parameter(w)
    logp, ent, *_ = ChunkedLogProbs("fp32out").apply(hidden, weight, None, t, 0.7, 4096, 5.0, 0.5)
    ref_h, ref_w = h.bfloat16().double().requires_grad_(), w.double().requires_grad_()
    want_logp, want_ent = _reference(ref_h, ref_w, t, 0.7, dtype=torch.float64, scale=0.5, cap=5.0)
    assert (logp.double() - want_logp).abs().max() < 1e-5 and (ent.double() - want_ent).abs().max() < 1e-5
    uncapped, _ = _reference(h, w, t, 0.7, scale=0.5)
    assert (uncapped - want_logp).abs().max() > 0.1  # the cap bites at these logits
    bf16_capped = 5.0 * torch.tanh((h.bfloat16() @ w.T).float() * 0.5 / 5.0)  # what TRL's tiles cap
    stock = torch.log_softmax(bf16_capped.double() / 0.7, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)
    assert (stock - want_logp.detach()).abs().max() > 100 * (logp.double() - want_logp).abs().max()
    (logp.sum() + 0.1 * ent.sum()).backward()
    (want_logp.sum() + 0.1 * want_ent.sum()).backward()
    assert (weight.grad.double() - ref_w.grad).abs().max() / ref_w.grad.abs().max() < 1e-2
    assert (hidden.grad.double() - ref_h.grad).abs().max() / ref_h.grad.abs().max() < 2e-2


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"bias": torch.zeros(300)}, "a bias"),
        ({"final_logit_softcapping": 0.0}, "a soft-cap of 0.0"),
        ({"logit_scale": 0.0}, "a logit scale of 0.0"),
        ({"outputs": ("log_probs", "is_top1", "mean_logits")}, "outputs is_top1, mean_logits"),
    ],
)
def test_what_the_chunked_piece_does_not_compute_is_refused(extra, fragment):
    h, w, t = _inputs(weight_dtype=torch.bfloat16)
    kwargs = {"bias": None, "final_logit_softcapping": None, "logit_scale": 1.0, "outputs": ("log_probs",), **extra}
    with pytest.raises(UnsupportedLmHeadError, match="turn fp32_lm_head off") as caught:
        ChunkedLogProbs("fp32out").apply(h.bfloat16(), w, kwargs.pop("bias"), t, 1.0, 4096, **kwargs)
    assert fragment in str(caught.value)


def test_fp32_operands_without_autocast_are_refused():
    h, w, t = _inputs()
    with pytest.raises(UnsupportedLmHeadError, match="compute in float32 here"):
        ChunkedLogProbs("fp32out").apply(h, w, None, t, 1.0, 4096)


def test_the_backward_never_reads_a_zero3_weight_after_trls_gather_ended():
    """DeepSpeed ZeRO-3 releases a gathered parameter's data when TRL's gather context ends, before
    the backward: a bf16 weight (which ``.to(bf16)`` would not copy) is copied for the backward.
    The release is stood in for by overwriting the parameter's values after the forward (ZeRO-3
    empties it; an empty one would fail plain torch's gradient accumulation, which ZeRO-3 handles)."""
    h, w, t = _inputs(weight_dtype=torch.bfloat16)
    weight = torch.nn.Parameter(w.clone())
    weight.ds_id = 0  # what marks a ZeRO-3 parameter
    hidden = h.bfloat16().requires_grad_()
    logp, *_ = ChunkedLogProbs("fp32out").apply(hidden, weight, None, t, 1.0, 4096, outputs=("log_probs",))
    with torch.no_grad():
        weight.fill_(float("nan"))
    logp.sum().backward()
    ref_h, ref_w = h.bfloat16().double().requires_grad_(), w.double().requires_grad_()
    _reference(ref_h, ref_w, t, 1.0, dtype=torch.float64)[0].sum().backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    assert (weight.grad.double() - ref_w.grad).abs().max() / ref_w.grad.abs().max() < 1e-2
    assert (hidden.grad.double() - ref_h.grad).abs().max() / ref_h.grad.abs().max() < 2e-2


# ---------------------------------------------------------------- marking and wiring


def test_mark_refuses_what_the_chunked_piece_cannot_compute():
    model = CausalLM(16, 40)
    with_bias = CausalLM(16, 40)
    with_bias.lm_head = torch.nn.Linear(16, 40, bias=True)
    with pytest.raises(UnsupportedLmHeadError, match="the policy's CausalLM.lm_head has a bias"):
        mark(with_bias, "fp32out", role="policy")
    adapted = CausalLM(16, 40)
    adapted.lm_head.lora_A = torch.nn.ModuleDict()  # what PEFT's LoRA layer holds
    with pytest.raises(UnsupportedLmHeadError, match="adapter"):
        mark(adapted, "fp32out", role="policy")
    assert not any(hasattr(m, MARK) for m in (with_bias, adapted))
    assert getattr(mark(model, "fp32out", role="policy"), MARK) == "fp32out"
    # a capped model (Gemma's final_logit_softcapping): TRL hands the cap to the chunked piece
    capped = CausalLM(16, 40)
    capped.config = types.SimpleNamespace(final_logit_softcapping=30.0)
    assert getattr(mark(capped, "fp32out", role="reference model"), MARK) == "fp32out"


class _Peft(torch.nn.Module):
    """PEFT's PeftModel as TRL meets it: the base model inside, attributes forwarded to it."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_model = base

    def get_base_model(self) -> torch.nn.Module:
        return self.base_model

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.base_model, name)


def _trainer(cls=GRPO, fp32_lm_head="fp32out", peft=False, ref=True):
    policy = CausalLM(16, 40, seed=1)
    trainer = cls()
    trainer.args = Args(fp32_lm_head=fp32_lm_head)
    trainer.model = _Peft(policy) if peft else policy
    trainer.ref_model = CausalLM(16, 40, seed=2) if ref else None
    return trainer, policy


def test_the_fused_path_marks_the_policy_and_the_reference_model(log_lines):
    trainer, policy = _trainer()
    wire_trainer(trainer, "fused")
    assert getattr(policy, MARK) == getattr(trainer.ref_model, MARK) == "fp32out"
    assert fp32_lm_head_mode(policy) is None  # the head module is TRL's: its chunked path never calls it
    assert log_lines() == [
        ("INFO", "fp32patch: the policy's chunked log-probs are fp32 (mode 'fp32out'): CausalLM"),
        ("INFO", "fp32patch: the reference model's chunked log-probs are fp32 (mode 'fp32out'): CausalLM"),
    ]
    assert repr(runtime.fused_kernel(policy)) == "ChunkedLogProbs(mode='fp32out')"


def test_the_full_logits_path_converts_the_heads_under_peft_the_base_models():
    trainer, policy = _trainer(RLOO, fp32_lm_head=True, peft=True, ref=False)
    wire_trainer(trainer, "logits")
    assert fp32_lm_head_mode(policy) == "fp32"
    assert getattr(trainer.model, MARK) == "fp32"  # what VLLMGeneration reads off the PEFT model
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert policy(torch.tensor([[1, 2, 3]])).dtype == torch.float32


def test_wire_trainer_with_the_switch_off_leaves_the_models_alone():
    trainer, policy = _trainer(fp32_lm_head="false")
    wire_trainer(trainer, "logits")
    assert not hasattr(policy, MARK) and fp32_lm_head_mode(policy) is None


# ---------------------------------------------------------------- the rollout's switch and trl vllm-serve


def test_the_mark_sets_vllms_switch_before_the_colocated_engine():
    model, environ = CausalLM(8, 16), {}
    setattr(model, MARK, "fp32out")
    assert set_vllm_env(model, where="colocated vLLM", environ=environ) == "1"
    assert environ == {"NRL_VLLM_FP32_LM_HEAD": "1"}


def test_a_switch_without_the_mark_is_refused_for_a_colocated_engine():
    """A trainer the guard does not see (Distillation, GOLD, ... share VLLMGeneration)."""
    with pytest.raises(
        Fp32LmHeadConfigError, match='FP32PATCH_VLLM_LM_HEAD="1" in this process but fp32_lm_head is off'
    ):
        set_vllm_env(CausalLM(8, 16), where="colocated vLLM", environ={"FP32PATCH_VLLM_LM_HEAD": "1"})


COMMAND = ["python", "-m", "vllm.entrypoints.cli.main", "serve", "Qwen/Qwen3-0.6B", "--port", "8000"]


def test_trl_vllm_serve_gets_the_switch_and_the_probe(capsys):
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    command = serve_command(types.SimpleNamespace(fp32_lm_head="true"), list(COMMAND), env)
    assert command == [*COMMAND, WORKER_EXTENSION_FLAG, PROBE_EXTENSION]
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "NRL_VLLM_FP32_LM_HEAD": "1"}
    assert capsys.readouterr().err.splitlines()[-1] == (
        "fp32patch (trl vllm-serve): --fp32_lm_head fp32: fp32 logits in every vLLM worker, and fp32patch's probe on "
        "each; without trl vllm-serve: FP32PATCH_VLLM_LM_HEAD=1 VLLM_SERVER_DEV_MODE=1 vllm serve Qwen/Qwen3-0.6B "
        f"--port 8000 {WORKER_EXTENSION_FLAG} {PROBE_EXTENSION}"
    )


@pytest.mark.parametrize(
    ("value", "command", "env", "fragment"),
    [
        ("fp32out", [*COMMAND, "--worker-extension-cls", "mine.Ext"], {}, "already names a worker extension"),
        ("fp32out", [*COMMAND, "--worker-extension-cls=mine.Ext"], {}, "already names a worker extension"),
        (None, COMMAND, {"FP32PATCH_VLLM_LM_HEAD": "1"}, 'FP32PATCH_VLLM_LM_HEAD="1" in this process but --fp32_lm_head is off'),
        ("fp32out", COMMAND, {"NRL_VLLM_FP32_LM_HEAD": "0"}, "--fp32_lm_head is 'fp32out' but NRL_VLLM_FP32_LM_HEAD=\"0\""),
        ("yes please", COMMAND, {}, "fp32patch (trl vllm-serve): fp32_lm_head = 'yes please' is not valid"),
    ],
)  # fmt: skip
def test_trl_vllm_serve_refusals(value, command, env, fragment):
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        serve_command(types.SimpleNamespace(fp32_lm_head=value), list(command), dict(env))
    assert fragment in str(caught.value), str(caught.value)


def test_trl_vllm_serve_with_the_switch_off_is_stock():
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    assert serve_command(types.SimpleNamespace(fp32_lm_head="false"), list(COMMAND), env) == COMMAND
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}


# ---------------------------------------------------------------- the probe


def _report(dtype="float32", way="fp32out", env="1", **extra):
    return {"dtype": dtype, "way": way, "env": env, "env_name": "NRL_VLLM_FP32_LM_HEAD", "host": "h", "pid": 7,
            "patched": True, **extra}  # fmt: skip


def test_the_colocated_probe_measures_the_model_trl_refits(monkeypatch, log_lines):
    engine_model = object()
    llm = types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(
            model_executor=types.SimpleNamespace(
                driver_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(model=engine_model))
            )
        )
    )
    seen = []
    monkeypatch.setattr(
        "fp32patch.runtime.heads.vllm_probe.probe_vllm_model", lambda m: seen.append(m) or _report(way="copy")
    )
    policy = CausalLM(8, 16)
    setattr(policy, MARK, "fp32out")
    assert runtime.probe_colocated(llm, policy) == [_report(way="copy")]
    assert seen == [engine_model]
    assert log_lines()[-1] == (
        "INFO",
        "fp32patch (colocated vLLM): 1 vLLM worker(s) compute float32 logits (way: copy), as fp32_lm_head='fp32out' asks",
    )


@pytest.mark.parametrize(
    ("report", "fragment"),
    [
        (_report("bfloat16", "off", None, env_name=None), "vLLM worker 0 (host h, pid 7) computes bfloat16 logits while "
         "fp32_lm_head='fp32out': FP32PATCH_VLLM_LM_HEAD is unset in that process (trl vllm-serve --fp32_lm_head sets it"),
        (_report("bfloat16", "stock", patched=False, file="/x/logits_processor.py"),
         "the model file is not patched (run fp32patch apply in that venv): /x/logits_processor.py"),
        ("no such method", "vLLM worker 0 returned no LM-head probe report (got 'no such method')"),
    ],
)  # fmt: skip
def test_a_worker_that_disagrees_stops_the_trainer(report, fragment):
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        runtime.check_reports([report], "fp32out", where="vLLM server")
    said = str(caught.value)
    assert said.startswith("fp32patch (vLLM server): vLLM's logits do not follow fp32_lm_head='fp32out':\n")
    assert fragment in said, said


class _Response:
    def __init__(self, status: int, body: Any = None, text: str = "") -> None:
        self.status_code, self._body, self.text = status, body, text

    def json(self) -> Any:
        if self._body is None:
            raise ValueError("no JSON")
        return self._body


def _client(response: Any) -> types.SimpleNamespace:
    calls = []

    def post(url, **kwargs):
        calls.append((url, kwargs))
        if isinstance(response, Exception):
            raise response
        return response

    return types.SimpleNamespace(post=post, base_url="http://h:8000", calls=calls)


def test_the_server_probe_asks_every_worker_over_http():
    client = _client(_Response(200, {"results": [_report(), _report(way="native")]}))
    model = CausalLM(8, 16)
    setattr(model, MARK, "fp32out")
    assert len(runtime.probe_server(client, model, post=client.post)) == 2
    assert client.calls == [("http://h:8000/collective_rpc", {"json": {"method": PROBE_RPC}, "timeout": 120})]


@pytest.mark.parametrize(
    ("response", "fragment"),
    [
        (_Response(404, text="Not Found"), "the server has no /collective_rpc (vLLM serves it with VLLM_SERVER_DEV_MODE=1)"),
        (_Response(500, text="AttributeError: 'Worker' object has no attribute 'fp32patch_probe_lm_head'"),
         "it answered 500: AttributeError: 'Worker' object has no attribute 'fp32patch_probe_lm_head' (its workers have no "
         "fp32patch_probe_lm_head: a plain `vllm serve`?)"),
        (_Response(200, {"answer": 1}), "its answer holds no results (KeyError"),
        (ConnectionError("refused"), "ConnectionError: refused"),
    ],
)  # fmt: skip
def test_a_server_that_cannot_answer_is_refused_with_how_to_start_one(response, fragment):
    model = CausalLM(8, 16)
    setattr(model, MARK, "fp32out")
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        client = _client(response)
        runtime.probe_server(client, model, post=client.post)
    said = str(caught.value)
    assert said.startswith(
        "fp32patch (vLLM server): cannot probe the vLLM server's LM heads at http://h:8000/collective_rpc: "
    )
    assert fragment in said and f"--worker-extension-cls {PROBE_EXTENSION}`" in said, said


def test_server_reports_hands_back_the_results():
    assert server_reports(_client(_Response(200, {"results": [[1], [2]]})).post, "http://h/", where="w",
                          how_to_start="") == [[1], [2]]  # fmt: skip


def test_the_probe_extension_is_importable_by_the_name_vllm_is_given(monkeypatch):
    module, _, name = PROBE_EXTENSION.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is ProbeWorkerExtension
    monkeypatch.setattr("fp32patch.runtime.heads.vllm_probe.probe_vllm_model", lambda m: {"model": m})
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(model="the model"))
    assert getattr(ProbeWorkerExtension, PROBE_RPC)(worker) == {"model": "the model"}


# ---------------------------------------------------------------- the names the patched files use


def test_the_gate_reads_the_mark_by_the_runtimes_name():
    source = GATE.read_text()
    marks = {
        n.value
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Constant) and str(n.value).startswith("_fp32patch_lm")
    }
    assert marks == {MARK}


def test_the_gates_runtime_calls_exist():
    called = set()
    for node in ast.walk(ast.parse(GATE.read_text())):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call):
            if getattr(node.value.func, "id", "") == "_fp32patch_runtime":
                called.add(node.attr)
    assert called == {"check_trainer", "wire_trainer", "fused_kernel", "set_vllm_env", "probe_colocated", "probe_server",
                      "serve_command"}  # fmt: skip
    assert called <= set(runtime.__all__)


def test_importing_the_runtime_imports_no_torch_vllm_or_trl():
    import subprocess
    import sys

    code = "import sys, fp32patch.runtime.trl; print(sorted(m for m in ('torch', 'vllm', 'trl') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
