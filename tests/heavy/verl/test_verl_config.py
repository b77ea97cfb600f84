"""The key through verl's own configuration: Hydra composes verl's ``ppo_trainer`` config with
the key on the command line, verl's ``validate_config`` (patched: fp32patch's guard first)
checks it, and verl's ``omega_conf_to_dataclass`` builds the ``HFModelConfig`` the actor, the
ref and the rollout servers are handed.

The stock tree refuses the key (``HFModelConfig`` has no such field); the patched tree takes
it with Hydra's ``+``, refuses it without (the error names the ``+`` spelling), refuses a
misspelt key, and refuses, each with its message, what would leave one side bf16.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from verl_harness import REPO, patched_root, save_tiny_qwen2, use_tree

KEY = "actor_rollout_ref.model.fp32_lm_head"
ON = f"+{KEY}=fp32out"


def overrides(model_dir) -> list[str]:
    """What a minimal command line sets: the model, the rollout, the micro-batch sizes verl
    requires without dynamic batch sizes."""
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.rollout.name=vllm",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
    ]


# composes the config, validates it and builds HFModelConfig, printing the key's value
SCRIPT = textwrap.dedent(
    """
    import os, sys
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        config = compose("ppo_trainer", overrides=sys.argv[1:])
    validate_config(config, use_reference_policy=True, use_critic=False)
    model = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    print("fp32_lm_head:", repr(getattr(model, "fp32_lm_head", "<no field>")))
    print("fp32patch imported:", any(name.startswith("fp32patch") for name in sys.modules))
    """
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("verl-config") / "tiny"
    save_tiny_qwen2(path)
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return patched_root(tmp_path_factory.mktemp("verl-config-tree"))


def verl_run(root, *args: str) -> subprocess.CompletedProcess:
    """SCRIPT in a fresh interpreter, importing verl from ``root`` (None: the environment's)."""
    path = [str(REPO)] if root is None else [str(root), str(REPO)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "HYDRA_FULL_ERROR": "1"}
    env.pop("NRL_VLLM_FP32_LM_HEAD", None)
    return subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env, timeout=300)


def accepted(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def refused(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0, result.stdout
    return result.stderr


def test_the_stock_tree_refuses_the_key(model_dir):
    """Why the patch adds a field: verl's HFModelConfig takes no key it does not declare."""
    err = refused(verl_run(None, ON, *overrides(model_dir)))
    assert "unexpected keyword argument 'fp32_lm_head'" in err


def test_the_patched_tree_takes_the_key_and_hands_it_to_HFModelConfig(root, model_dir):
    out = accepted(verl_run(root, ON, *overrides(model_dir)))
    assert "fp32_lm_head: 'fp32out'" in out
    assert "fp32patch imported: True" in out


@pytest.mark.parametrize(("value", "seen"), [("true", "True"), ("fp32", "'fp32'"), ("fp32out-hilo", "'fp32out-hilo'")])
def test_other_values_pass_through(root, model_dir, value, seen):
    out = accepted(verl_run(root, f"+{KEY}={value}", *overrides(model_dir)))
    assert f"fp32_lm_head: {seen}" in out


def test_without_the_key_the_stock_path_runs_and_fp32patch_stays_unimported(root, model_dir):
    out = accepted(verl_run(root, *overrides(model_dir)))
    assert "fp32_lm_head: False" in out
    assert "fp32patch imported: False" in out


def test_without_the_plus_hydra_names_the_plus_spelling(root, model_dir):
    err = refused(verl_run(root, f"{KEY}=fp32out", *overrides(model_dir)))
    assert f"+{KEY}=fp32out" in err


def test_a_misspelt_key_is_refused(root, model_dir):
    err = refused(verl_run(root, "+actor_rollout_ref.model.fp32_lm_haed=fp32out", *overrides(model_dir)))
    assert "fp32_lm_haed" in err


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["actor_rollout_ref.rollout.name=trtllm"], "actor_rollout_ref.rollout.name is 'trtllm'"),
        (["actor_rollout_ref.actor.strategy=veomni"], "actor_rollout_ref.actor.strategy is 'veomni'"),
        (["actor_rollout_ref.model.lora_rank=8"], "LoRA adapter on the vLLM rollout (rank 8)"),
    ],
)
def test_what_would_leave_one_side_bf16_is_refused_with_its_message(root, model_dir, extra, message):
    err = refused(verl_run(root, ON, *overrides(model_dir), *extra))
    assert "Fp32LmHeadConfigError" in err and message in err


def test_an_invalid_value_is_refused_with_the_valid_ones(root, model_dir):
    err = refused(verl_run(root, f"+{KEY}=fp64", *overrides(model_dir)))
    assert "Fp32LmHeadConfigError" in err and "'fp64'" in err and "fp32out" in err


@pytest.mark.parametrize("backend", ["torch", "liger", "triton"])
def test_the_fused_kernels_are_accepted(root, model_dir, backend):
    # fp32patch computes their log-probs on the wired head (tests/heavy/verl/test_verl_fused.py)
    extra = [
        "actor_rollout_ref.model.use_fused_kernels=true",
        f"actor_rollout_ref.model.fused_kernel_options.impl_backend={backend}",
    ]
    assert "fp32_lm_head: 'fp32out'" in accepted(verl_run(root, ON, *overrides(model_dir), *extra))


def test_the_variable_alone_is_refused(root, model_dir):
    err = refused(
        verl_run(root, *overrides(model_dir), "+ray_kwargs.ray_init.runtime_env.env_vars.NRL_VLLM_FP32_LM_HEAD=1")
    )
    assert "Fp32LmHeadConfigError" in err and f"{KEY} is off" in err


def test_in_process_the_patched_validate_config_is_the_one_imported(root):
    """The subprocesses above import verl from the patched root: the guard's call is there."""
    use_tree(str(root))
    try:
        import inspect

        from verl.utils import config

        assert "_fp32patch_check_config(config)" in inspect.getsource(config.validate_config)
    finally:
        use_tree(None)
