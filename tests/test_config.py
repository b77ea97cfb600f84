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
    dtensor: dict | None = None,
    vllm: object = _UNSET,
    **extra: object,
) -> dict:
    """A NeMo-RL policy section with just the keys the guard reads (``dtensor``: its
    ``dtensor_cfg``; ``vllm``: ``generation.vllm_cfg.fp32_lm_head``; ``extra``: policy keys)."""
    megatron: dict = {}
    if enabled is not _UNSET:
        megatron["enabled"] = enabled
    if fp32_lm_head is not _UNSET:
        megatron["fp32_lm_head"] = fp32_lm_head
    if fused is not _UNSET:
        megatron["use_fused_linear_logprobs"] = fused
    vllm_cfg: dict = {"async_engine": False}
    if vllm is not _UNSET:
        vllm_cfg["fp32_lm_head"] = vllm
    if env is not _UNSET:
        vllm_cfg["env_vars"] = {"NCCL_CUMEM_ENABLE": "1", VAR: env}
    generation: dict = {"vllm_cfg": vllm_cfg}
    if backend is not None:
        generation["backend"] = backend
    out = {"megatron_cfg": megatron, "generation": generation, **extra}
    if dtensor is not None:
        out["dtensor_cfg"] = dtensor
    return out


def dtensor(mode: object = _UNSET, **cfg: object) -> dict:
    """A DTensor policy: ``dtensor_cfg`` enabled, Megatron disabled (NeMo-RL's recipes)."""
    section: dict = {"enabled": True, "_v2": True, **cfg}
    if mode is not _UNSET:
        section["fp32_lm_head"] = mode
    return section


DT = Fp32LmHeadSettings


def dt(mode: str | None, vllm: str | None, **kw: object) -> Fp32LmHeadSettings:
    return Fp32LmHeadSettings(None, vllm, dtensor=mode, **kw)


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
    # the fused log-prob path: fp32patch's patched fused forward computes it at fp32 grade
    pytest.param(policy(True, "1", fused=True), Fp32LmHeadSettings("fp32", "1"), id="fused-logprobs"),
    pytest.param(
        policy("fp32out", "1", fused=True, backend="megatron"),
        Fp32LmHeadSettings("fp32out", None),
        id="fused-logprobs-any-backend",
    ),
    pytest.param(
        {
            **policy("fp32out", vllm=True),
            "megatron_cfg": {"fp32_lm_head": "fp32out", "use_linear_ce_fusion_loss": True},
        },
        Fp32LmHeadSettings("fp32out", "1"),
        id="fused-logprobs-before-july-2026",
    ),
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
    # DTensor (v1 and v2): its own switch, held to vLLM's.
    pytest.param(policy(enabled=False, dtensor=dtensor("fp32out"), vllm=True), dt("fp32out", "1"), id="dt-fp32out"),
    pytest.param(policy(enabled=False, dtensor=dtensor(True), env="copy"), dt("fp32", "copy"), id="dt-true-env"),
    pytest.param(policy(dtensor=dtensor("tf32", _v2=False), vllm=True), dt("tf32", "1"), id="dt-v1"),
    pytest.param(policy(enabled=False, dtensor=dtensor(False), vllm=False), dt(None, "0"), id="dt-both-off"),
    pytest.param(policy(enabled=False, dtensor=dtensor()), dt(None, None), id="dt-unset"),
    pytest.param(
        policy(enabled=False, dtensor={"fp32_lm_head": "fp32out"}, vllm=True), dt("fp32out", "1"), id="dt-no-enabled"
    ),
    # vLLM's switch as upstream NeMo-RL spells it since 2026-08-31, with Megatron.
    pytest.param(policy(True, vllm=True), Fp32LmHeadSettings("fp32", "1"), id="vllm-key-true"),
    pytest.param(policy(False, vllm=False), Fp32LmHeadSettings(None, "0"), id="vllm-key-false"),
    pytest.param(policy(vllm=None), Fp32LmHeadSettings(None, None), id="vllm-key-null"),
    # both spellings, agreeing: the variable may name the way
    pytest.param(policy(True, "copy", vllm=True), Fp32LmHeadSettings("fp32", "copy"), id="both-spellings"),
    pytest.param(policy(False, "0", vllm=False), Fp32LmHeadSettings(None, "0"), id="both-spellings-off"),
    # one side alone, asked for explicitly
    pytest.param(
        policy(enabled=False, dtensor=dtensor(), vllm=True, allow_one_sided_fp32_lm_head=True),
        dt(None, "1", one_sided=True),
        id="one-sided-vllm-only",
    ),
    pytest.param(
        policy("fp32out", allow_one_sided_fp32_lm_head=True),
        Fp32LmHeadSettings("fp32out", None, one_sided=True),
        id="one-sided-trainer-only",
    ),
    pytest.param(
        policy("fp32out", "1", allow_one_sided_fp32_lm_head=True),
        Fp32LmHeadSettings("fp32out", "1"),
        id="opt-in-unused",
    ),
]


@pytest.mark.parametrize(("cfg", "expected"), VALID)
def test_valid_configs_pass_and_say_what_they_ask_for(cfg: dict, expected: Fp32LmHeadSettings):
    assert validate_fp32_lm_head_config(cfg, environ={}) == expected


# (policy, fragments the message must contain): each rule, each way to break it.
INVALID = [
    # One engine alone.
    pytest.param(
        policy(True), ["megatron_cfg.fp32_lm_head", "is not set", "vllm_cfg.fp32_lm_head to true"], id="meg-only"
    ),
    pytest.param(policy("fp32out", "0"), ["fp32_lm_head is 'fp32out'", 'is "0"'], id="meg-vllm-0"),
    pytest.param(policy("tf32", 0), ['is "0"', "trainer only", "1.035"], id="meg-vllm-int-0"),
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
    # Paths that never run the fp32 head.
    pytest.param(policy(True, "1", enabled=False), ["megatron_cfg.enabled is False"], id="megatron-disabled"),
    # DTensor.
    pytest.param(
        policy(enabled=False, dtensor=dtensor("fp32out")),
        ["dtensor_cfg.fp32_lm_head is 'fp32out'", "is not set", "trainer only", "allow_one_sided_fp32_lm_head: true"],
        id="dt-only",
    ),
    pytest.param(
        policy(enabled=False, dtensor=dtensor(), vllm=True),
        ["vllm_cfg.fp32_lm_head is true but", "dtensor_cfg.fp32_lm_head is off", "vLLM only", "1.01444"],
        id="vllm-only-on-dtensor",
    ),
    pytest.param(
        policy("fp32out", "1", dtensor=dtensor()),
        ["megatron_cfg.fp32_lm_head is on but the policy trains with DTensor", "Move the switch to dtensor_cfg"],
        id="switch-under-the-disabled-megatron",
    ),
    pytest.param(
        policy(enabled=True, dtensor=dtensor("fp32out", enabled=False), vllm=True),
        ["dtensor_cfg.fp32_lm_head is on but the policy trains with Megatron", "megatron_cfg.fp32_lm_head"],
        id="switch-under-the-disabled-dtensor",
    ),
    pytest.param(
        policy(dtensor=dtensor("fp32out", enabled=False), vllm=True),
        ["dtensor_cfg.fp32_lm_head is on but dtensor_cfg.enabled is False"],
        id="dtensor-disabled",
    ),
    pytest.param(
        policy("fp32out", vllm=True, dtensor={"fp32_lm_head": "fp32out"}),
        ["both megatron_cfg.fp32_lm_head and dtensor_cfg.fp32_lm_head are on"],
        id="both-trainers-unsaid",
    ),
    pytest.param(
        policy(enabled=False, dtensor=dtensor("TF32"), vllm=True),
        ["dtensor_cfg.fp32_lm_head = 'TF32' is not valid", 'did you mean "tf32"'],
        id="dt-TF32",
    ),
    pytest.param(
        policy(enabled=False, dtensor=dtensor(fp32_lm_heads="fp32out"), vllm=True),
        ["dtensor_cfg.fp32_lm_heads is not a key", "did you mean dtensor_cfg.fp32_lm_head?"],
        id="dt-near-miss",
    ),
    # vLLM's key.
    pytest.param(
        policy(True, vllm="true"), ["vllm_cfg.fp32_lm_head = 'true' is not valid", "without quotes"], id="vk-str"
    ),
    pytest.param(policy(True, vllm=1), ["vllm_cfg.fp32_lm_head = 1 is not valid"], id="vk-int"),
    pytest.param(policy(True, vllm="TF32"), ["'TF32' is not valid", 'valid values: false, true, "tf32"'], id="vk-TF32"),
    pytest.param(
        policy(True, vllm="copy"), ["'copy' is not valid; valid", "NRL_VLLM_FP32_LM_HEAD's to choose"], id="vk-way"
    ),
    pytest.param(
        policy(True, "0", vllm=True),
        ["vllm_cfg.fp32_lm_head = True and", "env_vars.NRL_VLLM_FP32_LM_HEAD = '0' disagree"],
        id="two-spellings-disagree",
    ),
    pytest.param(
        policy(True, vllm=True, generation_fp32_lm_head=True),
        ["generation_fp32_lm_head is in the wrong place"],
        id="vk-wrong-place",
    ),
    # the opt-in must be a boolean
    pytest.param(
        policy(True, allow_one_sided_fp32_lm_head="yes"),
        ["allow_one_sided_fp32_lm_head = 'yes' is not valid", "without quotes"],
        id="opt-in-str",
    ),
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


def test_a_near_miss_of_vllms_key_names_it():
    cfg = policy(True)
    cfg["generation"]["vllm_cfg"]["fp32_lm_heads"] = True
    with pytest.raises(
        Fp32LmHeadConfigError,
        match=r"generation.vllm_cfg.fp32_lm_heads is not a key .* did you mean generation.vllm_cfg.fp32_lm_head\?",
    ):
        validate_fp32_lm_head_config(cfg, environ={})


def test_the_older_vllm_spelling_works_and_names_the_new_key():
    settings = validate_fp32_lm_head_config(policy("fp32out", "copy"), environ={})
    assert settings == Fp32LmHeadSettings("fp32out", "copy")
    (note,) = settings.notes
    assert "env_vars.NRL_VLLM_FP32_LM_HEAD is the older spelling" in note
    assert "generation.vllm_cfg.fp32_lm_head: true instead" in note
    assert 'keep NRL_VLLM_FP32_LM_HEAD="copy" beside it to choose that way' in note
    (note,) = validate_fp32_lm_head_config(policy(False, "0"), environ={}).notes
    assert "generation.vllm_cfg.fp32_lm_head: false instead" in note and "choose that way" not in note
    assert validate_fp32_lm_head_config(policy("fp32out", vllm=True), environ={}).notes == ()


@pytest.mark.parametrize("trainer", ["tf32", True, "fp32out"])
def test_vllms_key_takes_upstreams_tf32_alias_of_true_and_says_what_vllm_runs(trainer):
    # newest upstream NeMo-RL accepts "tf32" for vllm_cfg.fp32_lm_head as an alias of true
    settings = validate_fp32_lm_head_config(policy(trainer, vllm="tf32"), environ={})
    assert settings == Fp32LmHeadSettings(trainer if trainer is not True else "fp32", "1")
    (note,) = settings.notes
    assert 'vllm_cfg.fp32_lm_head = "tf32" is read as true' in note and "not a TF32 GEMM" in note
    # held to the older spelling like true is
    assert validate_fp32_lm_head_config(policy(trainer, "copy", vllm="tf32"), environ={}).vllm == "copy"
    with pytest.raises(Fp32LmHeadConfigError, match="disagree"):
        validate_fp32_lm_head_config(policy(trainer, "0", vllm="tf32"), environ={})
    # and one-sided like true is
    with pytest.raises(Fp32LmHeadConfigError, match="vLLM only"):
        validate_fp32_lm_head_config(policy(False, vllm="tf32"), environ={})


def test_the_driver_environment_is_not_read_where_vllms_key_decides():
    assert validate_fp32_lm_head_config(policy(False, vllm=False), environ={VAR: "1"}) == Fp32LmHeadSettings(None, "0")


def test_one_side_alone_warns_with_the_measurement():
    cfg = policy(enabled=False, dtensor=dtensor(), vllm=True, allow_one_sided_fp32_lm_head=True)
    settings = validate_fp32_lm_head_config(cfg, environ={})
    assert settings.one_sided and settings.vllm_on and settings.trainer is None
    (warning,) = settings.notes
    assert "accepted by allow_one_sided_fp32_lm_head" in warning
    assert "bench/RESULTS.md" in warning and "1.01391" in warning and "1.035" in warning


def test_the_trainer_settings_name_the_backend():
    settings = validate_fp32_lm_head_config(policy(enabled=False, dtensor=dtensor("fp32out"), vllm=True), environ={})
    assert (settings.trainer, settings.trainer_key) == ("fp32out", "policy.dtensor_cfg.fp32_lm_head")
    settings = validate_fp32_lm_head_config(policy("tf32", vllm=True), environ={})
    assert (settings.trainer, settings.trainer_key) == ("tf32", "policy.megatron_cfg.fp32_lm_head")


# ---------------------------------------------------------------- the fused path, patched or not


@pytest.mark.parametrize(
    ("module", "upstream", "ours"),
    [
        ("nemo_rl.distributed.model_utils", "_gpt_forward_with_linear_ce_fusion", "_fp32patch_fused_logprobs"),
        ("nemo_rl.models.megatron.train", "apply_temperature_scaling", "_fp32patch_temperature_applied"),
    ],
)
@pytest.mark.parametrize("key", ["use_fused_linear_logprobs", "use_linear_ce_fusion_loss"])
def test_the_fused_path_is_refused_where_this_process_imported_it_unpatched(monkeypatch, module, upstream, ours, key):
    import sys
    from types import ModuleType

    cfg = policy("fp32out", vllm=True)
    cfg["megatron_cfg"][key] = True
    stock = ModuleType(module)
    stock.__file__ = f"/opt/nemo-rl/{module.replace('.', '/')}.py"
    setattr(stock, upstream, lambda *args: None)
    monkeypatch.setitem(sys.modules, module, stock)
    with pytest.raises(Fp32LmHeadConfigError) as raised:
        validate_fp32_lm_head_config(cfg)
    message = str(raised.value)
    assert f"megatron_cfg.{key}" in message and stock.__file__ in message and "not patched by fp32patch" in message
    assert "Run fp32patch apply" in message
    setattr(stock, ours, lambda *args: None)  # what fp32patch's gate defines in the patched file
    assert validate_fp32_lm_head_config(cfg) == Fp32LmHeadSettings("fp32out", "1")
    # with the head off, the fused path is NeMo-RL's own business
    cfg["megatron_cfg"]["fp32_lm_head"] = False
    cfg["generation"]["vllm_cfg"]["fp32_lm_head"] = False
    delattr(stock, ours)
    assert validate_fp32_lm_head_config(cfg).megatron is None
