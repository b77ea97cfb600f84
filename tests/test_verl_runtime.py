"""fp32patch.runtime.verl without verl, vLLM or SGLang: the guard on configs shaped like verl's
(plain dicts, an attribute-only model config), the rollout servers' switch (the variable, SGLang's
arguments), the heads on a tiny bf16 causal LM and on Megatron-shaped chunks, and the servers'
check of their vLLM workers' probe reports (the probe itself runs in tests/heavy/vllm)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import subprocess
import sys
from typing import Any

import pytest
import torch

import fp32patch.runtime.verl.config as verl_config
from fp32patch.runtime.hf_lm_head import fp32_lm_head_mode
from fp32patch.runtime.verl import (
    KEY,
    PROBE_RPC,
    VLLM_ENV_VAR,
    Fp32LmHeadConfigError,
    Fp32LmHeadMismatchError,
    VerlSettings,
    check_config,
    check_reports,
    probe_model,
    probe_server,
    set_vllm_env,
    sglang_args,
    validate_fp32_lm_head_config,
    wire_hf,
    wire_megatron,
)
from tests.support import tiny_lm

VAR = "NRL_VLLM_FP32_LM_HEAD"
UNSET = object()


def verl(
    fp32: object = UNSET,
    *,
    rollout: str | None = "vllm",
    strategy: str = "fsdp",
    ref_strategy: str | None = None,
    env_vars: dict[str, Any] | None = None,
    sglang: dict[str, Any] | None = None,
    actor: dict[str, Any] | None = None,
    **model: Any,
) -> dict[str, Any]:
    """A config of verl's shape, as ppo_trainer.yaml and its groups compose it (the parts the guard reads)."""
    model_cfg: dict[str, Any] = {
        "path": "Qwen/Qwen3-0.6B",
        "use_fused_kernels": False,
        "fused_kernel_options": {"impl_backend": None},
        "lora_rank": 0,
        "lora": {},
        **model,
    }
    if fp32 is not UNSET:
        model_cfg["fp32_lm_head"] = fp32
    ray_init: dict[str, Any] = {"num_cpus": None}
    if env_vars is not None:
        ray_init["runtime_env"] = {"env_vars": {"TOKENIZERS_PARALLELISM": "true", **env_vars}}
    return {
        "actor_rollout_ref": {
            "hybrid_engine": True,
            "model": model_cfg,
            "actor": {"strategy": strategy, "ppo_mini_batch_size": 256, **(actor or {})},
            "ref": {"strategy": ref_strategy or strategy},
            "rollout": {
                "name": rollout,
                "mode": "async",
                "tensor_model_parallel_size": 2,
                "engine_kwargs": {"vllm": {}, "sglang": sglang or {}},
            },
        },
        "critic": {"strategy": strategy, "enable": False},
        "trainer": {"n_gpus_per_node": 8, "nnodes": 1},
        "ray_kwargs": {"ray_init": ray_init, "timeline_json_file": None},
    }


@dataclasses.dataclass
class HFModelConfig:
    """An attribute-only stand-in for verl's HFModelConfig, as the servers and engines hold it."""

    path: str = "Qwen/Qwen3-0.6B"
    fp32_lm_head: Any = False
    lora_rank: int = 0


@pytest.fixture(autouse=True)
def _no_variable(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)


@pytest.fixture
def vllm_version(monkeypatch):
    """The installed vLLM's version as the guard reads it (None: not installed)."""

    def set_to(version: tuple[int, ...] | None) -> None:
        monkeypatch.setattr(verl_config, "_installed_vllm", lambda: version)

    set_to((0, 24, 0))
    return set_to


# ---------------------------------------------------------------- the guard: what passes


@pytest.mark.parametrize(
    ("cfg", "environ", "expected"),
    [
        (verl(), {}, VerlSettings(None, "vllm")),
        (verl(False), {}, VerlSettings(None, "vllm")),
        (verl(None, env_vars={VAR: "0"}), {}, VerlSettings(None, "vllm")),
        (verl(False, rollout="sglang", sglang={"enable_fp32_lm_head": False}), {}, VerlSettings(None, "sglang")),
        # the variable means nothing to SGLang, nor SGLang's switch to vLLM
        (verl(rollout="sglang"), {VAR: "1"}, VerlSettings(None, "sglang")),
        (verl(rollout="vllm", sglang={"enable_fp32_lm_head": True}), {}, VerlSettings(None, "vllm")),
        (verl(True), {}, VerlSettings("fp32", "vllm", vllm="1")),
        (verl("fp32out", strategy="fsdp2"), {}, VerlSettings("fp32out", "vllm", vllm="1")),
        (verl("fp32out", strategy="fsdp_turbo"), {}, VerlSettings("fp32out", "vllm", vllm="1")),
        (verl("tf32", strategy="megatron"), {}, VerlSettings("tf32", "vllm", vllm="1")),
        (verl("fp32out-hilo", env_vars={VAR: "copy"}), {}, VerlSettings("fp32out-hilo", "vllm", vllm="copy")),
        (verl("fp32out", env_vars={VAR: "fp32out"}), {}, VerlSettings("fp32out", "vllm", vllm="fp32out")),
        (verl("fp32out", env_vars={VAR: "1"}), {}, VerlSettings("fp32out", "vllm", vllm="1")),
        # YAML may give the variable as a number
        (verl("fp32out", env_vars={VAR: 1}), {}, VerlSettings("fp32out", "vllm", vllm="1")),
        (verl("fp32out"), {VAR: "copy"}, VerlSettings("fp32out", "vllm", vllm="copy")),
        (verl("fp32out-bf16grad", rollout="sglang"), {}, VerlSettings("fp32out-bf16grad", "sglang", sglang=True)),
        (
            verl("fp32out", rollout="sglang", sglang={"enable_fp32_lm_head": True}),
            {},
            VerlSettings("fp32out", "sglang", sglang=True),
        ),
        (verl("fp32out", lora_rank=32, lora={"merge": True}), {}, VerlSettings("fp32out", "vllm", vllm="1")),
        (verl("fp32out", lora={"rank": 16, "merge": True}), {}, VerlSettings("fp32out", "vllm", vllm="1")),
        # LoRA on SGLang: SGLang's own switch covers its LoRA path
        (verl("fp32out", rollout="sglang", lora_rank=32), {}, VerlSettings("fp32out", "sglang", sglang=True)),
    ],
)
def test_valid_configs_and_what_they_ask_for(cfg, environ, expected, vllm_version):
    assert validate_fp32_lm_head_config(cfg, environ=environ) == expected


@pytest.mark.parametrize("backend", ["torch", "liger", "triton"])
@pytest.mark.parametrize("where", ["model", "actor"])
def test_fused_kernels_on_fsdp_are_accepted_and_computed_by_fp32patch(backend, where):
    fused = {"use_fused_kernels": True, "fused_kernel_options": {"impl_backend": backend}}
    cfg = (
        verl("fp32out", **fused)
        if where == "model"
        else verl("fp32out", actor={"use_fused_kernels": True}, fused_kernel_options={"impl_backend": backend})
    )
    settings = validate_fp32_lm_head_config(cfg, environ={})
    assert (settings.mode, settings.fused, settings.vllm) == ("fp32out", backend, "1")
    [note] = settings.notes
    assert f"use_fused_kernels ({backend})" in note and "fp32patch's chunked fp32 log-probs in mode 'fp32out'" in note
    assert ("does not run" in note) == (backend != "torch")


def test_megatron_fused_kernels_are_verls_triton_kernel_and_the_note_says_what_it_computes():
    cfg = verl("fp32out", strategy="megatron", use_fused_kernels=True, fused_kernel_options={"impl_backend": "torch"})
    settings = validate_fp32_lm_head_config(cfg, environ={})
    assert settings.fused == "triton"
    [note] = settings.notes
    assert "fused triton kernel" in note and "'fp32out' does not apply there" in note
    assert "rounds the gradient with respect to the logits to bf16" in note and "9504" in note
    assert "use_fused_kernels to false" in note


def test_a_backend_verl_does_not_fuse_leaves_the_head_to_compute():
    cfg = verl("fp32out", use_fused_kernels=True, fused_kernel_options={"impl_backend": "cuda"})
    [note] = validate_fp32_lm_head_config(cfg, environ={}).notes
    assert "'cuda', which verl does not fuse" in note


def test_the_notes_are_not_part_of_equality():
    assert VerlSettings("fp32out", "vllm", vllm="1", notes=("a",)) == VerlSettings("fp32out", "vllm", vllm="1")


def test_the_guard_reads_but_never_changes_the_config():
    cfg = verl("fp32out", env_vars={VAR: "copy"})
    before = repr(cfg)
    validate_fp32_lm_head_config(cfg, environ={})
    assert repr(cfg) == before


# ---------------------------------------------------------------- the guard: what is refused


SGLANG_KEY = "actor_rollout_ref.rollout.engine_kwargs.sglang.enable_fp32_lm_head"
RUNTIME_ENV = f"ray_kwargs.ray_init.runtime_env.env_vars.{VAR}"


@pytest.mark.parametrize(
    ("cfg", "environ", "fragments"),
    [
        # one side alone: vLLM's variable or SGLang's switch without the key
        (
            verl(env_vars={VAR: "1"}),
            {},
            [f'{RUNTIME_ENV} is "1" but {KEY} is off', "measured", f"Set {KEY} (e.g. fp32out)", f"remove {VAR}"],
        ),
        (verl(False, env_vars={VAR: "copy"}), {}, [f'{RUNTIME_ENV} is "copy" but {KEY} is off']),
        (verl(), {VAR: "fp32out"}, [f'the environment variable {VAR} is "fp32out" but {KEY} is off']),
        (
            verl(rollout="sglang", sglang={"enable_fp32_lm_head": True}),
            {},
            [f"{SGLANG_KEY} is true but {KEY} is off", "measured", "remove enable_fp32_lm_head"],
        ),
        # a trainer fp32patch does not wire
        *(
            (
                verl("fp32out", strategy=strategy),
                {},
                [f"actor_rollout_ref.actor.strategy is {strategy!r}", "fsdp, fsdp2, fsdp_turbo, megatron", "bf16"],
            )
            for strategy in ("veomni", "torchtitan", "automodel")
        ),
        (verl("fp32out", ref_strategy="veomni"), {}, ["actor_rollout_ref.ref.strategy is 'veomni'"]),
        # a rollout without an fp32 head
        *(
            (
                verl("fp32out", rollout=name),
                {},
                [f"actor_rollout_ref.rollout.name is {name!r}", "vLLM and SGLang rollouts only", "vllm or sglang"],
            )
            for name in ("trtllm", "hf", None)
        ),
        # the variable or SGLang's switch contradicting the key
        (
            verl("fp32out", env_vars={VAR: "0"}),
            {},
            [f"{KEY} is 'fp32out' but {RUNTIME_ENV} is \"0\"", "disagree", f"Remove {VAR}"],
        ),
        (verl(True), {VAR: "0"}, [f"{KEY} is 'fp32' but the environment variable {VAR} is \"0\""]),
        (
            verl("fp32out", rollout="sglang", sglang={"enable_fp32_lm_head": False}),
            {},
            [f"{KEY} is 'fp32out' but {SGLANG_KEY} is False", "disagree", "Remove enable_fp32_lm_head"],
        ),
        # values that are not valid, with a hint where one helps
        (verl("false"), {}, [f"{KEY} = 'false' is not valid", "a quoted string is not a boolean", '"fp32out"']),
        (verl("True"), {}, ["a quoted string is not a boolean"]),
        (verl("FP32OUT"), {}, [f"{KEY} = 'FP32OUT' is not valid", 'did you mean "fp32out"', "lower case"]),
        (verl(1), {}, [f"{KEY} = 1 is not valid", "false, true,"]),
        (verl("bf16"), {}, [f"{KEY} = 'bf16' is not valid"]),
        (verl("fp32out", env_vars={VAR: "yes"}), {}, [f"{RUNTIME_ENV} = 'yes' is not valid", '"0", "1"']),
        (verl(env_vars={VAR: True}), {}, [f"{RUNTIME_ENV} = True is not valid"]),
        (verl("fp32out"), {VAR: "on"}, [f"the environment variable {VAR} = 'on' is not valid"]),
    ],
)
def test_refusals_name_the_key_the_value_and_what_to_do(cfg, environ, fragments, vllm_version):
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        validate_fp32_lm_head_config(cfg, environ=environ)
    for fragment in fragments:
        assert fragment in str(caught.value), (fragment, str(caught.value))


def test_sections_that_are_not_mappings_and_a_config_that_is_none_are_refused():
    with pytest.raises(Fp32LmHeadConfigError, match="expected verl's config as a mapping"):
        validate_fp32_lm_head_config(None)
    cfg = verl("fp32out")
    cfg["actor_rollout_ref"]["rollout"] = "vllm"
    with pytest.raises(Fp32LmHeadConfigError, match=r"actor_rollout_ref\.rollout must be a mapping, not str"):
        validate_fp32_lm_head_config(cfg, environ={})


@pytest.mark.parametrize(
    ("lora", "installed", "refused"),
    [
        ({"lora_rank": 32}, (0, 24, 0), True),
        ({"lora": {"rank": 8}}, (0, 12, 0), True),
        ({"lora": {"rank": 8, "merge": False}}, (0, 25, 1), True),
        ({"lora_rank": 32}, None, True),
        ({"lora_rank": 32}, (0, 26, 0), False),
        ({"lora": {"rank": 8}}, (0, 33, 0), False),
        ({"lora_rank": 32, "lora": {"merge": True}}, (0, 24, 0), False),
        ({"lora_rank": 0, "lora": {"rank": 0}}, (0, 24, 0), False),
    ],
)
def test_a_lora_adapter_on_vllm_is_refused_where_vllm_keeps_its_bf16_lora_head(lora, installed, refused, vllm_version):
    vllm_version(installed)
    cfg = verl("fp32out", **lora)
    if not refused:
        assert validate_fp32_lm_head_config(cfg, environ={}).vllm == "1"
        return
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        validate_fp32_lm_head_config(cfg, environ={})
    said = str(caught.value)
    assert "LoRA adapter on the vLLM rollout" in said and "actor_rollout_ref.model.lora.merge: true" in said
    shown = "not installed here (verl pins <=0.24)" if installed is None else ".".join(map(str, installed))
    assert f"(vLLM {shown})" in said


def test_the_variable_in_the_runtime_env_wins_over_the_drivers(monkeypatch):
    # verl hands ray_kwargs.ray_init.runtime_env to its Ray workers: that is what they see
    cfg = verl("fp32out", env_vars={VAR: "copy"})
    assert validate_fp32_lm_head_config(cfg, environ={VAR: "0"}).vllm == "copy"
    # the driver's own environment counts where the runtime env is silent, os.environ by default
    monkeypatch.setenv(VAR, "0")
    with pytest.raises(Fp32LmHeadConfigError, match=f'the environment variable {VAR} is "0"'):
        validate_fp32_lm_head_config(verl("fp32out"))


# ---------------------------------------------------------------- check_config: what verl's validate_config calls


@pytest.fixture
def log_lines(caplog):
    caplog.set_level(logging.INFO, logger="verl.fp32patch")
    return lambda: [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "verl.fp32patch"]


def test_check_config_names_where_it_ran(log_lines):
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        check_config(verl("fp32out", rollout="trtllm"), where="validate_config", environ={})
    assert str(caught.value).startswith("fp32patch (validate_config): actor_rollout_ref.model.fp32_lm_head is ")
    assert log_lines() == []


def test_check_config_logs_what_runs_and_the_notes(log_lines):
    cfg = verl("fp32out", use_fused_kernels=True, fused_kernel_options={"impl_backend": "triton"})
    settings = check_config(cfg, environ={})
    assert settings.fused == "triton"
    lines = log_lines()
    assert [level for level, _ in lines] == ["WARNING", "INFO"]
    assert lines[0][1].startswith("fp32patch (validate_config): use_fused_kernels (triton): the log-probs")
    assert lines[1][1] == (
        f"fp32patch (validate_config): fp32 LM head 'fp32out' on the actor and the ref; {VAR}=1 in every vLLM "
        "rollout process"
    )
    check_config(verl("tf32", rollout="sglang"), environ={})
    assert log_lines()[-1][1].endswith(
        "'tf32' on the actor and the ref; SGLang's enable_fp32_lm_head in every rollout server"
    )


def test_check_config_with_the_key_off_logs_nothing(log_lines):
    assert check_config(verl(False), environ={}) == VerlSettings(None, "vllm")
    assert log_lines() == []


# ---------------------------------------------------------------- the vLLM rollout server's variable


@pytest.mark.parametrize("model", [{"fp32_lm_head": "fp32out"}, HFModelConfig(fp32_lm_head="fp32out")])
def test_the_key_sets_the_variable_before_the_engine_starts(model):
    environ: dict[str, str] = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert set_vllm_env(model, where="vLLM rollout server", environ=environ) == "1"
    assert environ == {"CUDA_VISIBLE_DEVICES": "0,1", VAR: "1"}


@pytest.mark.parametrize("way", ["1", "copy", "fp32out"])
def test_a_variable_that_names_the_way_is_kept(way):
    environ = {VAR: way}
    assert set_vllm_env({"fp32_lm_head": True}, where="server", environ=environ) == way
    assert environ == {VAR: way}


@pytest.mark.parametrize(("current", "expected"), [(None, None), ("0", "0")])
def test_the_key_off_leaves_an_off_variable_alone(current, expected):
    environ = {} if current is None else {VAR: current}
    assert set_vllm_env({"fp32_lm_head": False}, where="server", environ=environ) == expected
    assert environ == ({} if current is None else {VAR: current})


@pytest.mark.parametrize(
    ("model", "environ", "fragments"),
    [
        ({"fp32_lm_head": "fp32out"}, {VAR: "0"}, ["fp32patch (vLLM rollout server): ", "is 'fp32out' but", '="0"']),
        ({"fp32_lm_head": False}, {VAR: "1"}, ['NRL_VLLM_FP32_LM_HEAD="1" in this process but', "is off"]),
        (HFModelConfig(), {VAR: "copy"}, ['="copy" in this process but', f"Set {KEY} instead"]),
        ({"fp32_lm_head": "fp32out"}, {VAR: "yes"}, [f"{VAR}='yes' is not valid", "valid values"]),
        ({"fp32_lm_head": "FP32"}, {}, [f"{KEY} = 'FP32' is not valid", 'did you mean "fp32"']),
    ],
)
def test_the_server_refuses_a_contradicting_or_one_sided_variable(model, environ, fragments):
    before = dict(environ)
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        set_vllm_env(model, where="vLLM rollout server", environ=environ)
    assert str(caught.value).startswith("fp32patch (vLLM rollout server): ")
    for fragment in fragments:
        assert fragment in str(caught.value), (fragment, str(caught.value))
    assert environ == before


def test_set_vllm_env_writes_this_process_environment_by_default(monkeypatch):
    assert set_vllm_env({"fp32_lm_head": "tf32"}, where="server") == "1"
    import os

    assert os.environ[VAR] == "1"


# ---------------------------------------------------------------- SGLang's own switch


@dataclasses.dataclass
class NewServerArgs:
    """SGLang 0.5.3 and later: ServerArgs has enable_fp32_lm_head."""

    model_path: str
    tp_size: int = 1
    enable_fp32_lm_head: bool = False


@dataclasses.dataclass
class OldServerArgs:
    model_path: str
    tp_size: int = 1


def test_sglang_gets_its_own_switch_from_the_key():
    args = {"model_path": "/models/qwen", "tp_size": 2}
    out = sglang_args(args, HFModelConfig(fp32_lm_head="fp32out"), NewServerArgs, where="SGLang rollout server")
    assert out is args and args == {"model_path": "/models/qwen", "tp_size": 2, "enable_fp32_lm_head": True}
    assert NewServerArgs(**out).enable_fp32_lm_head is True
    # already on in engine_kwargs.sglang: the same
    args = {"model_path": "/m", "enable_fp32_lm_head": True}
    assert sglang_args(args, {"fp32_lm_head": True}, NewServerArgs, where="s")["enable_fp32_lm_head"] is True


def test_sglang_with_the_key_off_is_left_alone():
    for args in ({"model_path": "/m"}, {"model_path": "/m", "enable_fp32_lm_head": False}):
        copy = dict(args)
        assert sglang_args(args, HFModelConfig(), OldServerArgs, where="s") is args
        assert args == copy


@pytest.mark.parametrize(
    ("model", "args", "cls", "fragments"),
    [
        ({"fp32_lm_head": "fp32out"}, {"model_path": "/m"}, OldServerArgs, ["has no enable_fp32_lm_head", "0.5.3"]),
        (
            {"fp32_lm_head": "fp32out"},
            {"model_path": "/m", "enable_fp32_lm_head": False},
            NewServerArgs,
            ["SGLang's enable_fp32_lm_head is False", "disagree"],
        ),
        (
            {"fp32_lm_head": False},
            {"model_path": "/m", "enable_fp32_lm_head": True},
            NewServerArgs,
            ["enable_fp32_lm_head is on in SGLang's arguments but", "is off"],
        ),
    ],
)
def test_sglang_refusals(model, args, cls, fragments):
    before = dict(args)
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        sglang_args(args, model, cls, where="SGLang rollout server")
    assert str(caught.value).startswith("fp32patch (SGLang rollout server): ")
    for fragment in fragments:
        assert fragment in str(caught.value), (fragment, str(caught.value))
    assert args == before


def test_a_server_args_class_that_is_no_dataclass_is_read_by_its_attributes():
    class ServerArgs:
        model_path = ""
        enable_fp32_lm_head = False

    assert sglang_args({}, {"fp32_lm_head": True}, ServerArgs, where="s") == {"enable_fp32_lm_head": True}


# ---------------------------------------------------------------- the trainer's heads

T, H, V = 6, 16, 40


class CausalLM(tiny_lm.CausalLM):
    """A Hugging Face-shaped causal LM in bf16 (tests/support/tiny_lm.py), at this module's sizes."""

    def __init__(self) -> None:
        super().__init__(H, V)


class CriticModel(torch.nn.Module):
    """A value model: a one-column ``score`` head, no LM head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(H, H, dtype=torch.bfloat16)
        self.score = torch.nn.Linear(H, 1, dtype=torch.bfloat16)

    def get_output_embeddings(self):
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.score(self.body(x))


IDS = torch.arange(T).reshape(1, T) % V


@pytest.mark.parametrize("role", ["actor", "ref"])
@pytest.mark.parametrize("model_config", [{"fp32_lm_head": "fp32out"}, HFModelConfig(fp32_lm_head="fp32out")])
def test_wire_hf_gives_the_actor_and_the_ref_fp32_logits(role, model_config):
    model = CausalLM()
    stock = model(IDS)
    assert stock.dtype == torch.bfloat16
    assert wire_hf(model, model_config, role=role) is model
    assert fp32_lm_head_mode(model) == "fp32out"
    logits = model(IDS)
    assert logits.dtype == torch.float32 and logits.shape == (1, T, V)
    hidden = model.hidden(IDS)
    expected = hidden.double() @ model.lm_head.weight.double().t()
    assert torch.allclose(logits.double(), expected, rtol=1e-6, atol=1e-6)
    # the stock head's logits are these, rounded to bf16
    assert torch.equal(logits.bfloat16(), stock) or (logits.bfloat16().float() - stock.float()).abs().max() <= 0.0625
    logits.sum().backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.dtype == torch.bfloat16


def test_wire_hf_with_the_key_off_leaves_the_model_alone():
    for off in (False, None, {"path": "m"}):
        model = CausalLM()
        config = off if isinstance(off, dict) else {"fp32_lm_head": off}
        assert wire_hf(model, config, role="actor") is model
        assert fp32_lm_head_mode(model) is None and model(IDS).dtype == torch.bfloat16


def test_the_critic_keeps_its_value_head(log_lines):
    critic = CriticModel()
    assert wire_hf(critic, {"fp32_lm_head": "fp32out"}, role="critic") is critic
    assert critic(torch.zeros(2, H, dtype=torch.bfloat16)).dtype == torch.bfloat16
    assert log_lines() == [
        ("INFO", f"fp32patch: the critic keeps its value head ({KEY}='fp32out' applies to LM heads)")
    ]


def test_wire_hf_refuses_a_bad_value_naming_the_role():
    with pytest.raises(
        Fp32LmHeadConfigError, match=r"^fp32patch \(ref\): actor_rollout_ref\.model\.fp32_lm_head = 'yes'"
    ):
        wire_hf(CausalLM(), {"fp32_lm_head": "yes"}, role="ref")


class ColumnParallelLinear(torch.nn.Module):
    """Calls ``_forward_impl`` the way megatron-core's class of that name does at TP=1."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(V, H).bfloat16())
        self.config = type("Config", (), {"defer_embedding_wgrad_compute": False})()
        self.gtp_remat_size = 1

    def _forward_impl(self, input, weight, *args, **kwargs):
        return input @ weight.t()

    def forward(self, x):
        kwargs = dict(gradient_accumulation_fusion=False, allreduce_dgrad=False, sequence_parallel=False)
        kwargs |= dict(grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, gtp_remat_size=1)
        return self._forward_impl(input=x, weight=self.weight, bias=None, **kwargs), None


class Chunk(torch.nn.Module):
    """A GPT model chunk: ``post_process`` and, on the last pipeline stage, ``output_layer``."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.post_process = last
        if last:
            self.output_layer = ColumnParallelLinear()


def test_wire_megatron_gives_the_last_stage_fp32_logits(log_lines):
    from fp32patch.runtime.megatron_lm_head import fp32_lm_head_mode as megatron_mode

    chunks = [Chunk(last=False), Chunk(last=True)]
    assert wire_megatron(chunks, {"fp32_lm_head": "fp32out"}, role="actor") is chunks
    assert megatron_mode(chunks[1].output_layer) == "fp32out"
    logits, _ = chunks[1].output_layer(torch.randn(3, H).bfloat16())
    assert logits.dtype == torch.float32
    assert log_lines()[-1] == (
        "INFO",
        "fp32patch: the actor's Megatron output layer gives fp32 logits (mode 'fp32out'): 1 of 2 chunk(s) hold the head",
    )


def test_wire_megatron_leaves_the_critic_and_a_key_off_alone():
    from fp32patch.runtime.megatron_lm_head import fp32_lm_head_mode as megatron_mode

    chunks = [Chunk(last=True)]
    assert wire_megatron(chunks, {"fp32_lm_head": "fp32out"}, role="critic") is chunks
    assert wire_megatron(chunks, HFModelConfig(), role="actor") is chunks
    assert megatron_mode(chunks[0].output_layer) is None
    logits, _ = chunks[0].output_layer(torch.randn(3, H).bfloat16())
    assert logits.dtype == torch.bfloat16


# ---------------------------------------------------------------- the servers' probe of their vLLM workers


def report(dtype="float32", way="fp32out", env="1", patched=True, reason="fp32 logits by fp32out", pid=4242):
    return {
        "dtype": dtype,
        "way": way,
        "reason": reason,
        "env": env,
        "pid": pid,
        "host": "node-2",
        "patched": patched,
        "model": "Qwen3ForCausalLM",
    }


ON, OFF = {"fp32_lm_head": "fp32out"}, {"fp32_lm_head": False}
ASKED = f"{KEY}='fp32out'"  # what asked for the rollout's logits, as the kit's verdicts name it


def test_every_worker_fp32_agrees_and_one_line_says_so(log_lines):
    check_reports([[report(), report(way="copy", pid=1)], [report(pid=2)]], ON, where="vLLM rollout server")
    assert log_lines() == [
        (
            "INFO",
            "fp32patch (vLLM rollout server): 3 vLLM worker(s) compute float32 logits (way: copy, fp32out), as "
            f"{KEY}='fp32out' asks",
        )
    ]


def test_every_worker_stock_agrees_with_the_key_off(log_lines):
    check_reports([report("bfloat16", "off", None, reason="unset")], OFF, where="server")
    assert log_lines()[-1][1].endswith(f"1 vLLM worker(s) compute stock logits (way: off), as {KEY}=None asks")


@pytest.mark.parametrize(
    ("model", "bad", "reason"),
    [
        (
            ON,
            report("bfloat16", "off", None),
            f"computes bfloat16 logits while {ASKED}: {VAR} is unset in that process",
        ),
        (ON, report("bfloat16", "off", "0"), f"computes bfloat16 logits while {ASKED}: {VAR} is '0' in that process"),
        (
            ON,
            report("bfloat16", "stock", "1", patched=False, reason="no fp32patch route"),
            f"computes bfloat16 logits while {ASKED}: the model file is not patched (run fp32patch apply in that venv)",
        ),
        (
            ON,
            report("bfloat16", "stock", "1", reason="the head is quantized"),
            f"computes bfloat16 logits while {ASKED}: the way is stock: the head is quantized",
        ),
        (
            ON,
            report(None, "stock", "1", reason="compute_logits raised"),
            f"computes no logits while {ASKED}: compute_logits raised",
        ),
        (
            OFF,
            report(),
            f"computes float32 logits while {KEY} is off: {VAR}='1' in that process (unset it, or turn {KEY} on)",
        ),
    ],
)
def test_each_disagreeing_worker_is_named_with_why(model, bad, reason):
    good = report() if model is ON else report("bfloat16", "off", None)
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        check_reports([good, bad, good], model, where="vLLM rollout server")
    said = str(caught.value)
    assert said.startswith(f"fp32patch (vLLM rollout server): the rollout's logits do not follow {KEY}=")
    assert f"vLLM worker 1 (host node-2, pid 4242) {reason}" in said
    assert "vLLM worker 0" not in said and "vLLM worker 2" not in said
    assert [index for index, _, _ in caught.value.disagreements] == [1]


def test_no_report_or_a_worker_without_one_is_a_mismatch():
    with pytest.raises(Fp32LmHeadMismatchError, match="no vLLM worker returned an LM-head probe report"):
        check_reports([], ON, where="server")
    with pytest.raises(Fp32LmHeadMismatchError, match="vLLM worker 1 returned no LM-head probe report"):
        check_reports([report(), None], ON, where="server")
    assert issubclass(Fp32LmHeadMismatchError, RuntimeError)


class AsyncEngine:
    """vLLM's AsyncLLM as the server holds it: an async collective_rpc over every worker."""

    def __init__(self, reports: list[Any]) -> None:
        self.reports, self.calls = reports, []

    async def collective_rpc(self, method: str, timeout: float | None = None, args=(), kwargs=None):
        self.calls.append(method)
        return self.reports


class SyncEngine(AsyncEngine):
    def collective_rpc(self, method: str, timeout: float | None = None, args=(), kwargs=None):
        self.calls.append(method)
        return self.reports


@pytest.mark.parametrize("engine_class", [AsyncEngine, SyncEngine])
def test_probe_server_asks_every_worker_through_the_engine(engine_class):
    engine = engine_class([report(), report(way="copy")])
    reports = asyncio.run(probe_server(engine, HFModelConfig(fp32_lm_head=True), where="vLLM rollout server"))
    assert engine.calls == [PROBE_RPC] == ["fp32patch_probe_lm_head"]
    assert reports == engine.reports
    bad = engine_class([report(), report("bfloat16", "off", None)])
    with pytest.raises(Fp32LmHeadMismatchError, match="vLLM worker 1"):
        asyncio.run(probe_server(bad, HFModelConfig(fp32_lm_head=True), where="vLLM rollout server"))


def test_probe_model_holds_an_in_process_model_to_the_key(monkeypatch):
    """verl 0.6.1 and 0.7.0: vLLM's model in the trainer's worker, probed in place."""
    import fp32patch.runtime.vllm_probe as vllm_probe

    model = object()
    measured: list[object] = []
    answers = iter([report(), report("bfloat16", "off", None)])
    monkeypatch.setattr(vllm_probe, "probe_vllm_model", lambda m: measured.append(m) or next(answers))
    assert probe_model(model, ON, where="vLLM rollout worker")["dtype"] == "float32"
    with pytest.raises(Fp32LmHeadMismatchError, match=r"^fp32patch \(vLLM rollout worker\)"):
        probe_model(model, ON, where="vLLM rollout worker")
    assert measured == [model, model]


# ---------------------------------------------------------------- the module


def test_the_public_names():
    assert KEY == "actor_rollout_ref.model.fp32_lm_head"
    assert VLLM_ENV_VAR == VAR
    assert issubclass(Fp32LmHeadConfigError, ValueError)


def test_importing_the_module_imports_no_torch_vllm_or_verl():
    code = (
        "import sys, fp32patch.runtime.verl as m\n"
        "heavy = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'vllm', 'verl', 'sglang', 'megatron'))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---------------------------------------------------------------- the gate in verl's patched files and the runtime


def _gate_namespace() -> dict[str, Any]:
    import fp32patch

    snippet = fp32patch.__file__.replace("__init__.py", "patches/snippets/verl_gate.py")
    namespace: dict[str, Any] = {}
    exec(compile(open(snippet).read(), snippet, "exec"), namespace)  # noqa: S102
    return namespace


@pytest.mark.parametrize(
    "value", [False, None, "", "  ", True, "fp32", "fp32out", "tf32", "false", "False", "0", 0, 1, "FP32OUT", "yes"]
)
def test_what_the_gate_lets_through_the_runtime_runs_or_refuses(value):
    """A value the gate takes as off runs the stock code without fp32patch; any other reaches the
    runtime, which runs a mode or refuses it: never a silent off after fp32patch was asked."""
    asked = _gate_namespace()["_fp32patch_asked"]
    for model in ({"fp32_lm_head": value}, HFModelConfig(fp32_lm_head=value)):
        if not asked(model):
            assert value in (False, None) or str(value).strip() == ""
            continue
        try:
            mode = verl_config.model_mode(model)
        except Fp32LmHeadConfigError:
            continue
        assert mode in ("fp32", "tf32", "fp32out")


# ---------------------------------------------------------------- the fused kernels' runtime


def test_fused_logprobs_runs_only_for_a_wired_heads_weight_and_refuses_what_it_does_not_compute():
    import torch

    from fp32patch.runtime.verl import fused_logprobs, wire_hf

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = torch.nn.Linear(8, 20, bias=False, dtype=torch.bfloat16)

        def get_output_embeddings(self):
            return self.lm_head

    hidden, ids = torch.randn(2, 5, 8).bfloat16(), torch.randint(0, 20, (2, 5))
    assert fused_logprobs(hidden, LM().lm_head.weight, ids, 0.7, backend="torch") is None
    model = wire_hf(LM(), {"fp32_lm_head": "fp32out-bf16grad"}, role="actor")
    log_probs, entropy = fused_logprobs(hidden, model.lm_head.weight, ids, 0.7, backend="torch")
    logp = torch.log_softmax(hidden.double() @ model.lm_head.weight.double().t() / 0.7, dim=-1)
    assert (log_probs.double() - logp.gather(-1, ids[..., None])[..., 0]).abs().max() < 1e-5
    assert (entropy.double() + (logp.exp() * logp).sum(-1)).abs().max() < 1e-5
    with pytest.raises(NotImplementedError, match="reduction='sum'"):
        fused_logprobs(hidden, model.lm_head.weight, ids, 0.7, backend="triton", reduction="sum")


# ---------------------------------------------------------------- SGLang's hazards and probe (kit.sglang)


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        (
            verl("fp32out", rollout="sglang", sglang={"rl_on_policy_target": "fsdp"}),
            ["engine_kwargs.sglang does not follow", "rl_on_policy_target='fsdp'", "Unset rl_on_policy_target"],
        ),
        (
            verl("fp32out", rollout="sglang", sglang={"lora_target_modules": ["lm_head"]}),
            ["lora_target_modules holds lm_head"],
        ),
        (
            verl(False, rollout="sglang", sglang={"json_model_override_args": {"enable_lm_head_fp32": True}}),
            ["json_model_override_args enable_lm_head_fp32=True", f"turn {KEY} on"],
        ),
    ],
)
def test_sglang_hazards_in_engine_kwargs_are_refused_by_the_guard(config, fragments):
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        check_config(config, where="validate_config", environ={})
    for fragment in fragments:
        assert fragment in str(caught.value), (fragment, str(caught.value))


def test_sglang_quantization_is_a_note_for_the_probe():
    settings = validate_fp32_lm_head_config(
        verl("fp32out", rollout="sglang", sglang={"quantization": "fp8"}), environ={}
    )
    assert settings.sglang is True and any("quantization='fp8'" in n for n in settings.notes)


class _TokenizerManager:
    """verl's SGLangHttpServer's in-process TokenizerManager, as the probe uses it."""

    def __init__(self, server_args, output):
        self.server_args, self.output, self.requests = server_args, output, []

    def generate_request(self, request, _):
        self.requests.append(request)

        async def answer():
            yield self.output

        return answer()


def _answer(logits: torch.Tensor) -> dict:
    top = torch.log_softmax(logits.float(), dim=-1).topk(20, dim=-1)
    rows = [
        [[v, i, None] for v, i in zip(vals, ids, strict=True)]
        for vals, ids in zip(top.values.tolist(), top.indices.tolist(), strict=True)
    ]
    return {"meta_info": {"input_top_logprobs": [None, *rows[1:]], "output_top_logprobs": rows[:1]}}


def test_the_sglang_rollout_server_is_probed_in_process(monkeypatch):
    from types import ModuleType, SimpleNamespace

    from fp32patch.runtime.verl import probe_sglang

    io_struct = ModuleType("sglang.srt.managers.io_struct")
    io_struct.GenerateReqInput = lambda **kw: SimpleNamespace(**kw)  # SGLang's request, by its fields
    for name in ("sglang", "sglang.srt", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", io_struct)
    gen = torch.Generator().manual_seed(0)
    h, w = torch.randn(12, 128, generator=gen).bfloat16(), (torch.randn(500, 128, generator=gen) * 0.3).bfloat16()
    fp32, bf16 = h.float() @ w.float().T, (h @ w.T).float()
    args = SimpleNamespace(host="10.0.0.7", port=30000, enable_fp32_lm_head=True, rl_on_policy_target=None)
    model = {"fp32_lm_head": "fp32out"}

    manager = _TokenizerManager(args, _answer(fp32))
    report = asyncio.run(probe_sglang(manager, model, where="SGLang rollout server"))
    assert (report["dtype"], report["measured"], report["server"]) == ("float32", "float32", "10.0.0.7:30000")
    assert manager.requests[0].return_logprob is True and manager.requests[0].logprob_start_len == 0

    for server_args, logits in ((args, bf16), (SimpleNamespace(**{**vars(args), "enable_fp32_lm_head": False}), fp32)):
        with pytest.raises(Fp32LmHeadMismatchError, match=r"SGLang server 10\.0\.0\.7:30000"):
            asyncio.run(probe_sglang(_TokenizerManager(server_args, _answer(logits)), model, where="s"))
