def _fp32patch_get(section, key):
    """``section[key]`` of a dict-like config (a DictConfig, verl's HFModelConfig), else its attribute; None if absent."""
    if section is None:
        return None
    if hasattr(section, "keys") and hasattr(section, "get"):
        return section.get(key)
    return getattr(section, key, None)


def _fp32patch_asked(model_config):
    """Whether actor_rollout_ref.model.fp32_lm_head is set to anything but false, null or "" (else the stock code runs, fp32patch unimported)."""
    value = _fp32patch_get(model_config, "fp32_lm_head")
    return value is not None and value is not False and str(value).strip() != ""


def _fp32patch_env_asked():
    """Whether vLLM's switch in this process (FP32PATCH_VLLM_LM_HEAD or NRL_VLLM_FP32_LM_HEAD) asks vLLM for fp32 logits."""
    import os

    names = ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD")
    return any(os.environ.get(name, "").strip() not in ("", "0") for name in names)


def _fp32patch_runtime(where):
    """fp32patch's verl runtime; a config that asks for it where fp32patch is missing is an error."""
    try:
        import fp32patch.runtime.verl as runtime
    except ImportError as exc:
        import sys

        raise RuntimeError(
            f"{where}: this verl config asks for fp32patch's fp32 LM head (actor_rollout_ref.model.fp32_lm_head, or "
            f"vLLM's switch FP32PATCH_VLLM_LM_HEAD / NRL_VLLM_FP32_LM_HEAD), but fp32patch cannot be imported by {sys.executable} ({exc}). Install fp32patch "
            "into the environment verl's workers and rollout servers run in, or drop those settings."
        ) from exc
    return runtime


def _fp32patch_check_config(config):
    """fp32patch's guard, where the config asks for the fp32 LM head or turns one engine's own switch on."""
    arr = _fp32patch_get(config, "actor_rollout_ref")
    rollout = _fp32patch_get(arr, "rollout")
    sglang = _fp32patch_get(_fp32patch_get(rollout, "engine_kwargs"), "sglang")
    env_vars = config
    for key in ("ray_kwargs", "ray_init", "runtime_env", "env_vars"):
        env_vars = _fp32patch_get(env_vars, key)
    variables = [_fp32patch_get(env_vars, name) for name in ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD")]
    if (
        _fp32patch_asked(_fp32patch_get(arr, "model"))
        or _fp32patch_env_asked()
        or _fp32patch_get(sglang, "enable_fp32_lm_head")
        or any(str(v if v is not None else "").strip() not in ("", "0") for v in variables)
    ):
        _fp32patch_runtime("validate_config").check_config(config, where="validate_config")


def _fp32patch_wire_hf(module, model_config, role):
    """The actor's or the ref's FSDP-wrapped HF module with fp32patch's fp32 LM head, where the key asks for it."""
    if not _fp32patch_asked(model_config):
        return module
    return _fp32patch_runtime(f"verl {role}").wire_hf(module, model_config, role=role)


def _fp32patch_wire_megatron(modules, model_config, role):
    """The actor's or the ref's Megatron chunks with fp32patch's fp32 output layer, where the key asks for it."""
    if not _fp32patch_asked(model_config):
        return modules
    return _fp32patch_runtime(f"verl {role}").wire_megatron(modules, model_config, role=role)


def _fp32patch_vllm_env(model_config, where):
    """vLLM's switch in this process from the key, before vLLM's engine and its workers start."""
    if _fp32patch_asked(model_config) or _fp32patch_env_asked():
        _fp32patch_runtime(where).set_vllm_env(model_config, where=where)


async def _fp32patch_probe_server(engine_client, model_config, where):
    """fp32patch's startup probe: every vLLM worker of this engine computes the logits the key asks for."""
    if _fp32patch_asked(model_config):
        await _fp32patch_runtime(where).probe_server(engine_client, model_config, where=where)


def _fp32patch_sglang_args(args, model_config, server_args_cls):
    """SGLang's server arguments with its own enable_fp32_lm_head from the key."""
    if _fp32patch_asked(model_config) or args.get("enable_fp32_lm_head"):
        where = "SGLang rollout server"
        return _fp32patch_runtime(where).sglang_args(args, model_config, server_args_cls, where=where)
    return args


async def _fp32patch_probe_sglang(tokenizer_manager, model_config, where):
    """fp32patch's startup probe: this SGLang server computes the logits the key asks for."""
    if _fp32patch_asked(model_config):
        await _fp32patch_runtime(where).probe_sglang(tokenizer_manager, model_config, where=where)


def _fp32patch_probe_model(model, model_config, where):
    """fp32patch's startup probe of a vLLM model loaded in this process."""
    if _fp32patch_asked(model_config):
        _fp32patch_runtime(where).probe_model(model, model_config, where=where)


def _fp32patch_fused_logprobs(hidden, weight, targets, temperature, backend, reduction="none", group=None):
    """fp32patch's log-probs and entropy of verl's fused path where ``weight`` is an LM head
    fp32patch wired; None: verl's own kernel runs. fp32patch is never imported here: a head can
    only be wired where something imported it already."""
    import sys

    runtime = sys.modules.get("fp32patch.runtime.verl")
    if runtime is None:
        return None
    return runtime.fused_logprobs(
        hidden, weight, targets, temperature, backend=backend, reduction=reduction, group=group
    )


def _fp32patch_linear_cross_entropy(stock):
    """verl's linear_cross_entropy (the triton backend's kernel) with fp32patch's fused log-probs
    where the weight is an LM head fp32patch wired, shaped as the kernel's (flat)."""

    def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None):
        ours = _fp32patch_fused_logprobs(hidden, weight, labels, temperature, "triton", reduction, dist_process_group)
        if ours is None:
            return stock(hidden, weight, labels, temperature, reduction, dist_process_group)
        return ours[0].reshape(-1), ours[1].reshape(-1)

    return linear_cross_entropy
