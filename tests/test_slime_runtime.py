"""slime's glue (fp32patch.runtime.slime) on its own: the guard's rules over slime's parsed
arguments and command line, the wiring's refusals, each server's arguments and the startup probe
through kit.sglang (HTTP calls stood in by recorded answers). The patched files calling them run
in test_slime_patch.py; the Megatron side for real in tests/heavy/megatron/test_slime_step.py."""

from __future__ import annotations

import logging
from argparse import Namespace

import pytest

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.slime import check_args, probe_engine, server_args, validate_fp32_lm_head_config, wire_model
from tests.fixtures.slime_shapes import OldServerArgs, ServerArgs, sglang_http


def slime_args(flag=None, **extra) -> Namespace:
    """slime's namespace after parse_args, with SGLang 0.5.15's options merged in."""
    values = dict(
        fp32_lm_head=flag,
        train_backend="megatron",
        debug_rollout_only=False,
        debug_train_only=False,
        load_debug_rollout_data=None,
        rollout_external=False,
        rollout_external_engine_addrs=None,
        use_critic=False,
        custom_model_provider_path=None,
        hf_checkpoint="/models/qwen",
        sglang_enable_fp32_lm_head=False,
        sglang_rl_on_policy_target=None,
        sglang_quantization=None,
        sglang_lora_target_modules=None,
        sglang_json_model_override_args="{}",
    )
    values.update(extra)
    return Namespace(**values)


def refused(args: Namespace, argv=(), match: str | None = None) -> str:
    with pytest.raises(Fp32LmHeadConfigError, match=match) as caught:
        validate_fp32_lm_head_config(args, argv=list(argv))
    return str(caught.value)


@pytest.mark.parametrize(
    ("flag", "mode"), [(None, None), ("false", None), ("true", "fp32"), ("fp32out", "fp32out"), ("tf32", "tf32")]
)
def test_the_flag_names_the_mode(flag, mode):
    settings = validate_fp32_lm_head_config(slime_args(flag), argv=[])
    assert (settings.mode, settings.sglang, settings.external) == (mode, mode is not None, False)


@pytest.mark.parametrize(("flag", "hint"), [("FP32OUT", 'did you mean "fp32out"'), ("fp32-out", "valid values")])
def test_a_bad_value_is_refused_with_the_valid_ones(flag, hint):
    message = refused(slime_args(flag), match="--fp32-lm-head")
    assert hint in message and "fp32out-bf16grad" in message


@pytest.mark.parametrize("spelled", ["--fp32_lm_head", "--fp32-lm-heads", "--fp32-lmhead=fp32out", "--FP32-LM-HEAD"])
def test_a_misspelt_flag_is_refused_not_dropped(spelled):
    """slime's Megatron parser drops an option nobody registered: the flag would be off silently."""
    message = refused(slime_args(None), argv=[spelled, "fp32out"], match="is not an option")
    assert "did you mean --fp32-lm-head" in message


def test_options_of_the_namespace_are_not_near_misses():
    argv = ["--fp32-lm-head", "fp32out", "--sglang-enable-fp32-lm-head", "--fp16-lm-cross-entropy"]
    args = slime_args("fp32out", fp16_lm_cross_entropy=False)
    assert validate_fp32_lm_head_config(args, argv=argv).mode == "fp32out"


def test_sglang_flag_alone_is_one_sided():
    message = refused(slime_args(None, sglang_enable_fp32_lm_head=True), match="--sglang-enable-fp32-lm-head is on")
    assert "Megatron bf16" in message and "--fp32-lm-head fp32out" in message


def test_an_sglang_without_the_flag_is_refused():
    args = slime_args("fp32out")
    del args.sglang_enable_fp32_lm_head
    refused(args, match="this SGLang has no --enable-fp32-lm-head")


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ({"sglang_rl_on_policy_target": "fsdp"}, "rl_on_policy_target='fsdp'"),
        ({"sglang_lora_target_modules": ["q_proj", "lm_head"]}, "lora_target_modules holds lm_head"),
    ],
)
def test_sglang_settings_that_undo_its_flag_are_refused(setting, words):
    message = refused(slime_args("fp32out", **setting), match="do not follow --fp32-lm-head")
    assert words in message and message.count("fp32patch (") == 0  # the guard names the caller, once


SGLANG_CONFIG = """
sglang:
  - name: actor
    server_groups:
      - worker_type: regular
        num_gpus: 4
        overrides:
{overrides}
      - worker_type: placeholder
        num_gpus: 4
"""


@pytest.mark.parametrize(
    ("flag", "overrides", "words"),
    [
        ("fp32out", "          enable-fp32-lm-head: false", "enable_fp32_lm_head is False"),
        ("fp32out", "          rl_on_policy_target: fsdp", "rl_on_policy_target='fsdp'"),
        (None, "          enable_fp32_lm_head: true", "--fp32-lm-head is off"),
    ],
)
def test_sglang_config_groups_are_held_to_the_flag_before_anything_starts(tmp_path, flag, overrides, words):
    path = tmp_path / "sglang.yaml"
    path.write_text(SGLANG_CONFIG.format(overrides=overrides))
    message = refused(slime_args(flag, sglang_config=str(path)))
    assert message.startswith(f"--sglang-config {path}, model 'actor', server group 0 (regular): ")
    assert words in message


def test_sglang_config_groups_that_follow_the_flag_pass(tmp_path):
    path = tmp_path / "sglang.yaml"
    path.write_text(SGLANG_CONFIG.format(overrides="          mem_fraction_static: 0.7"))
    assert validate_fp32_lm_head_config(slime_args("fp32out", sglang_config=str(path)), argv=[]).sglang


def test_a_model_override_turning_sglang_fp32_alone_is_refused():
    args = slime_args(None, sglang_json_model_override_args='{"enable_lm_head_fp32": true}')
    refused(args, match="enable_lm_head_fp32")


def test_notes_for_what_the_guard_cannot_settle():
    args = slime_args(
        "fp32out",
        sglang_quantization="fp8",
        use_critic=True,
        custom_model_provider_path="my.provider",
        rollout_external=True,
    )
    settings = validate_fp32_lm_head_config(args, argv=[])
    assert (settings.sglang, settings.external) == (False, True)
    text = "\n".join(settings.notes)
    for words in ("quantization='fp8'", "critic keeps its value head", "my.provider", "external SGLang engines"):
        assert words in text


def test_debug_modes_run_one_engine_with_a_note():
    args = slime_args("fp32out", debug_train_only=True)
    del args.sglang_enable_fp32_lm_head  # SGLang's options are not parsed then
    settings = validate_fp32_lm_head_config(args, argv=[])
    assert settings.sglang is False and "without a rollout" in settings.notes[0]
    settings = validate_fp32_lm_head_config(slime_args("fp32out", debug_rollout_only=True), argv=[])
    assert settings.trainer is False and settings.sglang is True


def test_check_args_names_the_caller_and_logs(caplog):
    caplog.set_level(logging.INFO, logger="slime.fp32patch")
    with pytest.raises(Fp32LmHeadConfigError, match=r"^fp32patch \(parse_args\): --sglang-enable"):
        check_args(slime_args(None, sglang_enable_fp32_lm_head=True), argv=[])
    check_args(slime_args("fp32out"), argv=[])
    assert "--fp32-lm-head='fp32out': Megatron's output layer" in caplog.text


# ---------------------------------------------------------------- wiring


class NoHead:
    """A custom provider's model that claims the last stage but has no output_layer."""

    post_process = True


def test_a_provider_fp32patch_cannot_wire_is_refused_naming_it():
    args = slime_args("fp32out", custom_model_provider_path="team.models.provider")
    with pytest.raises(Fp32LmHeadConfigError, match="--custom-model-provider-path team.models.provider") as caught:
        wire_model([NoHead()], args, role="actor")
    assert "no output_layer" in str(caught.value)


def test_off_and_the_critic_leave_the_model_alone():
    model = [NoHead()]
    assert wire_model(model, slime_args(None), role="actor") is model
    assert wire_model(model, slime_args("fp32out"), role="critic") is model


# ---------------------------------------------------------------- each server's arguments


def test_server_args_turn_sglang_flag_on():
    kwargs = {"model_path": "/m", "tp_size": 1}
    assert server_args(kwargs, slime_args("fp32out"), ServerArgs, where="s")["enable_fp32_lm_head"] is True
    assert server_args({"tp_size": 1}, slime_args(None), ServerArgs, where="s") == {"tp_size": 1}


@pytest.mark.parametrize(
    ("flag", "kwargs", "cls", "match"),
    [
        ("fp32out", {}, OldServerArgs, "has no enable_fp32_lm_head"),
        ("fp32out", {"enable_fp32_lm_head": False}, ServerArgs, "the two disagree"),  # a --sglang-config override
        (None, {"enable_fp32_lm_head": True}, ServerArgs, "--fp32-lm-head is off"),
        ("fp32out", {"rl_on_policy_target": "fsdp"}, ServerArgs, "rl_on_policy_target"),
    ],
)
def test_server_args_refusals(flag, kwargs, cls, match):
    with pytest.raises(Fp32LmHeadConfigError, match=match):
        server_args(dict(kwargs), slime_args(flag), cls, where="SGLang rollout server", overrides=kwargs)


def test_the_command_lines_default_false_is_no_choice():
    """slime copies --sglang-enable-fp32-lm-head's store_true default (False) into every server's arguments."""
    kwargs = server_args({"enable_fp32_lm_head": False}, slime_args("fp32out"), ServerArgs, where="s", overrides={})
    assert kwargs["enable_fp32_lm_head"] is True


# ---------------------------------------------------------------- the startup probe


class Engine(Namespace):
    """slime's SGLangEngine after init: where its server listens."""


def engine(flag="fp32out", **extra) -> Engine:
    base = dict(args=slime_args(flag), rank=0, worker_type="regular", node_rank=0, server_host="10.0.0.7")
    return Engine(**{**base, "server_port": 30001, **extra})


def http(flag: bool, grid: float | None):
    asked: list = []
    get, post = sglang_http(asked, flag=flag, grid=grid)
    return get, post, asked


def urls(asked: list) -> list[str]:
    return [url for _, url, _ in asked]


def test_the_probe_passes_an_fp32_server():
    get, post, asked = http(True, None)
    [report] = probe_engine(engine(), get=get, post=post)
    assert report["dtype"] == "float32" and urls(asked) == [
        "http://10.0.0.7:30001/server_info",
        "http://10.0.0.7:30001/generate",
    ]


def test_the_probe_refuses_a_server_whose_log_probs_are_bf16():
    get, post, _ = http(True, 2.0**-5)  # logits ~8: bf16's grid there
    with pytest.raises(Fp32LmHeadMismatchError, match="SGLang server http://10.0.0.7:30001") as caught:
        probe_engine(engine(), get=get, post=post)
    assert "bf16's grid" in str(caught.value)


@pytest.mark.parametrize("grid", [2.0**-5, None])
def test_the_probe_refuses_an_external_server_started_without_the_flag(grid):
    """bf16 log-probs measured, or none measured but nothing read asks for fp32 (a soft-capped head)."""
    get, post, _ = http(False, grid)
    with pytest.raises(Fp32LmHeadMismatchError, match="computes bfloat16 log-probs") as caught:
        probe_engine(engine(rollout_external=True), get=get, post=post)
    assert grid or "enable_fp32_lm_head is False" in str(caught.value)


def test_the_probe_skips_servers_without_http_or_logits_and_reads_paired_ones():
    get, post, asked = http(True, None)
    assert probe_engine(engine(node_rank=1), get=get, post=post) == []
    assert probe_engine(engine(worker_type="encoder"), get=get, post=post) == []
    assert probe_engine(engine(sglang_overrides={"is-embedding": True}), get=get, post=post) == []
    [report] = probe_engine(engine(worker_type="prefill"), get=get, post=post)
    assert report["dtype"] == "float32" and urls(asked) == ["http://10.0.0.7:30001/server_info"]
