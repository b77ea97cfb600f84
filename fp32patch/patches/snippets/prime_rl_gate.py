def _fp32patch_off(value):
    """Whether trainer.model.fp32_lm_head is an explicit off: false, or a string spelling of it."""
    if value is False:
        return True
    return isinstance(value, str) and value.strip().lower() in ("", "false", "no", "0", "off")


def _fp32patch_env_asked(*mappings):
    """Whether vLLM's switch (FP32PATCH_VLLM_LM_HEAD or NRL_VLLM_FP32_LM_HEAD) asks for fp32 logits, here or in ``mappings`` (a config's env_vars)."""
    import os

    names = ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD")
    for source in (os.environ, *mappings):
        if any(str((source or {}).get(name, "")).strip() not in ("", "0") for name in names):
            return True
    return False


def _fp32patch_runtime(where):
    """fp32patch's Prime-RL runtime; a run that asks for it where fp32patch is missing is an error."""
    try:
        import fp32patch.runtime.prime_rl as runtime
    except ImportError as exc:
        import sys

        raise RuntimeError(
            f"{where}: this Prime-RL run computes the LM head's logits in fp32 (inference.enable_fp32_lm_head, "
            f"default true, or trainer.model.fp32_lm_head), which this patched Prime-RL does on both sides with "
            f"fp32patch, but fp32patch cannot be imported by {sys.executable} ({exc}). Install fp32patch into "
            "Prime-RL's environment, or set inference.enable_fp32_lm_head = false (both sides bf16)."
        ) from exc
    return runtime


def _fp32patch_rl_config(config):
    """The rl launcher's config: trainer.model.fp32_lm_head follows inference.enable_fp32_lm_head, and fp32patch's guard runs, unless every route to an fp32 head is off."""
    inference = getattr(config, "inference", None)
    model = config.trainer.model
    value = getattr(model, "fp32_lm_head", None)
    env_vars = (getattr(config, "env_vars", None), getattr(inference, "env_vars", None))
    off = value is not None and _fp32patch_off(value)
    if (
        (inference is None and not off)
        or getattr(inference, "enable_fp32_lm_head", False)
        or not (value is None or off)
        or _fp32patch_env_asked(*env_vars)
        or "32" in str(getattr(getattr(inference, "vllm", None), "head_dtype", None))
    ):
        return _fp32patch_runtime("rl config").check_rl_config(config, where="rl config")
    if value is None:
        model.fp32_lm_head = False  # Prime-RL's switch is off: so is the trainer's, in the trainer.json written
    return config


def _fp32patch_wire_trainer(model, config):
    """The RL trainer's model with fp32patch's forward on its LM head, unless trainer.model.fp32_lm_head is off."""
    value = getattr(config.model, "fp32_lm_head", None)
    if value is not None and _fp32patch_off(value):
        return model
    return _fp32patch_runtime("trainer").wire_trainer(model, config, where="trainer")


async def _fp32patch_probe_workers(engine_client, args):
    """fp32patch's startup probe of every vLLM worker, where Prime-RL's switch or vLLM's variable asks for fp32 logits."""
    extra = getattr(args, "additional_config", None)
    if (isinstance(extra, dict) and extra.get("fp32_lm_head")) or _fp32patch_env_asked():
        await _fp32patch_runtime("inference server").probe_workers(engine_client, args, where="inference server")
