"""vLLM's switch under its two names, FP32PATCH_VLLM_LM_HEAD (neutral) and NRL_VLLM_FP32_LM_HEAD
(NeMo-RL's): both read wherever either was, never contradicting, and every message names the one
the user set. (The patched vLLM file itself: tests/test_vllm_logits_0_9.py.)"""

from __future__ import annotations

import logging

import pytest

from fp32patch.runtime import modes
from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.heads import vllm as vllm_head
from fp32patch.runtime.kit.probe import disagreement
from fp32patch.runtime.kit.rollout import read_vllm_switch, set_vllm_env
from fp32patch.runtime.nemo_rl import check_config
from fp32patch.runtime.verl import validate_fp32_lm_head_config as verl_rules

NEUTRAL, NRL = "FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD"


@pytest.mark.parametrize(
    ("environ", "found"),
    [
        ({}, None),
        ({NEUTRAL: "1"}, (NEUTRAL, "1")),
        ({NRL: "copy"}, (NRL, "copy")),
        ({NEUTRAL: " fp32out ", NRL: "fp32out"}, (NEUTRAL, "fp32out")),
        ({NEUTRAL: "", NRL: "0"}, (NRL, "0")),
        ({NEUTRAL: "  "}, None),
        ({"NRL_VLLM_FP32_LM_HEADS": "1"}, None),
    ],
)
def test_either_name_is_the_switch(environ, found):
    assert modes.vllm_switch(environ) == found


def test_a_blank_value_in_a_config_is_set_not_unset():
    assert modes.vllm_switch({NEUTRAL: ""}, blank_is_unset=False) == (NEUTRAL, "")


@pytest.mark.parametrize("values", [("1", "0"), ("copy", "fp32out"), ("1", "fp32out")])
def test_two_names_two_values_are_refused_naming_both(values):
    with pytest.raises(ValueError, match=rf"{NEUTRAL}='{values[0]}' and {NRL}='{values[1]}' disagree"):
        modes.vllm_switch({NEUTRAL: values[0], NRL: values[1]})


@pytest.mark.parametrize(
    ("name", "value", "way"), [(NEUTRAL, "1", "auto"), (NEUTRAL, "copy", "copy"), (NRL, "0", None)]
)
def test_the_vllm_head_reads_either_name(name, value, way):
    assert vllm_head.requested_way({name: value}) == way


def test_the_vllm_head_names_the_name_with_a_bad_value():
    with pytest.raises(ValueError, match=rf"^{NEUTRAL}='yes' is not a valid value"):
        vllm_head.requested_way({NEUTRAL: "yes"})


def test_a_config_switch_names_where_it_was_found():
    switch = read_vllm_switch({NEUTRAL: 1}, "policy.generation.vllm_cfg.env_vars", {NRL: "0"})
    assert (switch.name, switch.value, switch.source) == (
        NEUTRAL,
        "1",
        f"policy.generation.vllm_cfg.env_vars.{NEUTRAL}",
    )
    switch = read_vllm_switch(None, "x.env_vars", {NEUTRAL: "copy"})
    assert (switch.source, switch.on) == (f"the environment variable {NEUTRAL}", True)
    with pytest.raises(Fp32LmHeadConfigError, match=rf"^{NEUTRAL}='1' and {NRL}='0' disagree: .* \(in x.env_vars\)$"):
        read_vllm_switch({NEUTRAL: "1", NRL: "0"}, "x.env_vars", {})
    with pytest.raises(Fp32LmHeadConfigError, match=rf"x.env_vars.{NEUTRAL} = True is not valid \(YAML true reaches"):
        read_vllm_switch({NEUTRAL: True}, "x.env_vars", {})


def _nemo(env_vars, trainer="fp32out"):
    return {
        "policy": {
            "megatron_cfg": {"enabled": True, "fp32_lm_head": trainer},
            "generation": {"backend": "vllm", "vllm_cfg": {"env_vars": env_vars}},
        }
    }


def test_nemo_rl_takes_the_neutral_name_in_env_vars_as_it_takes_its_own(caplog):
    with caplog.at_level(logging.WARNING):
        settings = check_config(_nemo({NEUTRAL: "copy"}), where="driver", environ={})
    assert settings.vllm == "copy" and settings.vllm_on
    # the "older spelling" note is about NeMo-RL's own name, which upstream reserves: not this one
    assert not [r for r in caplog.records if "older spelling" in r.getMessage()]
    with caplog.at_level(logging.WARNING):
        check_config(_nemo({NRL: "copy"}), where="driver", environ={})
    assert [r for r in caplog.records if "older spelling" in r.getMessage()]


def test_nemo_rl_one_sided_by_the_neutral_name_names_it():
    with pytest.raises(Fp32LmHeadConfigError, match=rf"policy.generation.vllm_cfg.env_vars.{NEUTRAL} is \"1\""):
        check_config(_nemo({NEUTRAL: "1"}, trainer=False), where="driver", environ={})


def test_nemo_rl_names_the_neutral_name_for_its_near_miss():
    with pytest.raises(
        Fp32LmHeadConfigError, match=rf"env_vars.FP32PATCH_VLLM_LMHEAD is not .* did you mean {NEUTRAL}\?"
    ):
        check_config(_nemo({"FP32PATCH_VLLM_LMHEAD": "1"}), where="driver", environ={})


def _verl(mode, env_vars=None):
    config = {"actor_rollout_ref": {"model": {"fp32_lm_head": mode}, "rollout": {"name": "vllm"}}}
    if env_vars is not None:
        config["ray_kwargs"] = {"ray_init": {"runtime_env": {"env_vars": env_vars}}}
    return config


def test_verl_refuses_the_neutral_name_alone_naming_it():
    with pytest.raises(
        Fp32LmHeadConfigError, match=rf"runtime_env.env_vars.{NEUTRAL} is \"1\" but .* remove {NEUTRAL}$"
    ):
        verl_rules(_verl(False, {NEUTRAL: "1"}), environ={})
    with pytest.raises(Fp32LmHeadConfigError, match=rf"the environment variable {NEUTRAL} is \"0\": the two disagree"):
        verl_rules(_verl("fp32out"), environ={NEUTRAL: "0"})
    assert verl_rules(_verl("fp32out"), environ={NEUTRAL: "copy"}).vllm == "copy"


def test_a_rollout_process_keeps_the_name_the_user_set(caplog):
    logger = logging.getLogger("test.fp32patch")
    environ = {NEUTRAL: "copy"}
    with caplog.at_level(logging.INFO, logger="test.fp32patch"):
        assert set_vllm_env("fp32out", key="k", where="server", logger=logger, environ=environ) == "copy"
    assert environ == {NEUTRAL: "copy"} and f"{NEUTRAL}=copy for the vLLM engine's processes" in caplog.text
    environ = {}
    assert set_vllm_env("fp32out", key="k", where="server", logger=logger, environ=environ) == "1"
    assert environ == {NRL: "1"}  # the name every fp32patch release's patched vLLM files read
    with pytest.raises(Fp32LmHeadConfigError, match=rf'{NEUTRAL}="1" in this process but k is off'):
        set_vllm_env(None, key="k", where="server", logger=logger, environ={NEUTRAL: "1"})


def test_a_probe_verdict_names_the_name_the_worker_had():
    report = {"dtype": "bfloat16", "env": "0", "env_name": NEUTRAL, "way": "off", "host": "h", "pid": 1}
    said = disagreement(3, report, expect_fp32=True, asking="k='fp32out'", switch=NRL, key="k")
    assert (
        said
        == f"vLLM worker 3 (host h, pid 1) computes bfloat16 logits while k='fp32out': {NEUTRAL} is '0' in that process"
    )
    unset = {**report, "env": None, "env_name": None}
    said = disagreement(3, unset, expect_fp32=True, asking="k='fp32out'", switch=NRL, key="k")
    assert said.endswith(f"{NRL} is unset in that process")  # the stack's documented name
