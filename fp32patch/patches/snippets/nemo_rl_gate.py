def _fp32patch_get(section, key):
    """``section[key]`` of a dict-like config, or the attribute of a pydantic one; None if absent."""
    if section is None:
        return None
    if hasattr(section, "keys") and hasattr(section, "get"):
        return section.get(key)
    return getattr(section, key, None)


def _fp32patch_asked(policy_cfg=None, generation_cfg=None):
    """Whether this NeMo-RL config asks for fp32patch (else the stock code runs, fp32patch unimported).

    It asks when policy.megatron_cfg or policy.dtensor_cfg holds an fp32 LM-head key, spelled
    right or nearly so (the runtime names the right key), or megatron_cfg holds
    fp32_residual_connection; when generation.vllm_cfg.fp32_lm_head is set and true; or when
    vLLM's switch, NRL_VLLM_FP32_LM_HEAD or FP32PATCH_VLLM_LM_HEAD (generation.vllm_cfg.env_vars,
    else this process's environment), is set to anything but "" or "0".
    """
    import os

    for name in ("megatron_cfg", "dtensor_cfg"):
        section = _fp32patch_get(policy_cfg, name)
        keys = section.keys() if hasattr(section, "keys") else vars(section) if hasattr(section, "__dict__") else ()
        for key in keys:
            folded = str(key).lower().replace("_", "").replace("-", "")
            if folded.startswith("fp32") and "lm" in folded and "head" in folded:
                return True
            if name == "megatron_cfg" and folded == "fp32residualconnection":
                return True
    if generation_cfg is None:
        generation_cfg = _fp32patch_get(policy_cfg, "generation")
    vllm_cfg = _fp32patch_get(generation_cfg, "vllm_cfg")
    switch = _fp32patch_get(vllm_cfg, "fp32_lm_head")
    if switch is not None and switch is not False and str(switch).strip().lower() not in ("", "0", "false"):
        return True
    env_vars = _fp32patch_get(vllm_cfg, "env_vars")
    for name in ("NRL_VLLM_FP32_LM_HEAD", "FP32PATCH_VLLM_LM_HEAD"):
        for value in (_fp32patch_get(env_vars, name), os.environ.get(name)):
            if value is not None and str(value).strip() not in ("", "0"):
                return True
    return False


def _fp32patch_runtime(where):
    """fp32patch's NeMo-RL runtime; a config that asks for it in a venv without fp32patch is an error."""
    try:
        import fp32patch.runtime.nemo_rl as runtime
    except ImportError as exc:
        import sys

        raise RuntimeError(
            f"{where}: this NeMo-RL config asks for fp32patch's fp32 LM head (a policy.megatron_cfg.fp32_* or "
            "policy.dtensor_cfg.fp32_lm_head key, generation.vllm_cfg.fp32_lm_head, or NRL_VLLM_FP32_LM_HEAD / "
            "FP32PATCH_VLLM_LM_HEAD), "
            f"but fp32patch cannot be imported by {sys.executable} ({exc}). "
            "NeMo-RL runs each actor in its own venv: install fp32patch into every one of them, or drop "
            "those settings."
        ) from exc
    return runtime


def _fp32patch_check_config(policy_cfg, where, megatron_head="fp32patch"):
    """Refuse a config that gives fp32 logits to one engine only (fp32patch's guard), where it asks.
    ``megatron_head``: "upstream" where NeMo-RL gives Megatron its own fp32 head (its rework)."""
    if _fp32patch_asked(policy_cfg):
        _fp32patch_runtime(where).check_config(policy_cfg, where=where, megatron_head=megatron_head)


def _fp32patch_wire_megatron(model, policy_cfg):
    """The Megatron model chunks with fp32patch's fp32 output layer where the config asks for it."""
    if not _fp32patch_asked(policy_cfg):
        return model
    return _fp32patch_runtime("megatron worker").wire_megatron(model, _fp32patch_get(policy_cfg, "megatron_cfg"))


def _fp32patch_rank():
    """This worker's global rank as NeMo-RL's worker group sets it (RANK), also before torch.distributed starts."""
    import os

    return os.environ.get("RANK", "?")


def _fp32patch_wire_dtensor(model, policy_cfg):
    """The DTensor worker's Hugging Face model with fp32patch's fp32 LM head where the config asks for it.

    A reward model (policy.reward_model_cfg.enabled, as the workers themselves tell) has no LM
    head: it keeps its stock head, with no error.
    """
    if not _fp32patch_asked(policy_cfg):
        return model
    reward = _fp32patch_get(_fp32patch_get(policy_cfg, "reward_model_cfg"), "enabled")
    return _fp32patch_runtime("dtensor worker").wire_dtensor(
        model, _fp32patch_get(policy_cfg, "dtensor_cfg"), reward_model=bool(reward)
    )


def _fp32patch_probe_vllm(generation):
    """Ask every vLLM worker for the dtype of its logits; refuse to go on where one disagrees.

    The driver's vLLM generation holds only the generation config: the workers are held to
    the vLLM switch it sets (generation.vllm_cfg.fp32_lm_head, else the variable), and
    the guard in the policy holds that switch to the trainer's.
    """
    cfg = generation.cfg
    if not _fp32patch_asked(generation_cfg=cfg):
        return
    import os

    import ray

    runtime = _fp32patch_runtime("driver")
    vllm_cfg = _fp32patch_get(cfg, "vllm_cfg")
    switch = _fp32patch_get(vllm_cfg, "fp32_lm_head")
    if switch is not None:  # vLLM's own key (the guard holds the variable, if also set, to it)
        on = switch is True
        asked_by = f"policy.generation.vllm_cfg.fp32_lm_head={switch!r}"
    else:
        env_vars = _fp32patch_get(vllm_cfg, "env_vars")
        named = [(n, _fp32patch_get(env_vars, n)) for n in ("NRL_VLLM_FP32_LM_HEAD", "FP32PATCH_VLLM_LM_HEAD")]
        name, value = next(((n, v) for n, v in named if v is not None), (None, None))
        source = "policy.generation.vllm_cfg.env_vars"
        if value is None:
            named = [(n, os.environ.get(n, "")) for n in ("NRL_VLLM_FP32_LM_HEAD", "FP32PATCH_VLLM_LM_HEAD")]
            name, value = next(((n, v) for n, v in named if v.strip()), ("NRL_VLLM_FP32_LM_HEAD", None))
            source = "the driver's environment"
        on = value is not None and str(value).strip() not in ("", "0")
        asked_by = f"{name}={str(value)!r} in {source}"
    # the driver knows the vLLM switch; the guard's verdict in this process names the trainer's
    expected = "fp32" if on else None
    method = "fp32patch_probe_lm_head_async" if _fp32patch_get(vllm_cfg, "async_engine") else "fp32patch_probe_lm_head"
    futures = generation.worker_group.run_all_workers_single_data(
        method, run_rank_0_only_axes=["tensor_parallel", "pipeline_parallel"]
    )
    # one list of reports per engine; the runtime flattens them in order and names each worker
    runtime.check_probe_reports(ray.get(futures), expected, where="driver", asked_by=asked_by)


def _fp32patch_vllm_switch(config):
    """NRL_VLLM_FP32_LM_HEAD=1 in this vLLM generation worker when generation.vllm_cfg.fp32_lm_head
    is true (or "tf32", upstream's alias of true) and the variable is unset, before the engine
    starts (NeMo-RL sets it so itself since its September 2026 rework); the guard has held the
    two spellings to each other."""
    import os

    names = ("NRL_VLLM_FP32_LM_HEAD", "FP32PATCH_VLLM_LM_HEAD")
    if _fp32patch_get(_fp32patch_get(config, "vllm_cfg"), "fp32_lm_head") in (True, "tf32"):
        if not any(os.environ.get(name, "").strip() for name in names):
            os.environ["NRL_VLLM_FP32_LM_HEAD"] = "1"


def _fp32patch_manages_vllm(get_vllm_file):
    """Whether fp32patch's vLLM patches are in this vLLM (a marker in nemotron_h.py or in
    logits_processor.py): then they give every model fp32 logits, and NeMo-RL's own worker-start
    edit of nemotron_h.py would put a second fp32 route into a file fp32patch manages."""
    for relative in ("model_executor/models/nemotron_h.py", "model_executor/layers/logits_processor.py"):
        try:
            with open(get_vllm_file(relative), encoding="utf-8") as f:
                if "# fp32patch: " in f.read():
                    return True
        except (RuntimeError, OSError):
            continue
    return False


def _fp32patch_loaded():
    """fp32patch's NeMo-RL runtime where this process has imported it already (a config asked for
    it, and only then can a model be wired), else None; never imports it."""
    import sys

    return sys.modules.get("fp32patch.runtime.nemo_rl")


def _fp32patch_fused_logprobs(model, hidden_states, labels):
    """NeMo-RL's fused log-probs at fp32 grade, where the model's output layer gives fp32 logits
    (fp32patch's wiring, or NeMo-RL's own logit_dtype); None: the stock fused path runs."""
    runtime = _fp32patch_loaded()
    return None if runtime is None else runtime.fused_logprobs(model, hidden_states, labels)


def _fp32patch_fused_temperature(sampling_params):
    """The training temperature, for fp32patch's fused log-probs to apply to the fp32 logits."""
    runtime = _fp32patch_loaded()
    if runtime is not None:
        runtime.fused_temperature(sampling_params)


def _fp32patch_temperature_applied(logits, sampling_params):
    """Whether ``logits`` are fp32patch's fused log-probs, whose logits the temperature has divided
    already (NeMo-RL's own fused path has it divide the log-probs instead)."""
    if getattr(logits, "_fp32patch_temperature", None) is None:
        return False
    _fp32patch_runtime("megatron worker").check_fused_temperature(logits, sampling_params)
    return True


def _fp32patch_without_fused(config):
    """``config`` as NeMo-RL's own fp32 LM-head check (after its rework) is to see it once
    fp32patch's guard has passed it: without the fused log-prob switch, which upstream refuses
    with its fp32 head and fp32patch computes at fp32 grade. The caller's config is not changed."""
    names = ("use_fused_linear_logprobs", "use_linear_ce_fusion_loss")
    megatron_cfg = _fp32patch_get(config, "megatron_cfg")
    if not hasattr(megatron_cfg, "items") or not any(_fp32patch_get(megatron_cfg, n) for n in names):
        return config
    trimmed = {key: value for key, value in megatron_cfg.items() if key not in names}
    return {**dict(config.items()), "megatron_cfg": trimmed}
