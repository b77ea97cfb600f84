"""validate_fp32_lm_head_config: every rule, as tables of valid and invalid policies."""

from __future__ import annotations

import pytest

from fp32patch.runtime.config import (
    Fp32LmHeadConfigError,
    Fp32LmHeadSettings,
    validate_fp32_lm_head_config,
)

VAR = "NRL_VLLM_FP32_LM_HEAD"
_UNSET = object()


def policy(
    fp32_lm_head: object = _UNSET,
    env: object = _UNSET,
    backend: str | None = "vllm",
    fused: object = _UNSET,
    enabled: object = _UNSET,
) -> dict:
    """A NeMo-RL policy section with just the keys the guard reads."""
    megatron: dict = {}
    if enabled is not _UNSET:
        megatron["enabled"] = enabled
    if fp32_lm_head is not _UNSET:
        megatron["fp32_lm_head"] = fp32_lm_head
    if fused is not _UNSET:
        megatron["use_fused_linear_logprobs"] = fused
    vllm_cfg: dict = {"async_engine": False}
    if env is not _UNSET:
        vllm_cfg["env_vars"] = {"NCCL_CUMEM_ENABLE": "1", VAR: env}
    generation: dict = {"vllm_cfg": vllm_cfg}
    if backend is not None:
        generation["backend"] = backend
    return {"megatron_cfg": megatron, "generation": generation}


# (policy, expected settings): configs that must pass, and what they ask for.
VALID = [
    pytest.param(policy(), Fp32LmHeadSettings(None, None), id="both-unset"),
    pytest.param(policy(False), Fp32LmHeadSettings(None, None), id="megatron-false"),
    pytest.param(policy(None), Fp32LmHeadSettings(None, None), id="megatron-null"),
    pytest.param(policy(False, "0"), Fp32LmHeadSettings(None, "0"), id="both-off-explicit"),
    pytest.param(policy(False, 0), Fp32LmHeadSettings(None, "0"), id="vllm-yaml-int-0"),
    pytest.param(policy(True, "1"), Fp32LmHeadSettings("fp32", "1"), id="true-with-1"),
    pytest.param(policy(True, 1), Fp32LmHeadSettings("fp32", "1"), id="vllm-yaml-int-1"),
    pytest.param(policy("fp32", "copy"), Fp32LmHeadSettings("fp32", "copy"), id="fp32-copy"),
    pytest.param(policy("tf32", "fp32out"), Fp32LmHeadSettings("tf32", "fp32out"), id="tf32"),
    pytest.param(policy("fp32out", "fp32out"), Fp32LmHeadSettings("fp32out", "fp32out"), id="fp32out"),
    pytest.param(
        policy("fp32out-bf16grad", "1"),
        Fp32LmHeadSettings("fp32out-bf16grad", "1"),
        id="fp32out-bf16grad",
    ),
    pytest.param(policy("fp32out", "1", fused=False), Fp32LmHeadSettings("fp32out", "1"), id="fused-off"),
    pytest.param(policy(False, fused=True), Fp32LmHeadSettings(None, None), id="fused-with-head-off"),
    pytest.param(policy("tf32", "1", enabled=True), Fp32LmHeadSettings("tf32", "1"), id="enabled-true"),
    pytest.param(policy(False, enabled=False), Fp32LmHeadSettings(None, None), id="dtensor"),
    pytest.param(
        policy(True, "1", backend="dynamo"),
        Fp32LmHeadSettings("fp32", "1"),
        id="dynamo-runs-vllm",
    ),
    # Not vLLM: the pairing rule is skipped (the same Megatron model generates).
    pytest.param(policy(True, backend="megatron"), Fp32LmHeadSettings("fp32", None), id="meg-gen"),
    pytest.param(policy(True, "1", backend="sglang"), Fp32LmHeadSettings("fp32", None), id="sgl"),
    pytest.param(policy(True, backend=None), Fp32LmHeadSettings("fp32", None), id="no-backend"),
    pytest.param({"megatron_cfg": {"fp32_lm_head": True}}, Fp32LmHeadSettings("fp32", None), id="no-gen"),
    pytest.param({}, Fp32LmHeadSettings(None, None), id="empty"),
    pytest.param(
        {"megatron_cfg": None, "generation": {"backend": "vllm", "vllm_cfg": None}},
        Fp32LmHeadSettings(None, None),
        id="null-sections",
    ),
    pytest.param(
        {"policy": policy("fp32out", "fp32out")},
        Fp32LmHeadSettings("fp32out", "fp32out"),
        id="whole-config",
    ),
]


@pytest.mark.parametrize(("cfg", "expected"), VALID)
def test_valid_configs_pass_and_say_what_they_ask_for(cfg: dict, expected: Fp32LmHeadSettings):
    assert validate_fp32_lm_head_config(cfg, environ={}) == expected


# (policy, fragments the message must contain): each rule, each way to break it.
INVALID = [
    # One engine alone.
    pytest.param(policy(True), ["megatron_cfg.fp32_lm_head", "is not set", '"1"'], id="meg-only"),
    pytest.param(policy("fp32out", "0"), ["fp32_lm_head is 'fp32out'", 'is "0"'], id="meg-vllm-0"),
    pytest.param(policy("tf32", 0), ['is "0"', "mismatch worse"], id="meg-vllm-int-0"),
    pytest.param(policy(False, "1"), [f"env_vars.{VAR}", '"1"', "is off"], id="vllm-only"),
    pytest.param(policy(None, "copy"), ['"copy"', "fp32_lm_head is off"], id="vllm-copy-only"),
    pytest.param(policy(env="fp32out"), ['"fp32out"', "is off"], id="vllm-only-meg-unset"),
    pytest.param(policy(False, "1", enabled=False), ["fp32_lm_head is off"], id="dtensor-with-vllm-on"),
    pytest.param(policy(True, backend="dynamo"), ["is not set"], id="dynamo-meg-only"),
    # Megatron values.
    pytest.param(policy("false"), ["'false' is not valid", "without quotes", "false, true"], id="str-false"),
    pytest.param(policy("true", "1"), ["'true' is not valid", "without quotes"], id="str-true"),
    pytest.param(policy("TF32", "1"), ["'TF32'", 'did you mean "tf32"', '"fp32out"'], id="TF32"),
    pytest.param(policy("FP32OUT"), ['did you mean "fp32out"'], id="FP32OUT"),
    pytest.param(policy("bf16"), ["'bf16' is not valid", '"tf32"'], id="bf16"),
    pytest.param(policy(1, "1"), ["fp32_lm_head = 1 is not valid"], id="int-1"),
    pytest.param(policy(0), ["fp32_lm_head = 0 is not valid"], id="int-0"),
    pytest.param(policy("copy", "copy"), ["'copy' is not valid"], id="vllm-value-on-megatron"),
    # vLLM values, as NeMo-RL would pass them (str of the YAML value).
    pytest.param(policy(True, True), ["= True is not valid", 'string "True"', "write 1"], id="yaml-true"),
    pytest.param(policy(False, False), ['string "False"', "write 1 or 0"], id="yaml-false"),
    pytest.param(policy(False, None), ['string "None"'], id="yaml-null"),
    pytest.param(policy(True, "true"), ["'true' is not valid", '"fp32out", "copy"'], id="vllm-str-true"),
    pytest.param(policy(True, "FP32OUT"), ["'FP32OUT' is not valid"], id="vllm-FP32OUT"),
    pytest.param(policy(True, "tf32"), ["'tf32' is not valid"], id="vllm-tf32"),
    pytest.param(policy(True, ""), ["'' is not valid", "unset"], id="vllm-empty"),
    pytest.param(policy(True, 1.0), ["= 1.0 is not valid"], id="vllm-float"),
    # Paths that bypass or never run the fp32 head.
    pytest.param(
        policy(True, "1", fused=True),
        ["use_fused_linear_logprobs = True", "never run"],
        id="fused-logprobs",
    ),
    pytest.param(
        policy("fp32out", "1", fused=True, backend="megatron"),
        ["use_fused_linear_logprobs"],
        id="fused-logprobs-any-backend",
    ),
    pytest.param(policy(True, "1", enabled=False), ["megatron_cfg.enabled is False"], id="megatron-disabled"),
    # Shapes.
    pytest.param({"megatron_cfg": ["fp32_lm_head"]}, ["megatron_cfg must be a mapping"], id="list"),
    pytest.param(
        {"generation": {"backend": "vllm", "vllm_cfg": {"env_vars": [VAR]}}},
        ["generation.vllm_cfg.env_vars must be a mapping"],
        id="env-list",
    ),
    pytest.param(
        {"policy": policy(True)},
        ["policy.megatron_cfg.fp32_lm_head", "policy.generation"],
        id="whole",
    ),
]


@pytest.mark.parametrize(("cfg", "fragments"), INVALID)
def test_invalid_configs_raise_naming_the_key_and_the_fix(cfg: dict, fragments: list[str]):
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        validate_fp32_lm_head_config(cfg, environ={})
    for fragment in fragments:
        assert fragment in str(caught.value)


def test_the_error_is_a_value_error():
    with pytest.raises(ValueError):
        validate_fp32_lm_head_config(policy("false"), environ={})


@pytest.mark.parametrize("value", [["policy"], "policy.yaml", None])
def test_a_config_that_is_not_a_mapping_is_refused(value: object):
    with pytest.raises(Fp32LmHeadConfigError, match="mapping"):
        validate_fp32_lm_head_config(value, environ={})  # type: ignore[arg-type]


# NeMo-RL copies the driver's environment into workers that env_vars does not override.
ENVIRON = [
    pytest.param(policy(True), {VAR: "1"}, Fp32LmHeadSettings("fp32", "1"), id="env-only-on"),
    pytest.param(policy(), {VAR: "0"}, Fp32LmHeadSettings(None, "0"), id="env-only-off"),
    pytest.param(policy(True, "1"), {VAR: "0"}, Fp32LmHeadSettings("fp32", "1"), id="cfg-wins"),
    pytest.param(policy(True), {}, None, id="neither"),
    pytest.param(policy(False), {VAR: "copy"}, None, id="env-on-megatron-off"),
    pytest.param(policy(True, "0"), {VAR: "1"}, None, id="cfg-off-wins-over-env"),
]


@pytest.mark.parametrize(("cfg", "environ", "expected"), ENVIRON)
def test_the_driver_environment_counts_where_env_vars_is_silent(cfg, environ, expected):
    if expected is None:
        with pytest.raises(Fp32LmHeadConfigError):
            validate_fp32_lm_head_config(cfg, environ=environ)
    else:
        assert validate_fp32_lm_head_config(cfg, environ=environ) == expected


def test_the_environment_message_names_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(VAR, "fp32out")
    with pytest.raises(Fp32LmHeadConfigError, match=f"the environment variable {VAR}"):
        validate_fp32_lm_head_config(policy(False))  # default: os.environ
    monkeypatch.setenv(VAR, "yes")
    with pytest.raises(Fp32LmHeadConfigError, match="'yes' is not valid"):
        validate_fp32_lm_head_config(policy(True))


def test_the_guard_does_not_change_the_config():
    cfg = policy("tf32", 1)
    before = repr(cfg)
    validate_fp32_lm_head_config(cfg, environ={})
    assert repr(cfg) == before
