"""fp32patch's Prime-RL runtime on its own: the config rules, the fp32-grade forwards of the four
heads Prime-RL installs (on the stand-in checkout's heads: its shapes, not its code) against
float64, their refusals, and the probe's verdicts. Prime-RL's real heads and a real model:
tests/heavy/transformers/test_prime_rl_step.py (opt-in over a checkout)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.heads.hf import UnsupportedLmHeadError
from fp32patch.runtime.prime_rl import head as prime_head
from fp32patch.runtime.prime_rl.config import validate_rl_config, validate_trainer_config
from fp32patch.runtime.prime_rl.probe import hold
from tests.fixtures.prime_rl_shapes import SRC, forget_prime_rl
from tests.support import spies

# ---------------------------------------------------------------- the rules


@pytest.mark.parametrize(
    ("raw", "rollout", "mode"),
    [(None, True, "fp32out"), (True, True, "fp32out"), ("true", True, "fp32out"), ("tf32", True, "tf32")]
    + [(None, False, None), (False, False, None), ("false", False, None)],
)
def test_the_trainer_follows_prime_rl_switch(raw, rollout, mode):
    config = {"trainer": {"model": {"fp32_lm_head": raw}}, "inference": {"enable_fp32_lm_head": rollout}}
    settings = validate_rl_config(config, environ={})
    assert (settings.mode, settings.rollout) == (mode, rollout)


def test_without_an_inference_section_the_trainer_follows_the_default_and_says_so():
    settings = validate_rl_config({"trainer": {}}, environ={})
    assert settings.mode == "fp32out" and settings.rollout is None
    assert any("whose default is true" in note for note in settings.notes)
    assert any("no [inference] section" in note for note in settings.notes)


def test_the_variable_beside_prime_rl_switch_is_a_note_and_alone_a_refusal():
    on = validate_rl_config({"trainer": {}, "inference": {}}, environ={"NRL_VLLM_FP32_LM_HEAD": "1"})
    assert any("Prime-RL's monkey-patch computes vLLM's logits" in note for note in on.notes)
    with pytest.raises(Fp32LmHeadConfigError, match="NRL_VLLM_FP32_LM_HEAD='1' turns fp32patch's vLLM head on"):
        validate_rl_config(
            {"trainer": {}, "inference": {"enable_fp32_lm_head": False}}, environ={"NRL_VLLM_FP32_LM_HEAD": "1"}
        )


@pytest.mark.parametrize(
    ("lora", "refused"),
    [
        (["q_proj", "v_proj"], False),
        (["lm_head"], True),
        ([r".*head$"], True),
        (["lm_head_x"], False),
        (["head"], False),
    ],
)
def test_a_lora_on_the_head_is_told_as_prime_rl_matches_patterns(lora, refused):
    config = {"model": {"lora": {"target_modules": lora}}}
    if refused:
        with pytest.raises(Fp32LmHeadConfigError, match="adapt lm_head"):
            validate_trainer_config(config)
    else:
        assert validate_trainer_config(config).mode == "fp32out"


def test_the_standalone_trainer_says_what_unset_means():
    settings = validate_trainer_config({"model": {}})
    assert settings.mode == "fp32out" and "follows inference.enable_fp32_lm_head" in settings.notes[0]
    assert validate_trainer_config({"model": {"fp32_lm_head": False}}).mode is None


# ---------------------------------------------------------------- the heads


@pytest.fixture(scope="module")
def heads():
    """The stand-in checkout's head classes (Prime-RL's four kinds, in its shapes)."""
    sys.path.insert(0, str(SRC / "src"))
    forget_prime_rl()
    try:
        from prime_rl.trainer.models.layers import lm_head

        yield lm_head
    finally:
        sys.path.remove(str(SRC / "src"))
        forget_prime_rl()


class Model(torch.nn.Module):
    def __init__(self, head, softcap=None):
        super().__init__()
        self.lm_head = head
        self.config = type("C", (), {"final_logit_softcapping": softcap, "get_text_config": lambda self: self})()


def build(heads, kind, softcap=None, chunk=5, v=300, h=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cls = getattr(heads, kind)
    args = {"FusedOutputLinear": (chunk,), "GemmaFusedOutputLinear": (chunk, softcap)}.get(kind, ())
    if kind == "GemmaVanillaOutputLinear":
        args = (softcap,)
    head = cls(h, v, *args)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=gen) * (4.0 / h**0.5))
    return Model(head.to(torch.bfloat16), softcap)


def float64(x, w, labels, temps, softcap):
    z = x.double() @ w.double().t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = torch.log_softmax(z / temps.double()[..., None], dim=-1)
    return log_p.gather(-1, labels[..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)


@pytest.mark.parametrize(("kind", "softcap"), [("FusedOutputLinear", None), ("GemmaFusedOutputLinear", 5.0)])
@pytest.mark.parametrize("uniform", [True, False])
def test_the_fused_kinds_against_float64_and_their_stock_error(heads, kind, softcap, uniform):
    model = build(heads, kind, softcap)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 23, 32, generator=gen).bfloat16()
    labels = torch.randint(0, 300, (1, 23), generator=gen)
    temps = torch.full((1, 23), 0.7) if uniform else torch.cat([torch.full((1, 11), 0.7), torch.ones(1, 12)], 1)
    ref_lp, ref_ent = float64(x, model.lm_head.weight, labels, temps, softcap)
    stock = model.lm_head(x, labels, temperature=temps)["logprobs"]
    assert prime_head.install(model, "fp32out") == kind
    xg = x.clone().requires_grad_()
    out = model.lm_head(xg, labels, temperature=temps)
    assert set(out) == {"logprobs", "entropy"} and out["logprobs"].dtype == torch.float32
    err = (out["logprobs"].double() - ref_lp).abs().max().item()
    assert err < 1e-5 and (out["entropy"].double() - ref_ent).abs().max() < 1e-5
    assert (stock.double() - ref_lp).abs().max().item() > 50 * err  # bf16 logits: what a user would see
    (out["logprobs"].sum() + 0.1 * out["entropy"].sum()).backward()
    assert model.lm_head.weight.grad.dtype == torch.bfloat16 and torch.isfinite(xg.grad).all()


def test_the_fused_head_tiles_hold_no_more_logits_than_prime_rls_own_step_holds(monkeypatch):
    from fp32patch.runtime.kernels import chunked_logprobs as cl

    seen = spies.keyword_arguments(monkeypatch, cl, "chunked_logprobs")
    x = torch.randn(1, 23, 32, generator=torch.Generator().manual_seed(3)).bfloat16()
    w = torch.randn(300, 32, generator=torch.Generator().manual_seed(4)).bfloat16()
    prime_head.fused_logprobs(x, w, torch.zeros(1, 23, dtype=torch.long), torch.full((1, 23), 0.7), "fp32out", None, 5)
    # the head's token chunk, and the widest vocabulary block within the budget: the whole vocabulary here
    assert (seen["chunk_rows"], seen["chunk_vocab"]) == (5, 300)
    # Qwen2's vocabulary (bench/RESULTS.md, the H100 step of 2026-12-05): 8192 x 30400 tiles held
    # the step over Prime-RL's own at 4,096 tokens; within the budget, 7 blocks, 8 bytes a logit
    rows, width = cl.choose_tiles(4096, 151936, 896, rows=8192, logits=prime_head.TILE_LOGITS)
    assert width == 21760 and min(rows, 4096) * width * 8 <= 0.7 * 2**30 < 0.75 * 2**30
    for tokens in (1024, 4096, 8192, 65536):
        rows, width = cl.choose_tiles(tokens, 151936, 896, rows=8192, logits=prime_head.TILE_LOGITS)
        assert min(rows, tokens) * width <= prime_head.TILE_LOGITS


@pytest.mark.parametrize(("kind", "softcap"), [("VanillaOutputLinear", None), ("GemmaVanillaOutputLinear", 5.0)])
def test_the_vanilla_kinds_give_fp32_logits_capped_in_fp32(heads, kind, softcap):
    model = build(heads, kind, softcap)
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(2)).bfloat16()
    prime_head.install(model, "fp32out")
    logits = model.lm_head(x)["logits"]
    z = x.double() @ model.lm_head.weight.double().t()
    ref = z if softcap is None else softcap * torch.tanh(z / softcap)
    assert logits.dtype == torch.float32 and (logits.double() - ref).abs().max() < 1e-4


def test_install_twice_is_a_no_op_and_another_mode_is_refused(heads):
    model = build(heads, "FusedOutputLinear")
    prime_head.install(model, "fp32out")
    forward = model.lm_head.forward
    prime_head.install(model, "fp32out")
    assert model.lm_head.forward == forward
    with pytest.raises(ValueError, match="already computes in mode 'fp32out'; refusing 'tf32'"):
        prime_head.install(model, "tf32")


def test_what_cannot_agree_is_refused(heads):
    plain = Model(torch.nn.Linear(32, 300, bias=False))
    with pytest.raises(UnsupportedLmHeadError, match="torch.nn.modules.linear.Linear, not one of the heads"):
        prime_head.install(plain, "fp32out")
    adapted = build(heads, "FusedOutputLinear")
    adapted.lm_head.lora_A = torch.nn.Linear(32, 4, bias=False)  # a LoRA-wrapped head's extra module
    with pytest.raises(UnsupportedLmHeadError, match="LoRA-wrapped head"):
        prime_head.install(adapted, "fp32out")
    capped_elsewhere = build(heads, "FusedOutputLinear")
    capped_elsewhere.config.final_logit_softcapping = 30.0
    with pytest.raises(UnsupportedLmHeadError, match="the cap is computed another way"):
        prime_head.install(capped_elsewhere, "fp32out")
    fp32 = build(heads, "FusedOutputLinear")
    fp32.lm_head.float()
    prime_head.install(fp32, "fp32out")
    with pytest.raises(UnsupportedLmHeadError, match="float32 head weight outside a bf16/fp16 autocast"):
        fp32.lm_head(torch.randn(1, 3, 32), torch.zeros(1, 3, dtype=torch.long), temperature=torch.ones(1, 3))


# ---------------------------------------------------------------- the probe


def _report(dtype, **kw):
    return {
        "dtype": dtype,
        "way": "native",
        "host": "n1",
        "pid": 7,
        "prime_rl_patch": True,
        "prime_rl_enabled": True,
        **kw,
    }


def test_the_probe_names_why_a_worker_disagrees():
    assert len(hold([[_report("float32")], [_report("float32")]], True, where="inference server")) == 2
    cases = [
        (
            _report(
                None, reason="compute_logits raised TypeError: mm() got an unexpected keyword argument 'out_dtype'"
            ),
            "out_dtype",
        ),
        (_report("bfloat16", prime_rl_patch=False), "monkey_patch_fp32_lm_head is not installed"),
        (_report("bfloat16", prime_rl_enabled=False), "read additional_config['fp32_lm_head'] as off"),
        (_report("bfloat16"), "another layer computes the logits"),
    ]
    for report, says in cases:
        with pytest.raises(Fp32LmHeadMismatchError) as caught:
            hold([_report("float32"), report], True, where="inference server")
        assert "vLLM worker 1 (host n1, pid 7)" in str(caught.value) and says in str(caught.value)
    with pytest.raises(Fp32LmHeadMismatchError, match="FP32PATCH_VLLM_LM_HEAD='1' in that process"):
        hold([_report("float32", env="1", env_name="FP32PATCH_VLLM_LM_HEAD")], False, where="inference server")


def test_a_worker_report_names_prime_rl_patch_as_the_route_of_its_fp32_logits(monkeypatch):
    from types import SimpleNamespace

    from fp32patch.runtime.heads import vllm_probe
    from fp32patch.runtime.prime_rl import probe

    native = {"dtype": "float32", "way": "native", "reason": "vLLM computes this head in fp32 itself"}
    monkeypatch.setattr(vllm_probe, "probe_vllm_model", lambda model: dict(native))
    worker = SimpleNamespace(model_runner=SimpleNamespace(model=object()))
    for state, way in (((True, True), "prime-rl"), ((True, False), "native"), ((False, None), "native")):
        monkeypatch.setattr(probe, "_prime_rl_state", lambda model, state=state: state)
        report = probe.worker_report(worker)
        assert report["way"] == way, state
        assert ("Prime-RL's own vLLM patch" in report["reason"]) == (way == "prime-rl")


def test_importing_the_runtime_imports_no_torch_vllm_or_prime_rl():
    code = (
        "import sys, fp32patch.runtime.prime_rl\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'vllm', 'prime_rl', 'pydantic')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
