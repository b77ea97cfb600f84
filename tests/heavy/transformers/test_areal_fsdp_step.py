"""AReaL's FSDP side from its one key, on a real transformers Qwen2 model under FSDP2 (CPU, gloo).

AReaL 1.0.4's own files, from its wheel (cached under $FP32PATCH_TEST_CACHE): ``fsdp_engine.py``
patched by the spec (``fp32patch``'s transform, as ``apply`` writes it), whose gate
``_fp32patch_wire_fsdp`` runs where ``FSDPEngine.initialize`` calls it, on an engine holding the
model as AReaL's ``parallelize_model`` leaves it (fp32 storage, AReaL's default optimizer_dtype;
FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32,
cast_forward_inputs=True)`` on each decoder layer, the untied embedding and the root, resharded
after forward: the shape of AReaL's ``apply_fsdp2``, written here) and AReaL's config shape
(``fsdp.enable_fp32_lm_head``); and AReaL's own log-prob code,
``areal/utils/functional/vocab_parallel.py``'s ``gather_logprobs_entropy`` (its one import from
AReaL stood in: ``is_npu_available`` False). One step as ``FSDPEngine`` runs it: a packed batch-1
row (``outputs.logits.squeeze(0)``), AReaL's labels (``torch.roll(input_ids, -1)``), log-probs and
entropy at the temperature, a policy-gradient loss with an entropy bonus, backward.

- key on: log-probs and entropy within 1e-4 of the float64 ones of the head's own input and bf16
  weight, where the stock step's miss them by bf16's rounding; the logits scaled in place
  (``logits.div_(T)``) give the same step;
- key off: the gate leaves the model alone and imports nothing of fp32patch; the step is the
  stock one's bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hf_harness import init_gloo, tiny, token_ids

from tests.support.areal import engine_files, load_vocab_parallel
from tests.support.lifecycle import gate_namespace

ENGINE = "areal/engine/fsdp_engine.py"
TEMPERATURE = 0.7
ENTROPY_COEF = 0.01
BOUND = 1e-4


@pytest.fixture(scope="module")
def gloo():
    import torch.distributed as dist

    from tests.support.rendezvous import file_store

    with file_store() as init_method:  # no port to race for
        init_gloo(0, 1, init_method)
        yield
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def areal_files() -> dict[str, bytes]:
    return engine_files(ENGINE)


@pytest.fixture(scope="module")
def vocab_parallel(areal_files, tmp_path_factory):
    """AReaL 1.0.4's own log-prob module, imported from its wheel's file."""
    return load_vocab_parallel(areal_files["vocab"], tmp_path_factory.mktemp("areal"))


def engine(on: bool) -> SimpleNamespace:
    """An AReaL FSDPEngine as the gate sees it: its config, and the model after parallelize_model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = tiny("qwen2", dtype=torch.float32).train()
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp_sp",))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    kwargs = {"mesh": mesh, "mp_policy": policy, "reshard_after_forward": True}
    for module in [*model.model.layers, model.model.embed_tokens]:  # untied: the embedding a unit
        fully_shard(module, **kwargs)
    fully_shard(model, **kwargs)
    engine_config = SimpleNamespace(
        fsdp=SimpleNamespace(enable_fp32_lm_head=on),
        megatron=SimpleNamespace(enable_fp32_lm_head=False),
        archon=SimpleNamespace(enable_fp32_lm_head=False),
        is_critic=False,
        experiment_name="areal-fsdp-step",
        trial_name="t0",
    )
    return SimpleNamespace(config=engine_config, model=model)


def step(eng: SimpleNamespace, vocab_parallel, *, in_place: bool = False) -> dict:
    """One FSDPEngine step: the model's logits, AReaL's labels and log-prob code, loss, backward."""
    model = eng.model
    seen: dict = {}
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(
        lambda module, args, out: seen.update(x=args[0].detach().double(), w=module.weight.detach().double())
    )
    ids = token_ids(batch=1, seed=3)
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits.squeeze(0)
    hook.remove()
    labels = torch.roll(ids, shifts=-1, dims=-1).squeeze(0)
    temperature = TEMPERATURE
    if in_place:
        logits.div_(TEMPERATURE)
        temperature = 1.0
    logp, entropy = vocab_parallel.gather_logprobs_entropy(logits, labels, temperature=temperature)
    advantages = torch.linspace(-1.0, 1.0, logp.shape[0])
    loss = -(advantages * logp).mean() - ENTROPY_COEF * entropy.mean()
    loss.backward()
    return {
        "logits_dtype": logits.dtype,
        "log_probs": logp.detach(),
        "entropy": entropy.detach(),
        "x": seen["x"].reshape(-1, seen["x"].shape[-1]),
        "w": seen["w"],
        "labels": labels,
        "grads": {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None},
    }


def reference(record: dict) -> dict:
    logits = record["x"] @ record["w"].t() / TEMPERATURE
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, record["labels"][:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return {"log_probs": logp, "entropy": entropy}


def test_the_key_on_gives_fp32_grade_log_probs_and_entropy(gloo, areal_files, vocab_parallel):
    namespace, _ = gate_namespace(areal_files["patched"])
    on = engine(True)
    namespace["_fp32patch_wire_fsdp"](on)
    record = step(on, vocab_parallel)
    assert record["logits_dtype"] == torch.float32
    assert record["w"].dtype == torch.float64 and record["grads"]
    ref = reference(record)
    for name in ("log_probs", "entropy"):
        err = (record[name].double() - ref[name]).abs().max().item()
        assert err < BOUND, (name, err)
    stock = step(engine(False), vocab_parallel)
    stock_ref = reference(stock)
    assert (stock["log_probs"].double() - stock_ref["log_probs"]).abs().max().item() > 10 * BOUND


def test_logits_scaled_in_place_give_the_same_step(gloo, areal_files, vocab_parallel):
    namespace, _ = gate_namespace(areal_files["patched"])
    first, second = engine(True), engine(True)
    namespace["_fp32patch_wire_fsdp"](first)
    namespace["_fp32patch_wire_fsdp"](second)
    divided = step(first, vocab_parallel)
    in_place = step(second, vocab_parallel, in_place=True)
    for name in ("log_probs", "entropy"):
        assert torch.allclose(in_place[name], divided[name], rtol=0, atol=2e-5), name
    assert in_place["grads"].keys() == divided["grads"].keys()
    for name, grad in in_place["grads"].items():
        assert torch.allclose(grad, divided["grads"][name], rtol=1e-3, atol=1e-6), name


def test_the_key_off_is_the_stock_step_bit_for_bit(gloo, areal_files, vocab_parallel):
    namespace, imported = gate_namespace(areal_files["patched"])
    off = engine(False)
    namespace["_fp32patch_wire_fsdp"](off)
    assert not [m for m in imported if m.startswith("fp32patch")], imported
    assert "forward" not in vars(off.model.get_output_embeddings())
    patched, stock = step(off, vocab_parallel), step(engine(False), vocab_parallel)
    for name in ("log_probs", "entropy"):
        assert torch.equal(patched[name], stock[name]), name
    for name, grad in patched["grads"].items():
        assert torch.equal(grad, stock["grads"][name]), name
