def _fp32patch_engine_asked(engine_config):
    """Whether a trainer engine's config (actor, ref, critic) turns enable_fp32_lm_head on in one of its backend sections."""
    for section in ("megatron", "fsdp", "archon"):
        if getattr(getattr(engine_config, section, None), "enable_fp32_lm_head", False) is True:
            return True
    return False


def _fp32patch_config_asked(config):
    """Whether an experiment config asks for fp32patch (a trainer engine's enable_fp32_lm_head), or vLLM's or SGLang's own fp32 switch is on in this process (else the stock code runs, fp32patch unimported)."""
    import os

    for name in ("actor", "ref", "critic"):
        if _fp32patch_engine_asked(getattr(config, name, None)):
            return True
    for variable in ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD", "SGLANG_DSPARK_FP32_LM_HEAD"):
        if os.environ.get(variable, "").strip() not in ("", "0"):
            return True
    return False


def _fp32patch_runtime(where):
    """fp32patch's AReaL runtime; a config that asks for it where fp32patch is missing is an error."""
    try:
        import fp32patch.runtime.areal as runtime
    except ImportError as exc:
        import sys

        raise RuntimeError(
            f"{where}: this AReaL config asks for fp32patch's fp32 LM head (enable_fp32_lm_head), but fp32patch "
            f"cannot be imported by {sys.executable} ({exc}). Install fp32patch into the environment AReaL's "
            "trainer and rollout workers run in, or set enable_fp32_lm_head to false."
        ) from exc
    return runtime


def _fp32patch_check_config(config):
    """fp32patch's guard, once the experiment config is loaded, where it asks for the fp32 LM head."""
    if _fp32patch_config_asked(config):
        _fp32patch_runtime("load_expr_config").check_config(config, where="load_expr_config")


def _fp32patch_wire_fsdp(engine):
    """fp32patch's fp32 LM head on an FSDP engine's model, once FSDP2 has wrapped it, where its config asks."""
    if _fp32patch_engine_asked(engine.config):
        _fp32patch_runtime("FSDPEngine").wire_engine(engine, trainer="fsdp")


def _fp32patch_wire_megatron(engine):
    """fp32patch's fp32 output layer on a Megatron engine's model chunks, where its config asks."""
    if _fp32patch_engine_asked(engine.config):
        _fp32patch_runtime("MegatronEngine").wire_engine(engine, trainer="megatron")


def _fp32patch_precision_args(original):
    """AReaL's mbridge precision arguments without mbridge's own fp32 LM head: fp32patch's output layer takes its place."""

    def precision_args(enable_chunked_logits, enable_fp32_lm_head, *args, **kwargs):
        return original(enable_chunked_logits, False, *args, **kwargs)

    return precision_args


def _fp32patch_their_head(original):
    """AReaL's own fp32 output-layer forward, stepping aside where enable_fp32_lm_head is on: fp32patch wires the model in MegatronEngine.initialize."""

    def enable_forward(models, *, enabled):
        if enabled:
            return 0
        return original(models, enabled=enabled)

    return enable_forward


def _fp32patch_server_args(server_args, config, backend):
    """A rollout server's arguments with its engine's fp32 LM head on, where the actor's enable_fp32_lm_head asks."""
    if _fp32patch_engine_asked(getattr(config, "actor", None)):
        return _fp32patch_runtime(f"{backend} rollout server").server_args(server_args, config, backend)
    return server_args


def _fp32patch_probe_rollout(controller, config, backend, role):
    """fp32patch's startup probe of the rollout servers the controller started, where the actor's enable_fp32_lm_head asks."""
    if _fp32patch_engine_asked(getattr(config, "actor", None)):
        _fp32patch_runtime(f"{backend} rollout servers").probe_rollout(controller, config, backend, role=role)
