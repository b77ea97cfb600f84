"""AReaL's guard, server arguments and startup probe (fp32patch.runtime.areal), on configs of the
shape AReaL's ``load_expr_config`` returns (its dataclasses: ``actor``/``ref`` TrainEngineConfigs
with ``fsdp``/``megatron``/``archon`` sections and a ``backend`` string, ``rollout`` with its
scheduling specs, ``sglang``), and against the HTTP surface of the servers the controller started
(named stand-ins: SGLang 0.5.15's ``/server_info`` and ``/generate``, AReaL's patched vLLM server's
``/fp32patch_probe_lm_head``)."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field
from typing import Any

import pytest

from fp32patch.runtime import areal
from fp32patch.runtime.areal import wiring
from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from tests.fixtures.slime_shapes import Answer, ServerArgs, sglang_http


@dataclass
class Section:
    enable_fp32_lm_head: bool = False
    enable_chunked_logits: bool = False


@dataclass
class Engine:
    backend: str = "fsdp:d2"
    dtype: str = "bfloat16"
    is_critic: bool = False
    experiment_name: str = "exp"
    trial_name: str = "t0"
    fsdp: Section = field(default_factory=Section)
    megatron: Section = field(default_factory=Section)
    archon: Section = field(default_factory=Section)


@dataclass
class Spec:
    env_vars: dict = field(default_factory=dict)


@dataclass
class Rollout:
    backend: str = "sglang:d2"
    scheduling_spec: list = field(default_factory=lambda: [Spec()])


@dataclass
class SGLang:
    model_path: str = "/models/qwen"
    dtype: str = "bfloat16"
    enable_lora: bool | None = None


@dataclass
class Experiment:
    actor: Engine = field(default_factory=Engine)
    ref: Engine | None = field(default_factory=Engine)
    critic: Engine | None = None
    rollout: Rollout = field(default_factory=Rollout)
    sglang: SGLang = field(default_factory=SGLang)
    teacher: Any = None


def experiment(trainer: str = "fsdp", rollout: str = "sglang", **actor: Any) -> Experiment:
    config = Experiment(
        actor=Engine(backend=f"{trainer}:d2", **actor),
        ref=Engine(backend=f"{trainer}:d2"),
        rollout=Rollout(f"{rollout}:d2"),
    )
    getattr(config.actor, trainer if trainer in ("fsdp", "megatron", "archon") else "fsdp").enable_fp32_lm_head = True
    return config


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD", "AREAL_SPMD_MODE", "SGLANG_DSPARK_FP32_LM_HEAD"):
        monkeypatch.delenv(name, raising=False)


# ---------------------------------------------------------------- the guard


@pytest.mark.parametrize("trainer", ["fsdp", "megatron"])
@pytest.mark.parametrize("rollout", ["sglang", "vllm"])
def test_one_key_turns_both_sides_on(trainer, rollout, monkeypatch):
    monkeypatch.setattr(wiring.rollout, "installed_vllm_version", lambda: (0, 19, 1))
    config = experiment(trainer, rollout)
    settings = areal.check_config(config, environ={})
    assert (settings.mode, settings.trainer, settings.rollout) == ("fp32out", trainer, rollout)
    assert settings.key == f"actor.{trainer}.enable_fp32_lm_head"
    # the reference model follows the actor
    assert getattr(config.ref, trainer).enable_fp32_lm_head is True
    # vLLM 0.19 (AReaL's pin): fp32patch's variable reaches the rollout workers' environment
    expected = {"NRL_VLLM_FP32_LM_HEAD": "1"} if rollout == "vllm" else {}
    assert config.rollout.scheduling_spec[0].env_vars == expected


def test_off_is_off_and_changes_nothing():
    config = Experiment()
    assert areal.check_config(config, environ={}).mode is None
    assert config == Experiment()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda c: setattr(c.actor, "backend", "archon:d2"), "Archon"),
        (
            lambda c: setattr(c.actor.megatron, "enable_fp32_lm_head", True),
            "actor.megatron.enable_fp32_lm_head is true",
        ),
        (lambda c: setattr(c.actor, "dtype", "float32"), "actor.dtype is 'float32'"),
        (lambda c: setattr(c.ref, "backend", "archon:d1"), "reference model's backend is 'archon'"),
        (lambda c: setattr(c.rollout, "backend", "trtllm:d2"), "rollout's backend is 'trtllm'"),
    ],
)
def test_refusals_name_the_key_and_what_to_do(change, says):
    config = experiment("fsdp")
    change(config)
    with pytest.raises(Fp32LmHeadConfigError, match="^fp32patch \\(load_expr_config\\): ") as caught:
        areal.check_config(config, environ={})
    assert says in str(caught.value)


def test_one_side_alone_is_refused():
    config = Experiment()
    config.ref.fsdp.enable_fp32_lm_head = True
    with pytest.raises(Fp32LmHeadConfigError, match="ref.fsdp.enable_fp32_lm_head is true but actor.fsdp"):
        areal.check_config(config, environ={})
    with pytest.raises(Fp32LmHeadConfigError, match="vLLM's switch FP32PATCH_VLLM_LM_HEAD='1' is on"):
        areal.check_config(Experiment(), environ={"FP32PATCH_VLLM_LM_HEAD": "1"})
    with pytest.raises(Fp32LmHeadConfigError, match="SGLANG_DSPARK_FP32_LM_HEAD"):
        areal.check_config(Experiment(), environ={"SGLANG_DSPARK_FP32_LM_HEAD": "1"})


def test_megatron_chunked_logits_and_spmd_are_refused():
    config = experiment("megatron")
    config.actor.megatron.enable_chunked_logits = True
    with pytest.raises(Fp32LmHeadConfigError, match="enable_chunked_logits"):
        areal.check_config(config, environ={})
    with pytest.raises(Fp32LmHeadConfigError, match="SPMD launchers"):
        areal.check_config(experiment("megatron"), environ={"AREAL_SPMD_MODE": "1"})


def test_a_contradicting_vllm_switch_in_the_workers_env_is_refused(monkeypatch):
    monkeypatch.setattr(wiring.rollout, "installed_vllm_version", lambda: (0, 19, 1))
    config = experiment("fsdp", "vllm")
    config.rollout.scheduling_spec[0].env_vars["FP32PATCH_VLLM_LM_HEAD"] = "0"
    with pytest.raises(Fp32LmHeadConfigError, match="disagree"):
        areal.check_config(config, environ={})


def test_the_deprecated_allocation_mode_is_read():
    config = experiment("megatron")
    config.actor.backend = "???"
    config.rollout.backend = "???"
    config.allocation_mode = "sglang:d4+megatron:d2t2"
    settings = areal.validate_fp32_lm_head_config(config, environ={})
    assert (settings.trainer, settings.rollout) == ("megatron", "sglang")


# ---------------------------------------------------------------- the servers' arguments


def _py_cmd(args: dict) -> list[str]:
    """The command line AReaL's get_py_cmd makes of a server's arguments (False and None dropped,
    True a bare flag, anything else str())."""
    cmd = []
    for name, value in args.items():
        if value is None or value is False or value == "":
            continue
        cmd.append(f"--{name.replace('_', '-')}")
        if value is not True:
            cmd.append(str(value))
    return cmd


def test_sglang_servers_get_sglang_own_flag(monkeypatch):
    monkeypatch.setattr(wiring, "_sglang_server_args_cls", lambda: ServerArgs)
    config = experiment("megatron", "sglang")
    args = {"model_path": "/models/qwen", "tp_size": 2, "dtype": "bfloat16"}
    assert areal.server_args(args, config, "sglang") is args
    assert "--enable-fp32-lm-head" in _py_cmd(args)
    off = {"model_path": "/models/qwen"}
    assert areal.server_args(off, Experiment(), "sglang") == {"model_path": "/models/qwen"}


def test_an_sglang_without_the_flag_is_refused(monkeypatch):
    monkeypatch.setattr(wiring, "_sglang_server_args_cls", lambda: wiring._ServerArgsWithoutFlag)
    with pytest.raises(Fp32LmHeadConfigError, match="has no enable_fp32_lm_head"):
        areal.server_args({}, experiment("fsdp", "sglang"), "sglang")


def test_vllm_servers_get_head_dtype_on_0_26_and_later(monkeypatch):
    monkeypatch.setattr(wiring.rollout, "installed_vllm_version", lambda: (0, 29, 0))
    args = areal.server_args({"model": "/models/qwen"}, experiment("fsdp", "vllm"), "vllm")
    cmd = _py_cmd(args)
    assert json.loads(cmd[cmd.index("--hf-overrides") + 1]) == {"head_dtype": "float32"}
    assert shlex.split(shlex.join(cmd)) == cmd
    monkeypatch.setattr(wiring.rollout, "installed_vllm_version", lambda: (0, 19, 1))
    assert areal.server_args({"model": "m"}, experiment("fsdp", "vllm"), "vllm") == {"model": "m"}


# ---------------------------------------------------------------- the probe


@dataclass
class ServerInfo:
    host: str
    port: int
    process: Any = None


@dataclass
class Controller:
    server_infos: list = field(default_factory=list)


def test_sglang_probe_passes_fp32_servers_and_refuses_a_bf16_one():
    controller = Controller([ServerInfo("10.0.0.1", 30000), ServerInfo("10.0.0.2", 30001)])
    asked: list = []
    get, post = sglang_http(asked, flag=True, grid=None)
    reports = areal.probe_rollout(controller, experiment("fsdp", "sglang"), "sglang", get=get, post=post)
    assert [r["dtype"] for r in reports] == ["float32", "float32"]
    assert ("GET", "http://10.0.0.1:30000/server_info", None) in asked
    assert ("POST", "http://10.0.0.2:30001/generate", None) in asked
    get, post = sglang_http([], flag=False, grid=2.0**-7)
    with pytest.raises(Fp32LmHeadMismatchError, match="http://10.0.0.1:30000"):
        areal.probe_rollout(controller, experiment("fsdp", "sglang"), "sglang", get=get, post=post)


def test_the_probe_is_quiet_when_off_and_for_the_eval_rollout():
    def fail(*a, **k):
        raise AssertionError("no HTTP call expected")

    controller = Controller([ServerInfo("h", 1)])
    assert areal.probe_rollout(controller, Experiment(), "sglang", get=fail, post=fail) == []
    assert areal.probe_rollout(controller, experiment(), "sglang", role="eval-rollout", get=fail, post=fail) == []


def test_a_controller_without_servers_is_refused():
    with pytest.raises(Fp32LmHeadMismatchError, match="names no server to probe"):
        areal.probe_rollout(object(), experiment(), "sglang", get=print, post=print)


def _vllm_worker(dtype: str, way: str = "fp32out") -> dict:
    return {"dtype": dtype, "way": way, "patched": True, "env": "1", "host": "h", "pid": 7, "reason": ""}


def test_vllm_probe_asks_areal_server_route():
    asked: list = []

    def post(url, **kw):
        asked.append(url)
        return Answer({"results": [_vllm_worker("float32"), _vllm_worker("float32")]})

    controller = Controller([ServerInfo("10.0.0.3", 8000)])
    reports = areal.probe_rollout(controller, experiment("megatron", "vllm"), "vllm", get=print, post=post)
    assert asked == ["http://10.0.0.3:8000/fp32patch_probe_lm_head"]
    assert [r["dtype"] for r in reports] == ["float32", "float32"]

    def bf16(url, **kw):
        return Answer({"results": [_vllm_worker("float32"), _vllm_worker("bfloat16", "stock")]})

    with pytest.raises(Fp32LmHeadMismatchError, match="vLLM worker 1 .* computes bfloat16 logits"):
        areal.probe_rollout(controller, experiment("megatron", "vllm"), "vllm", get=print, post=bf16)

    def unpatched(url, **kw):
        return Answer({"detail": "Not Found"}, status=404)

    with pytest.raises(Fp32LmHeadMismatchError, match="has no /fp32patch_probe_lm_head"):
        areal.probe_rollout(controller, experiment("megatron", "vllm"), "vllm", get=print, post=unpatched)
