"""The fp32 head's logits changed in place under autograd, on real megatron-core (TP=1, gloo).

NeMo-RL divides the logits by the training temperature in place, after GPTModel has turned
them from [s, b, v] to [b, s, v] with ``transpose(0, 1).contiguous()``, a no-op for the
batch of 1 that sequence packing gives. That needs logits that are no view made inside an
``autograd.Function``; the gradients must be those of the same change done out of place, bit
for bit. Here: GPTModel's own post-processing, a whole HybridModel (token ids in), and
NeMo-RL's patched ``setup.py`` with a training step at temperature 0.7 on a packed batch.
The same at TP=2 and under sequence parallelism is in test_megatron_tensor_parallel.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from megatron.core.transformer.module import Float16Module
from megatron_harness import MODES, B, Chunk, S, V, config, emulate_ddp, gpt_model, hybrid_model, output_layer, problem

from fp32patch.runtime.megatron_lm_head import apply_fp32_lm_head, fp32_lm_head_mode
from tests.support.in_place import CHANGES, TEMPERATURE, assert_same_bits, change

pytestmark = pytest.mark.usefixtures("tp1")


# ---- GPTModel's own post-processing: the output layer, then transpose/contiguous ----------


def postprocess_step(mode: str | None, batch: int, name: str, in_place: bool, tied: bool = False):
    """Hidden states [s, b, h] through a real GPTModel's ``_postprocess`` (what its forward
    runs after the decoder: output layer, [s, b, v] -> [b, s, v]), the logits changed, then
    backward. Returns the changed logits and the gradients of the hidden states and weight."""
    cfg = config()
    model = gpt_model(cfg, tied=tied)
    p = problem()
    weight = model.shared_embedding_or_output_weight()
    with torch.no_grad():
        weight.copy_(p.weight)
    if tied:  # gradient-accumulation fusion into the shared weight's main_grad, as DDP sets it up
        model.output_layer.gradient_accumulation_fusion = True
        emulate_ddp(weight)
    if mode is not None:
        apply_fp32_lm_head(Float16Module(cfg, model), mode)
    hidden = p.x[:, :batch].clone().requires_grad_()
    logits = model._postprocess(
        hidden,
        input_ids=None,
        position_ids=None,
        labels=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
    )
    assert logits.shape == (batch, S, V)
    out = change(name, logits, in_place)
    out.backward(p.grad[:, :batch].transpose(0, 1))
    dw = weight.main_grad if tied else weight.grad
    return out.detach(), hidden.grad, dw


@pytest.mark.parametrize("name", sorted(CHANGES))
@pytest.mark.parametrize("batch", [1, B])
@pytest.mark.parametrize("mode", MODES)
def test_gpt_logits_changed_in_place_give_the_out_of_place_gradients(mode: str, batch: int, name: str):
    got = postprocess_step(mode, batch, name, in_place=True)
    assert got[0].dtype == torch.float32
    assert_same_bits(got, postprocess_step(mode, batch, name, in_place=False))


@pytest.mark.parametrize("batch", [1, B])
@pytest.mark.parametrize("mode", MODES)
def test_tied_embeddings_with_main_grad_fusion_in_place(mode: str, batch: int):
    got = postprocess_step(mode, batch, "div_", in_place=True, tied=True)
    assert got[2].dtype == torch.float32 and got[2].any()
    assert_same_bits(got, postprocess_step(mode, batch, "div_", in_place=False, tied=True))


def test_the_stock_head_allows_it_too():
    # what the fp32 head must not take away: the stock bf16 head's logits allow it at batch 1
    got = postprocess_step(None, 1, "div_", in_place=True)
    assert got[0].dtype == torch.bfloat16
    assert_same_bits(got, postprocess_step(None, 1, "div_", in_place=False))


def test_a_gathered_output_at_tp1_is_megatrons_own_view_with_or_without_us():
    # gather_output=True at TP=1: Megatron's _GatherFromModelParallelRegion returns its input
    # as it is, which autograd treats as a view made inside a custom Function. The stock head
    # and ours fail alike (GPTModel and NeMo-RL use parallel_output=True: no gather)
    for mode in (None, "fp32out"):
        layer = output_layer(config(), problem().weight, True, 0, 1)
        if mode is not None:
            apply_fp32_lm_head(Chunk(layer), mode)
        logits, _ = layer(problem().x[:, :1].clone().requires_grad_())
        with pytest.raises(RuntimeError, match="view was created inside a custom Function"):
            logits.transpose(0, 1).contiguous().div_(TEMPERATURE)


# ---- a whole real model: token ids through Float16Module(HybridModel) ------------------------


def hybrid_step(mode: str, batch: int, in_place: bool):
    """Token ids through the whole wrapped model, logits divided by the temperature, a
    log-likelihood backward; the logits and every parameter's gradient."""
    cfg = config(hidden_dropout=0.0, attention_dropout=0.0)
    model = hybrid_model(cfg)
    wrapped = Float16Module(cfg, model)
    apply_fp32_lm_head([wrapped], mode)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (batch, S), generator=gen)
    logits = wrapped(ids, torch.arange(S).expand(batch, S), attention_mask=None)  # [b, s, v]
    logits = change("div_", logits, in_place)
    logp = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None])
    logp.sum().backward()
    return (logits.detach(), *(param.grad for _, param in sorted(model.named_parameters())))


@pytest.mark.parametrize("batch", [1, B])
@pytest.mark.parametrize("mode", MODES)
def test_a_whole_model_divided_in_place_trains_as_out_of_place(mode: str, batch: int):
    got = hybrid_step(mode, batch, in_place=True)
    assert got[0].dtype == torch.float32 and all(g is not None for g in got)
    assert_same_bits(got, hybrid_step(mode, batch, in_place=False))


# ---- NeMo-RL's temperature path: its patched setup.py, a training step at 0.7 ----------------


def apply_temperature_scaling(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Ours, with the behaviour of NeMo-RL's (nemo_rl/models/megatron/train.py): the logits
    divided in place whenever the temperature is not 1."""
    if temperature != 1.0:
        logits.div_(temperature)
    return logits


# Three sequences packed into one row, as NeMo-RL's sequence packing hands a micro-batch over
# (the model's one layer is an MLP: the packing shows in the positions and the loss mask)
PACKED_LENGTHS = (3, 2, 3)


def packed_batch(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token ids [1, S], positions restarting per sequence, and which tokens have a
    successor in their own sequence (the ones a log-prob loss reads)."""
    assert sum(PACKED_LENGTHS) == S
    ids = torch.randint(0, V, (1, S), generator=torch.Generator().manual_seed(seed))
    positions = torch.cat([torch.arange(n) for n in PACKED_LENGTHS]).unsqueeze(0)
    has_next = torch.cat([torch.arange(n) < n - 1 for n in PACKED_LENGTHS]).unsqueeze(0)
    return ids, positions, has_next


@pytest.fixture(scope="module")
def patched_setup(tmp_path_factory) -> Path:
    """The newest stand-in NeMo-RL checkout, patched by the fp32patch CLI: its setup.py."""
    from tests.fixtures.nemo_rl_shapes import SETUP, SHAPES, checkout
    from tests.nemo_rl_harness import cli

    root = checkout(SHAPES[0].name, tmp_path_factory.mktemp("nemo-rl"))
    code, data = cli("apply", "-s", str(root), "--patch", "nemo-rl-fp32-lm-head")
    assert code == 0, data
    return root / SETUP


def megatron_bridge(monkeypatch, cfg) -> None:
    """Megatron Bridge's two entry points setup.py uses, building real megatron-core models:
    ``get_model`` builds the chunk, runs the pre-wrap hooks, wraps it in Float16Module."""

    def get_model(provider, ddp_config, *, pre_wrap_hook=(), mixed_precision_wrapper=Float16Module, **_):
        chunks = [hybrid_model(cfg)]
        for hook in pre_wrap_hook:
            chunks = hook(chunks)
        return [mixed_precision_wrapper(cfg, chunk) for chunk in chunks]

    bridge = ModuleType("megatron.bridge")
    bridge.AutoBridge = SimpleNamespace(from_hf_pretrained=lambda name: SimpleNamespace(to_megatron_provider=None))
    provider = ModuleType("megatron.bridge.models.model_provider")
    provider.get_model = get_model
    for name, module in {
        "megatron.bridge": bridge,
        "megatron.bridge.models": ModuleType("megatron.bridge.models"),
        "megatron.bridge.models.model_provider": provider,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)


def training_step(monkeypatch, setup_path, fp32_lm_head, temperature_scaling) -> tuple:
    """NeMo-RL's setup builds the policy; one optimizer step on a packed micro-batch with the
    logits at temperature 0.7. Returns the head's mode and the dtype of the logits it gave,
    the logits as scaled, and every parameter after the step."""
    from tests.nemo_rl_harness import load_module
    from tests.test_nemo_rl_fp32_patch import policy_cfg

    megatron_bridge(monkeypatch, config(hidden_dropout=0.0, attention_dropout=0.0))
    monkeypatch.delenv("NRL_VLLM_FP32_LM_HEAD", raising=False)  # the workers' copy comes from the config
    setup = load_module(setup_path)
    cfg = policy_cfg(fp32_lm_head, env=None if fp32_lm_head is None else "1")
    state = setup.setup_model_and_optimizer(cfg, SimpleNamespace(model=None, ddp=None))
    policy = state.model
    head = policy.module.output_layer
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    head_before = head.weight.detach().clone()
    seen = []
    head.register_forward_hook(lambda module, args, out: seen.append(out[0].dtype))

    ids, positions, has_next = packed_batch()
    logits = policy(ids, positions, attention_mask=None)  # [1, s, v]
    logits = temperature_scaling(logits, TEMPERATURE)
    logp = torch.log_softmax(logits, dim=-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    advantages = torch.linspace(-1.0, 1.0, S - 1).unsqueeze(0)
    loss = -(logp * advantages * has_next[:, :-1]).sum() / has_next.sum()
    loss.backward()
    optimizer.step()
    assert not torch.equal(head.weight, head_before)  # a real step, through the head
    params = tuple(p.detach().clone() for _, p in sorted(policy.named_parameters()))
    return (fp32_lm_head_mode(head), *seen), logits.detach(), params


def out_of_place_scaling(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature if temperature != 1.0 else logits


@pytest.mark.parametrize("value", [True, *MODES[1:]])
def test_nemo_rl_training_step_at_temperature_0_7_on_packed_input(monkeypatch, patched_setup, value):
    head, logits, params = training_step(monkeypatch, patched_setup, value, apply_temperature_scaling)
    assert head == ("fp32" if value is True else value, torch.float32)
    _, expected_logits, expected = training_step(monkeypatch, patched_setup, value, out_of_place_scaling)
    assert_same_bits((logits, *params), (expected_logits, *expected))


def test_stock_nemo_rl_training_step_is_unchanged_by_the_patch(monkeypatch, patched_setup):
    # the switch off: the stock head, bf16 logits, and the in-place scaling works as before
    head, _, params = training_step(monkeypatch, patched_setup, None, apply_temperature_scaling)
    assert head == (None, torch.bfloat16)
    _, _, expected = training_step(monkeypatch, patched_setup, None, out_of_place_scaling)
    assert_same_bits(params, expected)
