"""TRL 1.16's own trainers, patched, before any vLLM engine starts: what the guard refuses and
what the wiring does to the models, in this process (the patched root first on ``sys.path``).

- GRPO with the switch and ``use_vllm`` off: the policy's and the reference model's fused
  forward (TRL's ``add_fused_lm_head``, called as TRL calls it, under bf16 autocast) returns
  fp32patch's log-probs: float64's for the bf16 copy of the fp32 master weights to ~1e-6, where
  TRL's own kernel, which rounds its tiles to bf16, is ~1e-2 off; the same through a LoRA
  policy (PEFT, the head not adapted) and for RLOO.
- Refused, each naming what to do: another TRL trainer with the switch (SFT), the switch with
  ``cast_lm_head_to_fp32``, a trainer in fp32 throughout, vLLM's switch in the environment of
  a colocated run whose trainer switch is off, a PEFT-adapted head (``modules_to_save``).
- ``cast_lm_head_to_fp32`` alone is TRL's own, accepted with the warning that it is one-sided.
"""

from __future__ import annotations

import logging

import pytest
import torch

from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.heads.hf import UnsupportedLmHeadError
from tests.heavy.trl.grpo_run import PROMPTS, TEMPERATURE, reward_length

pytestmark = pytest.mark.xdist_group("trainers")


def _config(kind: str = "grpo", **overrides):
    from trl import GRPOConfig, RLOOConfig, SFTConfig

    common = dict(output_dir="unused", use_cpu=True, report_to="none", save_strategy="no", gradient_checkpointing=False)
    if kind == "sft":
        return SFTConfig(**common, **overrides)
    values = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, beta=0.04,
                  temperature=TEMPERATURE, use_vllm=False)  # fmt: skip
    return (GRPOConfig if kind == "grpo" else RLOOConfig)(**common, **{**values, **overrides})


def _trainer(model_dir, kind: str = "grpo", peft_config=None, **overrides):
    from datasets import Dataset
    from trl import GRPOTrainer, RLOOTrainer, SFTTrainer

    if kind == "sft":
        data = Dataset.from_dict({"text": PROMPTS})
        return SFTTrainer(model=str(model_dir), args=_config("sft", **overrides), train_dataset=data)
    cls = GRPOTrainer if kind == "grpo" else RLOOTrainer
    data = Dataset.from_dict({"prompt": PROMPTS})
    return cls(
        model=str(model_dir),
        reward_funcs=reward_length,
        args=_config(kind, **overrides),
        train_dataset=data,
        peft_config=peft_config,
    )


def _fused_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """What TRL's GRPO asks the fused forward for (labels of the completion, under bf16 autocast)."""
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, fused_lm_head=True).log_probs


def _reference(model, ids: torch.Tensor) -> torch.Tensor:
    """float64 log-probs from the backbone's hidden states and the bf16 copy of the head weight."""
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        hidden = (
            model.get_base_model().model(input_ids=ids)
            if hasattr(model, "get_base_model")
            else model.model(input_ids=ids)
        )
    weight = model.get_output_embeddings().weight.detach().bfloat16().double()
    h = hidden.last_hidden_state[:, :-1].bfloat16().double()
    logp = torch.log_softmax((h @ weight.T) / TEMPERATURE, -1)
    return logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)


IDS = torch.tensor([[11, 42, 7, 300, 12, 99, 5, 250, 17, 8]])


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_the_fused_log_probs_of_both_models_are_fp32patchs(model_dir, kind):
    trainer = _trainer(model_dir, kind, fp32_lm_head="fp32out")
    want = _reference(trainer.model, IDS)
    for model in (trainer.model, trainer.ref_model):
        assert model._fp32patch_lm_head == "fp32out"
        got = _fused_log_probs(model, IDS)
        assert got.dtype == torch.float32
        assert (got.double() - want).abs().max() < 2e-5, (got.double() - want).abs().max()
    # the control: TRL's own kernel on the same model, the mark taken off
    del trainer.model._fp32patch_lm_head
    stock = _fused_log_probs(trainer.model, IDS)
    assert (stock.double() - want).abs().max() > 1e-3


def test_a_lora_policy_with_the_head_not_adapted(model_dir):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = _trainer(model_dir, peft_config=lora, fp32_lm_head=True)
    assert trainer.ref_model is None  # the reference is the policy with its adapter disabled
    assert trainer.model._fp32patch_lm_head == "fp32"  # read through PEFT's wrappers by VLLMGeneration
    base = trainer.model.get_base_model()
    assert base.__dict__["_fp32patch_lm_head"] == "fp32"
    got = _fused_log_probs(base, IDS)
    assert (got.double() - _reference(trainer.model, IDS)).abs().max() < 2e-5


def test_a_peft_adapted_head_is_refused(model_dir):
    from peft import LoraConfig

    lora = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM")
    with pytest.raises(UnsupportedLmHeadError, match="only a plain torch.nn.Linear is supported"):
        _trainer(model_dir, peft_config=lora, fp32_lm_head="fp32out")


def test_a_soft_capped_model_gets_its_cap_on_the_fp32_logits():
    """Gemma 2 (``final_logit_softcapping``) through TRL's own ``add_fused_lm_head``, which hands
    the model's cap to the kernel: fp32patch's chunked piece caps the fp32 logits, then divides
    by the temperature, as TRL's kernel orders them: float64's answer to ~1e-6, where TRL's own
    kernel caps bf16-rounded logits; a training step through it has float64's head gradient."""
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from fp32patch.runtime.trl.fused import mark

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                          final_logit_softcapping=4.0, tie_word_embeddings=False, attn_implementation="eager")  # fmt: skip
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # logits of ~10 before the cap: it bites
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs",))
    mark(model, "fp32out", role="policy")
    got = _fused_log_probs(model, IDS)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        hidden = model.model(input_ids=IDS).last_hidden_state[:, :-1].bfloat16().double()
    z = hidden @ model.lm_head.weight.detach().bfloat16().double().T
    capped = torch.log_softmax(4.0 * torch.tanh(z / 4.0) / TEMPERATURE, -1).gather(-1, IDS[:, 1:, None])[..., 0]
    uncapped = torch.log_softmax(z / TEMPERATURE, -1).gather(-1, IDS[:, 1:, None])[..., 0]
    assert got.dtype == torch.float32 and (uncapped - capped).abs().max() > 0.5
    assert (got.double() - capped).abs().max() < 2e-5, (got.double() - capped).abs().max()
    del model._fp32patch_lm_head  # the control: TRL's own kernel
    stock = _fused_log_probs(model, IDS)
    assert (stock.double() - capped).abs().max() > 10 * (got.double() - capped).abs().max()
    mark(model, "fp32out", role="policy")
    # a training step through it: the head's gradient is float64's of the capped log-probs (the
    # backbone's hidden states held fixed in the reference), and the optimizer moves the weight
    adv = torch.linspace(-1.0, 1.0, IDS.shape[1] - 1)[None]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=IDS, attention_mask=torch.ones_like(IDS), labels=IDS, fused_lm_head=True)
    (-(adv * out.log_probs).mean()).backward()
    ref_w = model.lm_head.weight.detach().bfloat16().double().requires_grad_()
    z = hidden @ ref_w.T
    ref = torch.log_softmax(4.0 * torch.tanh(z / 4.0) / TEMPERATURE, -1).gather(-1, IDS[:, 1:, None])[..., 0]
    (-(adv.double() * ref).mean()).backward()
    grad = model.lm_head.weight.grad.double()
    assert (grad - ref_w.grad).abs().max() / ref_w.grad.abs().max() < 1e-2
    before = model.lm_head.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.lm_head.weight.detach())


@pytest.mark.parametrize(
    ("kind", "overrides", "fragment"),
    [
        ("sft", {"fp32_lm_head": "fp32out"}, "fp32patch (SFTTrainer): fp32_lm_head is 'fp32out' but SFTTrainer is not a "
         "trainer fp32patch wires"),
        ("grpo", {"fp32_lm_head": "fp32out", "cast_lm_head_to_fp32": True}, "together with cast_lm_head_to_fp32"),
        ("grpo", {"fp32_lm_head": "fp32out", "bf16": False}, "the trainer computes in float32 throughout"),
    ],
)  # fmt: skip
def test_refusals(model_dir, kind, overrides, fragment):
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        _trainer(model_dir, kind, **overrides)
    assert fragment in str(caught.value)


def test_vllms_switch_without_the_trainers_is_refused_before_the_engine_starts(model_dir, monkeypatch):
    monkeypatch.setenv("FP32PATCH_VLLM_LM_HEAD", "1")
    with pytest.raises(
        Fp32LmHeadConfigError, match="the colocated vLLM would compute fp32 logits and the trainer bf16"
    ):
        _trainer(model_dir, use_vllm=True, vllm_mode="colocate")


def test_cast_alone_is_trls_own_with_a_warning(model_dir, caplog):
    """In server mode the guard runs before the client looks for the server (here: none)."""
    caplog.set_level(logging.WARNING, logger="trl.fp32patch")
    with pytest.raises(OSError, match="can.t be reached"):
        _trainer(model_dir, cast_lm_head_to_fp32=True, use_vllm=True, vllm_mode="server",
                 vllm_server_base_url="http://127.0.0.1:9", vllm_server_timeout=1)  # fmt: skip
    (said,) = [r.getMessage() for r in caplog.records if r.name == "trl.fp32patch"]
    assert said.startswith("fp32patch (GRPOTrainer): cast_lm_head_to_fp32 alone is one-sided: the trainer's head")
