"""fp32patch.runtime.nemo_rl without torch, vLLM or Megatron: the config guard through
dicts and a pydantic config shaped like NeMo-RL's MasterConfig, and the driver's check of
the vLLM workers' probe reports (the probe itself runs in tests/heavy/vllm)."""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any, Literal

import pytest
from pydantic import BaseModel
from typing_extensions import NotRequired, TypedDict

from fp32patch.runtime.nemo_rl import (
    PROBE_RPC,
    VLLM_ENV_VAR,
    Fp32LmHeadConfigError,
    Fp32LmHeadMismatchError,
    Fp32LmHeadSettings,
    check_config,
    check_probe_reports,
)

VAR = "NRL_VLLM_FP32_LM_HEAD"
KEY = "policy.megatron_cfg.fp32_lm_head"
DT_KEY = "policy.dtensor_cfg.fp32_lm_head"


@pytest.fixture(autouse=True)
def _no_verdict_from_another_test():
    # check_config keeps its last verdict per caller for the probe's line, process-wide
    from fp32patch.runtime.nemo_rl import config

    config._CHECKED.clear()
    yield
    config._CHECKED.clear()


# ---- a config of NeMo-RL's shape: pydantic at the top, TypedDicts below ------------------


class VllmSpecific(TypedDict):
    tensor_parallel_size: int
    env_vars: NotRequired[dict[str, str] | None]


class Generation(TypedDict):
    backend: str
    vllm_cfg: NotRequired[VllmSpecific]


class Megatron(TypedDict):
    enabled: Literal[True]
    tensor_model_parallel_size: int
    model_overrides: NotRequired[dict[str, Any]]


class MegatronDisabled(TypedDict):
    enabled: Literal[False]


class Policy(TypedDict):
    model_name: str
    generation: NotRequired[Generation]
    megatron_cfg: NotRequired[Megatron | MegatronDisabled]


class MasterConfig(BaseModel, extra="allow"):
    policy: Policy
    env: dict[str, Any]


def master(megatron: dict | None = None, env_vars: dict | None = None, **policy_extra: Any) -> dict:
    vllm_cfg: dict = {"tensor_parallel_size": 1}
    if env_vars is not None:
        vllm_cfg["env_vars"] = {"NCCL_CUMEM_ENABLE": "1", **env_vars}
    policy = {
        "model_name": "nvidia/NVIDIA-Nemotron-Nano-9B-v2",
        "generation": {"backend": "vllm", "vllm_cfg": vllm_cfg},
        "megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 1, **(megatron or {})},
        **policy_extra,
    }
    return {"policy": policy, "env": {}}


SHAPES = {
    "master-dict": lambda cfg: cfg,
    "policy-dict": lambda cfg: cfg["policy"],
    "pydantic-master": lambda cfg: MasterConfig(**cfg),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize(
    ("megatron", "env_vars", "expected"),
    [
        ({"fp32_lm_head": "fp32out"}, {VAR: "1"}, Fp32LmHeadSettings("fp32out", "1")),
        ({"fp32_lm_head": True}, {VAR: "copy"}, Fp32LmHeadSettings("fp32", "copy")),
        ({}, None, Fp32LmHeadSettings(None, None)),
        ({"fp32_lm_head": False}, {VAR: "0"}, Fp32LmHeadSettings(None, "0")),
        ({"fp32_lm_head": "tf32", "fp32_residual_connection": True}, {VAR: "1"}, Fp32LmHeadSettings("tf32", "1")),
        ({"fp32_residual_connection": False, "model_overrides": {"hidden_dropout": 0.0}}, None, None),
    ],
)
def test_valid_configs_pass_in_every_shape(shape, megatron, env_vars, expected):
    cfg = SHAPES[shape](master(megatron, env_vars))
    assert check_config(cfg, where="driver", environ={}) == (expected or Fp32LmHeadSettings(None, None))


NEAR_MISSES = [
    "fp32_lm_heads",
    "fp32_lmhead",
    "fp32-lm-head",
    "fp32LmHead",
    "FP32_LM_HEAD",
    "fp32_lm_hed",
    "lm_head_fp32",
]


@pytest.mark.parametrize("key", NEAR_MISSES)
def test_pydantic_keeps_a_near_miss_key_silently_and_the_check_names_the_right_key(key):
    cfg = MasterConfig(**master({key: "fp32out"}, {VAR: "1"}))
    assert cfg.policy["megatron_cfg"][key] == "fp32out"  # NeMo-RL's model takes it without a word
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        check_config(cfg, where="megatron worker rank 3", environ={})
    message = str(caught.value)
    assert message.startswith("fp32patch (megatron worker rank 3): ")
    assert f"policy.megatron_cfg.{key} is not a key" in message
    assert f"did you mean {KEY}?" in message


def test_the_right_key_beside_a_near_miss_is_still_refused():
    cfg = master({"fp32_lm_head": "fp32out", "fp32_lm_heads": "fp32out"}, {VAR: "1"})
    with pytest.raises(Fp32LmHeadConfigError, match="fp32_lm_heads is not a key"):
        check_config(cfg, where="driver", environ={})


@pytest.mark.parametrize("key", ["defer_fp32_logits", "fp32_residual_connection", "grad_reduce_in_fp32", "lm_loss"])
def test_real_neighbouring_keys_are_not_near_misses(key):
    value = True if key != "lm_loss" else 1.0
    assert check_config(master({key: value}), where="driver", environ={}) == Fp32LmHeadSettings(None, None)


@pytest.mark.parametrize(
    ("cfg", "fragments"),
    [
        pytest.param(
            master(None, {VAR: "1"}, fp32_lm_head="fp32out"),
            ["policy.fp32_lm_head is in the wrong place", KEY],
            id="policy-level",
        ),
        pytest.param(
            master({"fp32_lm_head": "fp32out"}, {"NRL_VLLM_FP32_LMHEAD": "1"}),
            ["env_vars.NRL_VLLM_FP32_LMHEAD is not the variable", f"did you mean {VAR}"],
            id="env-var-misspelt",
        ),
        pytest.param(
            master({"fp32_lm_head": "fp32out"}, {"fp32_lm_head": "1"}),
            ["env_vars.fp32_lm_head is not the variable"],
            id="megatron-key-in-env-vars",
        ),
        pytest.param(
            master({"fp32_lm_head": "fp32out"}),
            [f"{KEY} is 'fp32out' but policy.generation.vllm_cfg.fp32_lm_head is not set"],
            id="megatron-only",
        ),
        pytest.param(
            master({"fp32_residual_connection": "true"}),
            ["policy.megatron_cfg.fp32_residual_connection = 'true' is not valid", "without quotes"],
            id="residual-string",
        ),
        pytest.param(
            master({"fp32_residual_connection": 1}),
            ["fp32_residual_connection = 1 is not valid"],
            id="residual-int",
        ),
        pytest.param(
            master({"fp32_residual_connection": None}),
            ["fp32_residual_connection = None is not valid"],
            id="residual-null",
        ),
        pytest.param(
            master({"fp32_residual_connection": True, "model_overrides": {"fp32_residual_connection": True}}),
            ["both set Megatron's fp32_residual_connection", "remove it from model_overrides"],
            id="residual-twice",
        ),
    ],
)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_invalid_configs_name_the_key_in_every_shape(shape, cfg, fragments):
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        check_config(SHAPES[shape](cfg), where="driver", environ={})
    for fragment in fragments:
        assert fragment in str(caught.value)
    assert str(caught.value).startswith("fp32patch (driver): ")


def test_the_environment_counts_where_env_vars_is_silent(monkeypatch):
    cfg = master({"fp32_lm_head": "fp32out"})
    assert check_config(cfg, where="driver", environ={VAR: "fp32out"}) == Fp32LmHeadSettings("fp32out", "fp32out")
    monkeypatch.setenv(VAR, "1")
    assert check_config(cfg, where="driver") == Fp32LmHeadSettings("fp32out", "1")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_where_upstream_owns_megatrons_head_only_its_values_pass(shape):
    """NeMo-RL after its September 2026 rework: Megatron's head is its own (logit_dtype)."""
    for value, expected in ((True, "fp32"), ("tf32", "tf32"), (False, None)):
        cfg = SHAPES[shape](master({"fp32_lm_head": value}, {VAR: "1" if value else "0"}))
        assert check_config(cfg, where="driver", environ={}, megatron_head="upstream").megatron == expected
    for mode in ("fp32out", "fp32out-hilo", "fp32out-bf16grad", "fp32"):
        cfg = SHAPES[shape](master({"fp32_lm_head": mode}, {VAR: "1"}))
        assert check_config(cfg, where="driver", environ={}).megatron == mode  # fp32patch's own head: fine
        with pytest.raises(Fp32LmHeadConfigError, match=rf"fp32patch \(megatron worker rank 2\): .*{mode!r} is one of"):
            check_config(cfg, where="megatron worker rank 2", environ={}, megatron_head="upstream")


def test_megatron_head_names_a_known_owner():
    with pytest.raises(ValueError, match="megatron_head must be one of"):
        check_config(master(), where="driver", environ={}, megatron_head="bridge")


def test_a_config_that_is_not_a_mapping_is_refused():
    with pytest.raises(Fp32LmHeadConfigError, match="expected NeMo-RL's master config"):
        check_config(["policy"], where="driver")


def test_the_check_does_not_change_the_config():
    cfg = master({"fp32_lm_head": "fp32out", "fp32_residual_connection": True}, {VAR: "1"})
    before = repr(cfg)
    check_config(cfg, where="driver", environ={})
    assert repr(cfg) == before


# ---- the driver's check of the probe reports ------------------------------------------------


NEMOTRON_FILE = "/venvs/vllm/lib/python3.12/site-packages/vllm/model_executor/models/nemotron_h.py"


def report(dtype="float32", way="fp32out", env="1", patched=True, reason="fp32 logits by fp32out", **extra):
    return {
        "dtype": dtype,
        "way": way,
        "reason": reason,
        "env": env,
        "pid": 4242 + len(extra),
        "host": "node-7",
        "patched": patched,
        "model": "NemotronHForCausalLM",
        "file": NEMOTRON_FILE,
        "files": [
            NEMOTRON_FILE,
            "/venvs/vllm/lib/python3.12/site-packages/vllm/model_executor/layers/logits_processor.py",
        ],
        **extra,
    }


OFF = report("bfloat16", "off", None, True, f"{VAR} is unset in this process")


@pytest.fixture
def info_lines(caplog):
    caplog.set_level(logging.INFO, logger="nemo_rl.fp32patch")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "nemo_rl.fp32patch"]


def test_all_fp32_agree_and_one_info_line_says_so(info_lines):
    reports = [[report(), report()], [report(way="copy")]]  # two engines, nested as collective_rpc nests
    check_probe_reports(reports, Fp32LmHeadSettings("fp32out", "1"))
    assert info_lines() == [
        "fp32patch (driver): LM head fp32 in both engines: Megatron fp32_lm_head='fp32out', "
        "3 vLLM worker(s) compute float32 logits (way: copy, fp32out)"
    ]


def test_both_off_agree(info_lines):
    check_probe_reports([OFF, OFF], None, where="grpo setup")
    assert info_lines() == [
        "fp32patch (grpo setup): LM head fp32 off in both engines: 2 vLLM worker(s) compute bfloat16 logits"
    ]


@pytest.mark.parametrize(
    ("mode", "bad", "expected"),
    [
        pytest.param(
            "fp32out",
            report("bfloat16", "off", None, True, f"{VAR} is unset in this process"),
            f"vLLM worker 1 (host node-7, pid 4242) computes bfloat16 logits while {KEY}='fp32out': "
            f"{VAR} is unset in that process",
            id="variable-missing",
        ),
        pytest.param(
            True,
            report("bfloat16", "off", "0", True, f"{VAR} is '0' in this process"),
            f"computes bfloat16 logits while {KEY}='fp32': {VAR} is '0' in that process",
            id="variable-0",
        ),
        pytest.param(
            "fp32out",
            report("bfloat16", "stock", "1", False, "the model file is not patched"),
            f"computes bfloat16 logits while {KEY}='fp32out': the model file is not patched "
            f"(run fp32patch apply in that venv): {NEMOTRON_FILE}",
            id="unpatched",
        ),
        pytest.param(
            "tf32",
            report("bfloat16", "stock", "1", True, "quantized head (Fp8LinearMethod): no bf16 weight"),
            f"computes bfloat16 logits while {KEY}='tf32': the way is stock: quantized head (Fp8LinearMethod)",
            id="stock-way",
        ),
        pytest.param(
            "fp32out",
            report(None, "stock", "TF32", True, "compute_logits raised ValueError: NRL_VLLM_FP32_LM_HEAD='TF32'"),
            f"computes no logits while {KEY}='fp32out': compute_logits raised ValueError",
            id="probe-error",
        ),
        pytest.param(
            None,
            report("float32", "fp32out", "1", True),
            f"computes float32 logits while {KEY} is off: {VAR}='1' in that process",
            id="reverse-variable",
        ),
        pytest.param(
            False,
            report("float32", "native", None, False, "the logits are float32 without fp32patch's runtime"),
            f"computes float32 logits while {KEY} is off: the way is native: the logits are float32",
            id="reverse-native",
        ),
        pytest.param(
            "fp32out",
            None,
            "vLLM worker 1 returned no LM-head probe report (got None)",
            id="no-report",
        ),
    ],
)
def test_each_disagreement_names_the_worker_and_the_reason(mode, bad, expected, info_lines):
    good = report() if mode not in (None, False) else OFF
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        check_probe_reports([good, bad, good], mode)
    message = str(caught.value)
    assert message.startswith("fp32patch (driver): the fp32 LM head is not on in both engines alike:\n")
    assert expected in message
    assert "a mix the config did not ask for" in message
    assert [index for index, _, _ in caught.value.disagreements] == [1]
    assert info_lines() == []


ASKED = f"{VAR}='1' in policy.generation.vllm_cfg.env_vars"


def test_a_caller_that_knows_only_the_vllm_switch_names_it(info_lines):
    # NeMo-RL's driver holds the generation config: it knows the switch, not Megatron's mode
    check_probe_reports([report(), report(way="copy")], "fp32", asked_by=ASKED)
    assert info_lines() == [
        f"fp32patch (driver): LM head fp32 on in every vLLM worker, as {ASKED} asks: 2 vLLM worker(s) "
        f"compute float32 logits (way: copy, fp32out); the config guard holds the trainer's switch ({KEY} or "
        f"{DT_KEY}) to the same switch"
    ]
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        check_probe_reports([report(), OFF], "fp32", asked_by=ASKED)
    assert f"vLLM worker 1 (host node-7, pid 4242) computes bfloat16 logits while {ASKED}: {VAR} is unset" in str(
        caught.value
    )
    assert "'fp32'" not in str(caught.value)


def test_a_caller_that_knows_only_the_vllm_switch_off(info_lines):
    off = f"{VAR}='0' in policy.generation.vllm_cfg.env_vars"
    check_probe_reports([OFF], None, asked_by=off)
    assert info_lines() == [
        f"fp32patch (driver): LM head fp32 off in every vLLM worker, as {off} asks: 1 vLLM worker(s) "
        f"compute bfloat16 logits (stock); the config guard holds the trainer's switch ({KEY} or "
        f"{DT_KEY}) to the same switch"
    ]
    with pytest.raises(Fp32LmHeadMismatchError, match=f"computes float32 logits while {off}: {VAR}='1'"):
        check_probe_reports([report("float32", "fp32out", "1", True)], None, asked_by=off)


def test_every_disagreeing_worker_is_named_once_in_flat_order():
    reports = [[report(), OFF], [report(), report("bfloat16", "stock", "1", False)]]
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        check_probe_reports(reports, "fp32out")
    assert [index for index, _, _ in caught.value.disagreements] == [1, 3]
    lines = str(caught.value).splitlines()
    assert lines[1].startswith("  vLLM worker 1 ") and lines[2].startswith("  vLLM worker 3 ")


def test_the_error_is_a_runtime_error_and_no_reports_is_one():
    assert issubclass(Fp32LmHeadMismatchError, RuntimeError)
    with pytest.raises(Fp32LmHeadMismatchError, match="no vLLM worker returned"):
        check_probe_reports([], "fp32out")


def test_a_bad_mode_is_a_config_error():
    with pytest.raises(Fp32LmHeadConfigError, match="'false' is not valid"):
        check_probe_reports([OFF], "false")


def test_the_public_names_of_the_contract():
    assert PROBE_RPC == "fp32patch_probe_lm_head"
    assert VLLM_ENV_VAR == VAR


def test_importing_the_module_imports_no_torch_vllm_or_megatron():
    code = (
        "import sys, fp32patch.runtime.nemo_rl as m\n"
        "heavy = sorted(n for n in sys.modules if n.split('.')[0] in ('torch', 'vllm', 'megatron'))\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def dtensor_master(mode: object, **vllm_cfg: object) -> dict:
    cfg = master(None, None)
    cfg["policy"]["megatron_cfg"] = {"enabled": False}
    cfg["policy"]["dtensor_cfg"] = {"enabled": True, "_v2": True, "fp32_lm_head": mode}
    cfg["policy"]["generation"]["vllm_cfg"].update(vllm_cfg)
    return cfg


def test_the_probe_line_names_the_dtensor_mode_the_driver_guard_found(info_lines):
    settings = check_config(dtensor_master("fp32out", fp32_lm_head=True), where="driver", environ={})
    assert settings == Fp32LmHeadSettings(None, "1", dtensor="fp32out")
    check_probe_reports([report()], settings)
    check_probe_reports([report()], "fp32", asked_by="policy.generation.vllm_cfg.fp32_lm_head=True")
    assert info_lines() == [
        "fp32patch (driver): LM head fp32 in both engines: DTensor fp32_lm_head='fp32out', 1 vLLM worker(s) "
        "compute float32 logits (way: fp32out)",
        "fp32patch (driver): LM head fp32 on in every vLLM worker, as policy.generation.vllm_cfg.fp32_lm_head=True "
        f"asks: 1 vLLM worker(s) compute float32 logits (way: fp32out); the trainer: {DT_KEY} is 'fp32out', held "
        "to the same switch by the config guard",
    ]


def test_a_dtensor_disagreement_names_the_dtensor_key():
    settings = check_config(dtensor_master("fp32out", fp32_lm_head=True), where="driver", environ={})
    with pytest.raises(Fp32LmHeadMismatchError, match=f"computes bfloat16 logits while {DT_KEY}='fp32out'"):
        check_probe_reports([report(), OFF], settings)


def test_one_side_alone_accepted_warns_and_the_probe_holds_vllm_to_its_switch(caplog, info_lines):
    cfg = dtensor_master(None, fp32_lm_head=True)
    cfg["policy"]["allow_one_sided_fp32_lm_head"] = True
    settings = check_config(cfg, where="driver", environ={})
    assert settings.one_sided and settings.vllm_on and settings.trainer is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("fp32patch (driver): policy.generation.vllm_cfg.fp32_lm_head")
    assert "accepted by policy.allow_one_sided_fp32_lm_head" in warnings[0]
    check_probe_reports([report()], settings)  # vLLM fp32, as its switch asks: no mismatch
    with pytest.raises(Fp32LmHeadMismatchError):
        check_probe_reports([OFF], settings)
    check_probe_reports([report()], "fp32", asked_by="policy.generation.vllm_cfg.fp32_lm_head=True")
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos[-1].endswith(
        f"the trainer: {DT_KEY} is off (one side alone, accepted by policy.allow_one_sided_fp32_lm_head)"
    )
