"""wire_megatron, as NeMo-RL's patched setup calls it, on real megatron-core models (CPU, gloo).

NeMo-RL hands over what ``get_model`` returns: a list of model chunks (one per virtual-
pipeline stage), each inside Float16Module and DDP, with pre-wrap hooks' results (PEFT
adapters, a draft model) inside. Reference log-probs reuse the policy model by swapping the
reference state dict in and out (``use_reference_model``), so they must stay fp32 too.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.module import Float16Module
from megatron_harness import B, H, Nest, S, V, assert_within, config, hybrid_model, problem
from test_megatron_output_layer import SHAPES, check_head

from fp32patch.runtime.megatron_lm_head import fp32_lm_head_mode
from fp32patch.runtime.nemo_rl import Fp32LmHeadConfigError, wire_megatron

pytestmark = pytest.mark.usefixtures("tp1")

WIRED_MODES = [True, "fp32out", "tf32", "fp32out-hilo"]


def megatron_cfg(value=None, **extra) -> dict:
    """NeMo-RL's policy.megatron_cfg with the keys that matter here."""
    cfg = {"enabled": True, "tensor_model_parallel_size": 1, "pipeline_dtype": "bfloat16", **extra}
    if value is not None:
        cfg["fp32_lm_head"] = value
    return cfg


@pytest.mark.parametrize("value", WIRED_MODES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda f: f.__name__.removeprefix("shape_"))
def test_every_nesting_shape_gets_fp32_logits(shape, value):
    chunk, layer = shape(config())
    model = chunk if isinstance(chunk, list) else [chunk]  # get_model returns a list
    assert wire_megatron(model, megatron_cfg(value)) is model
    mode = "fp32" if value is True else value
    assert fp32_lm_head_mode(layer) == mode
    p = problem()
    with torch.no_grad():
        layer.weight.copy_(p.weight)
    x = p.x.clone().requires_grad_()
    logits, _ = layer(x, weight=None, runtime_gather_output=None)
    logits.backward(p.grad)
    check_head(logits, x.grad, layer.weight.grad, p.x, p.weight, p.grad, mode)


@pytest.mark.parametrize("value", [None, False])
def test_off_leaves_the_model_alone(value):
    chunk, layer = SHAPES[1](config())
    cfg = megatron_cfg(value)
    assert wire_megatron([chunk], cfg) == [chunk]
    assert "_forward_impl" not in layer.__dict__
    logits, _ = layer(problem().x)
    assert logits.dtype == torch.bfloat16


def test_wiring_twice_is_a_no_op_and_another_mode_is_refused():
    chunk, layer = SHAPES[2](config())
    wire_megatron([chunk], megatron_cfg("fp32out"))
    impl = layer.__dict__["_forward_impl"]
    wire_megatron([chunk], megatron_cfg("fp32out"))
    assert layer.__dict__["_forward_impl"] is impl
    with pytest.raises(ValueError, match="already runs in mode 'fp32out'"):
        wire_megatron([chunk], megatron_cfg("tf32"))
    assert fp32_lm_head_mode(layer) == "fp32out"


def test_the_policy_section_is_read_through_and_a_bridge_config_is_refused():
    chunk, layer = SHAPES[0](config())
    wire_megatron(chunk, {"model_name": "m", "megatron_cfg": megatron_cfg("fp32out")})
    assert fp32_lm_head_mode(layer) == "fp32out"

    class ConfigContainer:  # Megatron Bridge's config, which setup.py also calls megatron_cfg
        model = None

    with pytest.raises(TypeError, match="expects NeMo-RL's policy.megatron_cfg"):
        wire_megatron(chunk, ConfigContainer())
    with pytest.raises(Fp32LmHeadConfigError, match="'TF32' is not valid"):
        wire_megatron(chunk, megatron_cfg("TF32"))


# ---- whole models, token ids in ----------------------------------------------------------------


class LoRALike(torch.nn.Module):
    """A PEFT adapter wrapped around a linear, as a PEFT pre-wrap hook leaves it: the wrapped
    layer under ``to_wrap``, a low-rank update added to its output."""

    def __init__(self, to_wrap: torch.nn.Module, rank: int = 4) -> None:
        super().__init__()
        self.to_wrap = to_wrap
        size_out, size_in = to_wrap.weight.shape  # this rank's rows
        self.lora_a = torch.nn.Linear(size_in, rank, bias=False, dtype=torch.bfloat16)
        self.lora_b = torch.nn.Linear(rank, size_out, bias=False, dtype=torch.bfloat16)
        torch.nn.init.zeros_(self.lora_b.weight)

    def forward(self, x, *args, **kwargs):
        out, bias = self.to_wrap(x, *args, **kwargs)
        return out + self.lora_b(self.lora_a(x)), bias


def peft_hook(chunks: list) -> list:
    """A pre-wrap hook: adapters on every MLP input projection, nothing else changed."""
    for chunk in chunks:
        for module in list(chunk.modules()):
            fc1 = getattr(module, "linear_fc1", None)
            if fc1 is not None and not isinstance(fc1, LoRALike):
                module.linear_fc1 = LoRALike(fc1)
    return chunks


def get_model_like(seed: int = 0, peft: bool = False, draft: bool = False) -> list:
    """What NeMo-RL's get_model returns on the last pipeline stage: [Nest(.module=Float16Module(model))]."""
    cfg = config(hidden_dropout=0.0, attention_dropout=0.0)
    chunks = [hybrid_model(cfg, seed=seed)]
    if peft:
        chunks = peft_hook(chunks)
    if draft:
        chunks[0].draft_model = torch.nn.Linear(H, H, dtype=torch.bfloat16)  # the draft hook's attachment
    return [Nest("module", Float16Module(cfg, chunk)) for chunk in chunks]


def inner(model: list):
    return model[0].module.module


def forward(model: list, seed: int = 5):
    """Token ids through the whole wrapped model; the head's input and weight as it saw them."""
    seen: dict[str, torch.Tensor] = {}

    def grab(module, args, kwargs):
        seen["hidden"] = (args[0] if args else kwargs["input_"]).detach()
        seen["weight"] = module.weight.detach()

    handle = inner(model).output_layer.register_forward_pre_hook(grab, with_kwargs=True)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=gen)
    positions = torch.arange(S).expand(B, S)
    try:
        with torch.no_grad():
            logits = model[0].module(ids, positions, attention_mask=None)  # [b, s, v]
    finally:
        handle.remove()
    return logits.transpose(0, 1), seen["hidden"], seen["weight"], ids


def assert_fp32_logits(logits, hidden, weight):
    ref = hidden.double() @ weight.double().t()
    assert_within(logits, ref, hidden.double().abs() @ weight.double().abs().t(), terms=H)


def assert_bf16_logits(logits):
    # Float16Module hands the last stage's output back as fp32: the values tell bf16 apart
    assert torch.equal(logits, logits.bfloat16().float())


@pytest.mark.parametrize(
    ("peft", "draft"), [(False, False), (True, False), (False, True)], ids=["plain", "peft", "draft"]
)
def test_a_whole_wrapped_model_gives_fp32_logits(peft, draft):
    stock = get_model_like(peft=peft, draft=draft)
    assert_bf16_logits(forward(stock)[0])
    model = get_model_like(peft=peft, draft=draft)
    assert any(isinstance(m, LoRALike) for m in model[0].modules()) == peft
    wire_megatron(model, megatron_cfg("fp32out"))
    logits, hidden, weight, _ = forward(model)
    assert not torch.equal(logits, logits.bfloat16().float())
    assert_fp32_logits(logits, hidden, weight)


def logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token's log-probability under the logits of the position before it."""
    logp = torch.log_softmax(logits.double(), dim=-1)  # [s, b, v]
    return logp[:-1].gather(-1, ids.t()[1:].unsqueeze(-1)).squeeze(-1)


def cpu_copy(state: dict) -> dict:
    """A state dict kept aside: tensors copied, anything else (``_extra_state``) as it is."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def swap_in(model: list, state: dict) -> None:
    """NeMo-RL's _apply_state_dict_to_model: an in-place copy of every tensor, same keys."""
    with torch.no_grad():
        for key, value in model[0].state_dict().items():
            if isinstance(value, torch.Tensor):
                value.copy_(state[key])


@pytest.mark.parametrize("value", ["fp32out", True])
def test_reference_logprobs_by_weight_swap_stay_fp32(value):
    policy = get_model_like(seed=0)
    wire_megatron(policy, megatron_cfg(value))
    before, *_ = forward(policy)

    # setup_reference_model_state: a separate, unwired model whose state dict is kept on the CPU
    reference = get_model_like(seed=1)
    reference_state = cpu_copy(reference[0].state_dict())
    assert set(reference_state) == set(policy[0].state_dict())  # the wiring adds no state

    saved = cpu_copy(policy[0].state_dict())
    swap_in(policy, reference_state)
    ref_logits, hidden, weight, ids = forward(policy)
    assert torch.equal(weight, inner(reference).output_layer.weight.detach())
    assert_fp32_logits(ref_logits, hidden, weight)
    stock_ref_logits, *_ = forward(reference)
    assert_bf16_logits(stock_ref_logits)
    # the same model, the same weights: the wired head's log-probs are the unrounded ones
    exact = logprobs(hidden.double() @ weight.double().t(), ids)
    wired_err = (logprobs(ref_logits, ids) - exact).abs().max()
    stock_err = (logprobs(stock_ref_logits, ids) - exact).abs().max()
    assert wired_err * 1000 < stock_err

    swap_in(policy, saved)
    after, *_ = forward(policy)
    assert torch.equal(before, after)  # the policy is itself again, still fp32
    assert fp32_lm_head_mode(inner(policy).output_layer) == ("fp32" if value is True else value)
