"""fp32patch.runtime.openrlhf: the guard, the rollout's switches and probe, and the actor's log-probs.

The guard and the rollout side are pure Python, tested on namespaces as train_ppo_ray builds them
(flat to 0.10.1.post2, nested from 0.10.2; test_openrlhf_releases.py runs every release's own
parser through it). The actor's side runs OpenRLHF's own ``Actor.forward`` from real releases
(0.9.8 and 0.10.4: the entropy before the temperature; 0.11.2: after it, ``div_`` in place), patched by
``fp32patch apply``, on a tiny bf16 causal LM with torch alone (tests/support/openrlhf_actor.py
says what stands in for flash-attn): switch off, the stock results bit for bit; on, log-probs and
entropy at fp32 grade against float64 with a temperature of 0.7, packed and padded batches, a
finite backward, full logits in fp32 where a caller asks for them, and no [B, T, V] tensor.
"""

from __future__ import annotations

import logging
import types
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.heads.hf import UnsupportedLmHeadError
from fp32patch.runtime.kit import rollout
from fp32patch.runtime.modes import VLLM_ENV_VAR
from fp32patch.runtime.openrlhf import (
    MARK,
    PROBE_RPC,
    check_config,
    check_engines,
    engine_options,
    probe_engines,
    validate_fp32_lm_head_config,
    wire_actor,
)
from fp32patch.runtime.openrlhf.config import GUARD, STACK

LOG = logging.getLogger("test")


def _flat(**kw):
    """A namespace as train_ppo_ray builds it up to 0.10.1.post2 (flat names)."""
    base = dict(
        fp32_lm_head=None,
        vllm_num_engines=1,
        ds_tensor_parallel_size=1,
        load_in_4bit=False,
        lora_rank=0,
        target_modules="all-linear",
        param_dtype="bf16",
        enable_vllm_is_correction=False,
    )
    return Namespace(**{**base, **kw})


def _nested(fp32_lm_head=None, *, level="off", engines=1, tp=1, four_bit=False, rank=0, targets="all-linear"):
    """A namespace as 0.11.2 builds it (dotted flags nested by utils/config.py's hierarchize)."""
    ns = types.SimpleNamespace
    return ns(
        fp32_lm_head=fp32_lm_head,
        vllm=ns(num_engines=engines),
        ds=ns(
            tensor_parallel_size=tp,
            load_in_4bit=four_bit,
            param_dtype="bf16",
            lora=ns(rank=rank, target_modules=targets),
        ),
        algo=ns(advantage=ns(is_correction_level=level)),
    )


# ---------------------------------------------------------------- the guard


@pytest.mark.parametrize("off", [None, False, "false", "0", "off", ""])
def test_off_in_every_spelling_is_off(off):
    assert validate_fp32_lm_head_config(_nested(off), environ={}).mode is None
    assert validate_fp32_lm_head_config(_flat(fp32_lm_head=off), environ={}).mode is None


@pytest.mark.parametrize(("raw", "mode"), [("true", "fp32"), ("fp32out", "fp32out"), ("tf32", "tf32"), (True, "fp32")])
def test_the_flag_names_a_trainer_mode(raw, mode):
    assert validate_fp32_lm_head_config(_nested(raw), environ={}).mode == mode


@pytest.mark.parametrize("bad", ["fp32-out", "FP32OUT", "bf16", "yes please"])
def test_an_unknown_value_is_refused_with_the_valid_ones(bad):
    with pytest.raises(Fp32LmHeadConfigError, match="--fp32_lm_head .* is not valid.*valid values: false, true"):
        validate_fp32_lm_head_config(_nested(bad), environ={})


@pytest.mark.parametrize(
    ("args", "found"),
    [
        (_nested("fp32out", level="seq"), "--algo.advantage.is_correction_level seq"),
        (_nested("fp32out", level="off"), None),
        (
            types.SimpleNamespace(
                **{
                    **vars(_nested("fp32out")),
                    "algo": types.SimpleNamespace(advantage=types.SimpleNamespace(is_correction_enable=True)),
                }
            ),
            "--algo.advantage.is_correction_enable",
        ),
        (_flat(fp32_lm_head="fp32out", enable_vllm_is_correction=True), "--enable_vllm_is_correction"),
        (_flat(fp32_lm_head="fp32out"), None),
    ],
)
def test_the_importance_sampling_flags_in_all_three_spellings_are_read_not_refused(args, found):
    assert validate_fp32_lm_head_config(args, environ={}).is_correction == found


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (_nested("fp32out", engines=0), "no vLLM engine generates the rollouts"),
        (_nested("fp32out", engines=None), "no vLLM engine generates the rollouts"),
        (_nested("fp32out", tp=2), "--ds.tensor_parallel_size 2: DeepSpeed's AutoTP"),
        (_flat(fp32_lm_head="fp32out", ds_tensor_parallel_size=4), "--ds_tensor_parallel_size 4"),
        (_nested("fp32out", four_bit=True), "--ds.load_in_4bit: a 4-bit model"),
        (_flat(fp32_lm_head="fp32out", load_in_4bit=True), "--load_in_4bit"),
        (_nested("fp32out", rank=8, targets=["q_proj", "lm_head"]), "LoRA adapter on the head .*lm_head"),
        (_flat(fp32_lm_head="fp32out", lora_rank=8, target_modules=["lm_head"]), "--target_modules lm_head"),
        (_flat(fp32_lm_head="fp32out", param_dtype="fp16"), "--param_dtype fp16: OpenRLHF's vLLM engines"),
    ],
)
def test_what_fp32patch_cannot_compute_is_refused(args, said):
    with pytest.raises(Fp32LmHeadConfigError, match=said):
        validate_fp32_lm_head_config(args, environ={})


def test_lora_that_leaves_the_head_alone_is_accepted():
    assert validate_fp32_lm_head_config(_nested("fp32out", rank=8, targets="all-linear"), environ={}).mode == "fp32out"
    assert validate_fp32_lm_head_config(_nested("fp32out", rank=8, targets=["q_proj", "v_proj"]), environ={})


@pytest.mark.parametrize("name", ["fp32_lm_heads", "fp32-lm-head", "FP32_LM_HEAD", "fp32lmhead"])
def test_a_near_miss_key_is_refused(name):
    args = _nested()
    setattr(args, name, "fp32out")
    with pytest.raises(Fp32LmHeadConfigError, match=f"--{name} is not fp32patch's flag: write --fp32_lm_head"):
        validate_fp32_lm_head_config(args, environ={})


def test_the_flag_under_a_section_is_refused():
    args = _nested()
    args.ds.fp32_lm_head = "fp32out"
    with pytest.raises(Fp32LmHeadConfigError, match="--ds.fp32_lm_head is not fp32patch's flag"):
        validate_fp32_lm_head_config(args, environ={})


def test_one_side_alone_and_a_contradiction_are_refused():
    with pytest.raises(Fp32LmHeadConfigError, match="vLLM would compute fp32 logits and the trainer bf16"):
        validate_fp32_lm_head_config(_nested(None), environ={VLLM_ENV_VAR: "1"})
    with pytest.raises(Fp32LmHeadConfigError, match="the two disagree"):
        validate_fp32_lm_head_config(_nested("fp32out"), environ={"FP32PATCH_VLLM_LM_HEAD": "0"})
    settings = validate_fp32_lm_head_config(_nested("fp32out"), environ={VLLM_ENV_VAR: "1"})
    assert settings.mode == "fp32out" and "not needed" in settings.notes[0]


def test_check_config_names_the_caller_and_keeps_the_verdict(caplog):
    with pytest.raises(Fp32LmHeadConfigError, match=r"^fp32patch \(train_ppo_ray\): --fp32_lm_head is 'fp32out' with"):
        check_config(_nested("fp32out", tp=2), environ={})
    with caplog.at_level(logging.INFO, logger="openrlhf.fp32patch"):
        settings = check_config(_nested("fp32out", level="token", engines=2), environ={})
    assert STACK.verdict(GUARD) is settings
    assert "in 2 vLLM engine(s), probed at startup; OpenRLHF's importance-sampling correction is on" in caplog.text


# ---------------------------------------------------------------- the rollout: engine options and the probe


class _EngineClass:
    """Ray's ActorClass as create_vllm_engines uses it: ``.options(**kw).remote(**kwargs)``."""

    def __init__(self):
        self.calls = []

    def options(self, **kwargs):
        self.calls.append(kwargs)
        return types.SimpleNamespace(remote=lambda **kw: ("engine", kwargs, kw))


@pytest.fixture
def guarded(monkeypatch):
    """The driver's guard has run with the flag on; the installed vLLM is what the test says."""

    def run(mode, version):
        STACK.verdicts.pop(GUARD, None)
        check_config(_nested(mode), environ={})
        monkeypatch.setattr(rollout, "installed_vllm_version", lambda: version)

    yield run
    STACK.verdicts.pop(GUARD, None)


def test_vllm_from_0_26_gets_head_dtype_in_the_engine_arguments(guarded):
    guarded("fp32out", (0, 29, 0))
    cls, kwargs = _EngineClass(), {"model": "m", "dtype": "bfloat16"}
    engine_options(cls, kwargs)(num_cpus=1, num_gpus=1)
    assert kwargs["hf_overrides"] == {"head_dtype": "float32"}
    assert cls.calls == [{"num_cpus": 1, "num_gpus": 1}]  # no variable: vLLM's own head_dtype does it


def test_earlier_vllm_gets_the_variable_in_the_ray_runtime_env(guarded):
    guarded("fp32out", (0, 19, 1))
    cls, kwargs = _EngineClass(), {"model": "m"}
    engine_options(cls, kwargs)(num_cpus=1, runtime_env={"env_vars": {"X": "y"}, "pip": ["a"]})
    assert kwargs == {"model": "m"}
    assert cls.calls == [{"num_cpus": 1, "runtime_env": {"env_vars": {"X": "y", VLLM_ENV_VAR: "1"}, "pip": ["a"]}}]


def test_engine_options_refuse_a_contradicting_or_one_sided_setting(guarded):
    guarded("fp32out", (0, 29, 0))
    with pytest.raises(Fp32LmHeadConfigError, match="head_dtype='bfloat16': the two disagree"):
        engine_options(_EngineClass(), {"hf_overrides": {"head_dtype": "bfloat16"}})
    guarded("fp32out", (0, 22, 1))
    with pytest.raises(Fp32LmHeadConfigError, match="runtime_env: the two disagree"):
        engine_options(_EngineClass(), {})(runtime_env={"env_vars": {VLLM_ENV_VAR: "0"}})
    guarded(None, (0, 29, 0))
    with pytest.raises(Fp32LmHeadConfigError, match="gives vLLM fp32 logits but --fp32_lm_head is off"):
        engine_options(_EngineClass(), {"hf_overrides": {"head_dtype": "float32"}})
    with pytest.raises(Fp32LmHeadConfigError, match="in the rollout's Ray runtime_env but --fp32_lm_head is off"):
        engine_options(_EngineClass(), {})(runtime_env={"env_vars": {VLLM_ENV_VAR: "1"}})
    cls, kwargs = _EngineClass(), {"model": "m"}
    engine_options(cls, kwargs)(num_cpus=1)
    assert kwargs == {"model": "m"} and cls.calls == [{"num_cpus": 1}]


def test_no_vllm_in_the_driver_is_refused(guarded):
    guarded("fp32out", None)
    with pytest.raises(Fp32LmHeadConfigError, match=r"^fp32patch \(create_vllm_engines\): no vLLM is installed"):
        engine_options(_EngineClass(), {})
    assert rollout.vllm_route((0, 25, 9)) == "variable" and rollout.vllm_route((0, 26, 0)) == "head_dtype"


def _report(dtype="float32", way="native", env=None, pid=1):
    return {"dtype": dtype, "way": way, "env": env, "pid": pid, "host": "h", "patched": False, "reason": "r"}


def test_the_probe_passes_when_every_engine_is_fp32(caplog):
    with caplog.at_level(logging.INFO, logger="openrlhf.fp32patch"):
        flat = check_engines([[_report()], [_report(), _report(pid=2)]], "fp32out", where="vLLM engines")
    assert [len(f) for f in flat] == [1, 2]
    assert "2 vLLM engine(s), 3 worker(s), compute float32 logits (way: native)" in caplog.text


def test_the_probe_refuses_a_bf16_worker_naming_its_engine():
    answers = [[_report()], [_report(), _report(dtype="bfloat16", way="stock", env=None, pid=77)]]
    with pytest.raises(Fp32LmHeadMismatchError) as info:
        check_engines(answers, "fp32out", where="vLLM engines")
    text = str(info.value)
    assert "the rollout's logits do not follow --fp32_lm_head='fp32out'" in text
    assert "vLLM engine 1: vLLM worker 1 (host h, pid 77) computes bfloat16 logits" in text
    assert "vLLM engine 0" not in text


def test_a_head_dtype_that_fell_back_is_said_so():
    answers = [[_report(dtype="bfloat16", way="stock", pid=9)]]
    with pytest.raises(Fp32LmHeadMismatchError) as info:
        check_engines(answers, "fp32out", where="vLLM engines", route="head_dtype")
    assert (
        "vLLM engine 0: vLLM worker 0 (host h, pid 9) computes bfloat16 logits while --fp32_lm_head='fp32out' "
        "asked vLLM for head_dtype float32 (hf_overrides): vLLM fell back" in str(info.value)
    )


def test_an_engine_without_reports_is_refused():
    with pytest.raises(Fp32LmHeadMismatchError, match="engine 0.*no vLLM worker returned"):
        check_engines([[]], "fp32out", where="vLLM engines")


def test_probe_engines_asks_every_engine_through_its_probe_method(guarded):
    guarded("fp32out", (0, 29, 0))

    class Engine:
        def __init__(self, reports):
            setattr(self, PROBE_RPC, types.SimpleNamespace(remote=lambda: reports))

    engines = [Engine([_report()]), Engine([_report(dtype="bfloat16", way="stock")])]
    with pytest.raises(Fp32LmHeadMismatchError, match="vLLM engine 1"):
        probe_engines(engines, get=list)
    assert probe_engines(engines[:1], get=list) == [[_report()]]


# ---------------------------------------------------------------- the actor, from real releases

ACTOR_RELEASES = ("0.9.8", "0.10.4", "0.11.2")
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    """Each release's Actor, stock and patched by ``fp32patch apply`` (real files from its wheel)."""
    from typer.testing import CliRunner

    from fp32patch.cli import app
    from fp32patch.patcher.spec import load_specs
    from tests.support.openrlhf_actor import FILES, actor_class
    from tests.support.pypi import import_root_from_members, member_files

    spec = next(s for s in load_specs() if s.id == "openrlhf-fp32-lm-head")
    out = {}
    for version in ACTOR_RELEASES:
        stock = member_files("openrlhf", version, list(FILES))
        root = tmp_path_factory.mktemp(f"openrlhf-{version}")
        import_root_from_members("openrlhf", version, sorted({*FILES, *(p for _, p in spec.target.files)}), root)
        result = CliRunner().invoke(app, ["apply", "-s", str(root), "--patch", spec.id])
        assert result.exit_code == 0, result.output
        patched = {f: Path(root) / f for f in FILES}
        out[version] = (actor_class({f: stock[f] for f in FILES})[0], actor_class(patched)[0])
    return out


def _batch():
    torch.manual_seed(1)
    sequences = torch.randint(0, 96, (2, 12))
    attention_mask = torch.ones_like(sequences)
    attention_mask[1, :3] = 0  # left padding, as OpenRLHF's rollouts are
    action_mask = torch.ones(2, 5)
    action_mask[0, -1] = 0
    return sequences, attention_mask, action_mask


def _reference(model, sequences, entropy_temperature, softcap=None):
    """float64 log-probs of the next tokens and entropies from the model's own bf16 operands (its
    logits capped at ``softcap`` first, where given)."""
    hidden = model.hidden(sequences).detach().double()
    weight = model.lm_head.weight.detach().double().requires_grad_(True)
    logits = hidden @ weight.T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    rolled = torch.roll(sequences, -1, 1)
    log_probs = torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, rolled.unsqueeze(-1)).squeeze(-1)[:, :-1]
    scaled = logits.detach() / entropy_temperature
    entropy = -(torch.softmax(scaled, -1) * torch.log_softmax(scaled, -1)).sum(-1)[:, :-1]
    return log_probs, entropy, weight


def _divides_in_place(version: str) -> bool:
    """0.11.1 and later divide the logits by the temperature in place, before the entropy."""
    return tuple(int(p) for p in version.split(".")[:3]) >= (0, 11, 1)


def _entropy_temperature(version):
    return TEMPERATURE if _divides_in_place(version) else 1.0


def _run(actor, sequences, attention_mask, action_mask):
    return actor(sequences, action_mask, attention_mask, return_output=True, return_entropy=True)


@pytest.mark.network
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("version", ACTOR_RELEASES)
def test_switch_off_is_the_stock_forward_bit_for_bit(releases, version, packing):
    from tests.support.openrlhf_actor import TinyCausalLM, make_actor

    stock_cls, patched_cls = releases[version]
    batch = _batch()
    stock = make_actor(stock_cls, TinyCausalLM(), temperature=TEMPERATURE, packing=packing)
    patched = make_actor(patched_cls, TinyCausalLM(), temperature=TEMPERATURE, packing=packing)
    wire_actor(patched, Namespace(fp32_lm_head="false"), role="actor")
    (lp0, out0), (lp1, out1) = _run(stock, *batch), _run(patched, *batch)
    assert torch.equal(lp0, lp1) and torch.equal(out0.entropy, out1.entropy)
    lp0.sum().backward()
    lp1.sum().backward()
    assert torch.equal(stock.model.lm_head.weight.grad, patched.model.lm_head.weight.grad)
    assert not hasattr(patched, MARK)


@pytest.mark.network
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("version", ACTOR_RELEASES)
def test_switch_on_gives_fp32_grade_log_probs_and_entropy_and_a_finite_update(releases, version, packing):
    from tests.support.openrlhf_actor import TinyCausalLM, make_actor

    stock_cls, patched_cls = releases[version]
    sequences, attention_mask, action_mask = _batch()
    stock = make_actor(stock_cls, TinyCausalLM(), temperature=TEMPERATURE, packing=packing)
    actor = make_actor(patched_cls, TinyCausalLM(), temperature=TEMPERATURE, packing=packing)
    wire_actor(actor, Namespace(fp32_lm_head="fp32out"), role="actor")
    lp_stock, out_stock = _run(stock, sequences, attention_mask, action_mask)
    log_probs, output = _run(actor, sequences, attention_mask, action_mask)
    ref_lp, ref_entropy, weight64 = _reference(actor.model, sequences, _entropy_temperature(version))

    assert log_probs.dtype == torch.float32 and output.entropy.dtype == torch.float32
    actions = action_mask.bool()
    valid = attention_mask[:, :-1].bool()  # the positions whose next token is real
    ours = (log_probs.double() - ref_lp[:, -5:] * action_mask)[actions].abs().max().item()
    stocks = (lp_stock.double() - ref_lp[:, -5:] * action_mask)[actions].abs().max().item()
    assert ours < 2e-6 < 1e-4 < stocks, (ours, stocks)  # fp32 grade; the stock bf16 logits are off by ~1e-3
    assert (output.entropy.double() - ref_entropy)[valid].abs().max().item() < 2e-6
    assert (out_stock.entropy.double() - ref_entropy)[valid].abs().max().item() > 1e-4

    # the update: finite, the weight gradient in the weight's dtype (bf16) and of float64's value
    (log_probs * action_mask).sum().backward()
    (ref_lp[:, -5:] * action_mask).sum().backward()
    grad = actor.model.lm_head.weight.grad
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad.float()).all()
    error = (grad.double() - weight64.grad).norm() / weight64.grad.norm()
    assert error < 1e-2, error.item()


@pytest.mark.network
@pytest.mark.parametrize("version", ACTOR_RELEASES)
def test_no_batch_by_sequence_by_vocabulary_tensor_is_made(releases, version):
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.support.openrlhf_actor import TinyCausalLM, make_actor

    class Shapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.seen.add(tuple(t.shape))
            return out

    sequences, attention_mask, action_mask = _batch()
    for wired in (False, True):
        actor = make_actor(releases[version][1], TinyCausalLM(), temperature=TEMPERATURE, packing=False)
        if wired:
            wire_actor(actor, Namespace(fp32_lm_head="fp32out"), role="actor")
        with Shapes() as mode:
            log_probs, _ = _run(actor, sequences, attention_mask, action_mask)
            log_probs.sum().backward()
        full = (2, 12, 96) in mode.seen
        assert full is not wired, (wired, sorted(mode.seen))  # stock builds it; the switch never does


@pytest.mark.network
@pytest.mark.parametrize("version", ACTOR_RELEASES)
def test_a_caller_that_wants_the_logits_gets_them_in_fp32(releases, version):
    from tests.support.openrlhf_actor import TinyCausalLM, make_actor

    sequences, attention_mask, _ = _batch()
    actor = make_actor(releases[version][1], TinyCausalLM(), temperature=TEMPERATURE, packing=False)
    wire_actor(actor, Namespace(fp32_lm_head="fp32out"), role="reference model")
    output = actor(sequences, None, attention_mask, return_output=True)
    logits = output["logits"]
    assert isinstance(logits, torch.Tensor) and logits.dtype == torch.float32 and logits.shape == (2, 12, 96)
    hidden = actor.model.hidden(sequences).double()
    expected = hidden @ actor.model.lm_head.weight.double().T
    if _divides_in_place(version):
        expected = expected / TEMPERATURE  # divided in place by forward itself
    assert (logits.double() - expected).abs().max().item() < 1e-5


def _capped_model(cap: float, applies: float | None = None):
    """TinyCausalLM whose config says ``final_logit_softcapping=cap`` and whose forward caps its
    logits as transformers' Gemma 2 does (at ``applies``, the config's cap unless given)."""
    from tests.support.openrlhf_actor import TinyCausalLM

    class Capped(TinyCausalLM):
        def forward(self, input_ids, **kwargs):
            output = super().forward(input_ids, **kwargs)
            at = cap if applies is None else applies
            output["logits"] = torch.tanh(output["logits"] / at) * at
            return output

    model = Capped()
    model.config = types.SimpleNamespace(final_logit_softcapping=cap)
    return model


@pytest.mark.network
@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("version", ACTOR_RELEASES)
def test_a_model_that_caps_its_logits_gets_the_capped_log_probs_in_fp32(releases, version, packing):
    # Gemma 2's final_logit_softcapping: the chunked piece caps the fp32 logits, as vLLM does
    from tests.support.openrlhf_actor import make_actor

    cap = 6.0  # the tiny model's logits reach ~10: the cap bites
    stock_cls, patched_cls = releases[version]
    sequences, attention_mask, action_mask = _batch()
    stock = make_actor(stock_cls, _capped_model(cap), temperature=TEMPERATURE, packing=packing)
    actor = make_actor(patched_cls, _capped_model(cap), temperature=TEMPERATURE, packing=packing)
    wire_actor(actor, Namespace(fp32_lm_head="fp32out"), role="actor")
    lp_stock, out_stock = _run(stock, sequences, attention_mask, action_mask)
    log_probs, output = _run(actor, sequences, attention_mask, action_mask)
    ref_lp, ref_entropy, weight64 = _reference(actor.model, sequences, _entropy_temperature(version), softcap=cap)
    uncapped, _, _ = _reference(actor.model, sequences, _entropy_temperature(version))
    actions, valid = action_mask.bool(), attention_mask[:, :-1].bool()
    assert (ref_lp - uncapped)[:, -5:][actions].abs().max() > 0.1  # the cap changes the log-probs
    ours = (log_probs.double() - ref_lp[:, -5:] * action_mask)[actions].abs().max().item()
    stocks = (lp_stock.double() - ref_lp[:, -5:] * action_mask)[actions].abs().max().item()
    assert ours < 2e-6 < 1e-4 < stocks, (ours, stocks)
    assert (output.entropy.double() - ref_entropy)[valid].abs().max().item() < 2e-6
    (log_probs * action_mask).sum().backward()
    (ref_lp[:, -5:] * action_mask).sum().backward()
    grad = actor.model.lm_head.weight.grad
    assert grad.dtype == torch.bfloat16 and torch.isfinite(grad.float()).all()
    assert ((grad.double() - weight64.grad).norm() / weight64.grad.norm()).item() < 1e-2


@pytest.mark.network
def test_what_the_chunked_path_cannot_compute_is_refused(releases):
    from tests.support.openrlhf_actor import TinyCausalLM, make_actor

    actor_cls = releases["0.11.2"][1]
    sequences, attention_mask, action_mask = _batch()

    lora = TinyCausalLM()
    lora.lm_head.lora_A = torch.nn.Linear(32, 4)
    with pytest.raises(UnsupportedLmHeadError, match="adapter"):
        wire_actor(
            make_actor(actor_cls, lora, temperature=1.0, packing=False), Namespace(fp32_lm_head="fp32out"), role="actor"
        )

    capped = TinyCausalLM()
    capped.config = types.SimpleNamespace(final_logit_softcapping=-30.0)
    with pytest.raises(UnsupportedLmHeadError, match="final_logit_softcapping=-30.0, which is not a positive"):
        wire_actor(
            make_actor(actor_cls, capped, temperature=1.0, packing=False),
            Namespace(fp32_lm_head="fp32out"),
            role="actor",
        )
    # a model that caps at another value than its config says: its log-probs would not be the cap's
    actor = make_actor(actor_cls, _capped_model(30.0, applies=20.0), temperature=1.0, packing=False)
    wire_actor(actor, Namespace(fp32_lm_head="fp32out"), role="actor")
    with pytest.raises(UnsupportedLmHeadError, match="other than its final_logit_softcapping=30.0"):
        _run(actor, sequences, attention_mask, action_mask)

    class Scaled(TinyCausalLM):
        def forward(self, input_ids, **kwargs):
            output = super().forward(input_ids, **kwargs)
            output["logits"] = output["logits"] * 0.5
            return output

    actor = make_actor(actor_cls, Scaled(), temperature=1.0, packing=False)
    wire_actor(actor, Namespace(fp32_lm_head="fp32out"), role="actor")
    with pytest.raises(UnsupportedLmHeadError, match="changes its logits after the head"):
        _run(actor, sequences, attention_mask, action_mask)


def test_the_ray_runtime_env_keeps_a_switch_already_named_either_way():
    logger = logging.getLogger("test")
    kept = rollout.ray_runtime_env(
        {"env_vars": {"FP32PATCH_VLLM_LM_HEAD": "copy"}}, "fp32out", key="--fp32_lm_head", where="w", logger=logger
    )
    assert kept == {"env_vars": {"FP32PATCH_VLLM_LM_HEAD": "copy"}}
    with pytest.raises(Fp32LmHeadConfigError, match="is not valid"):
        rollout.ray_runtime_env({"env_vars": {VLLM_ENV_VAR: "maybe"}}, "fp32out", key="k", where="w", logger=logger)
    assert rollout.ray_runtime_env(None, None, key="k", where="w", logger=logger) == {}
