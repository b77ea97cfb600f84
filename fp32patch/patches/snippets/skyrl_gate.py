def _fp32patch_asked(value):
    """Whether trainer.fp32_lm_head asks for the fp32 LM head: anything but absent, false, "" or a spelling of false (else the stock code runs, fp32patch unimported)."""
    if value is None or value is False:
        return False
    return str(value).strip().lower() not in ("", "false", "no", "f", "n", "0", "off")


def _fp32patch_env_asked():
    """Whether vLLM's switch (FP32PATCH_VLLM_LM_HEAD or NRL_VLLM_FP32_LM_HEAD) in this process asks vLLM for fp32 logits."""
    import os

    names = ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD")
    return any(str(os.environ.get(name, "")).strip() not in ("", "0") for name in names)


def _fp32patch_key(cfg):
    """trainer.fp32_lm_head of a SkyRL config (the whole config, or its trainer section)."""
    trainer = getattr(cfg, "trainer", cfg)
    return getattr(trainer, "fp32_lm_head", None)


def _fp32patch_runtime(where):
    """fp32patch's SkyRL runtime; a run that asks for it where fp32patch is missing is an error."""
    try:
        import fp32patch.runtime.skyrl as runtime
    except ImportError as exc:
        import sys

        raise RuntimeError(
            f"{where}: this SkyRL run asks for fp32patch's fp32 LM head (trainer.fp32_lm_head, or vLLM's switch "
            f"FP32PATCH_VLLM_LM_HEAD / NRL_VLLM_FP32_LM_HEAD), but fp32patch cannot be imported by {sys.executable} "
            f"({exc}). Install fp32patch into this environment, or drop those settings."
        ) from exc
    return runtime


def _fp32patch_check_config(cfg):
    """fp32patch's guard on SkyRL's config, where trainer.fp32_lm_head or vLLM's switch asks for an fp32 LM head."""
    if _fp32patch_asked(_fp32patch_key(cfg)) or _fp32patch_env_asked():
        _fp32patch_runtime("validate_cfg").check_config(cfg)


def _fp32patch_engine_args(args, cfg):
    """vLLM's own head_dtype float32 in the server's arguments, where trainer.fp32_lm_head asks."""
    if _fp32patch_asked(_fp32patch_key(cfg)):
        _fp32patch_runtime("build_vllm_cli_args").engine_args(args, cfg)


def _fp32patch_probe_servers(cfg, server_urls):
    """fp32patch's startup probe of every vLLM server's workers, where trainer.fp32_lm_head asks."""
    if _fp32patch_asked(_fp32patch_key(cfg)):
        _fp32patch_runtime("build_new_inference_client").probe_servers(cfg, server_urls)


def _fp32patch_wire(wrapper, cfg, role):
    """The fp32 LM head and chunked log-probs for this HFModelWrapper (policy or reference), where trainer.fp32_lm_head asks."""
    if _fp32patch_asked(_fp32patch_key(cfg)):
        _fp32patch_runtime(role).wire_hf(wrapper, cfg, role=role)


def _fp32patch_wire_megatron(wrapper):
    """The fp32 output layer for this MegatronModelWrapper's model chunks, where trainer.fp32_lm_head asks."""
    if _fp32patch_asked(_fp32patch_key(wrapper.cfg)):
        _fp32patch_runtime("MegatronModelWrapper").wire_megatron(wrapper)


def _fp32patch_model(wrapper, targets, temperature, log_probs, entropy):
    """The model HFModelWrapper.forward calls: its own, unless fp32patch's wiring marked the wrapper."""
    if getattr(wrapper, "_fp32patch_lm_head", None) is None:
        return wrapper.model
    return _fp32patch_runtime("HFModelWrapper.forward").model_call(wrapper, targets, temperature, log_probs, entropy)


def _fp32patch_log_probs_fn(wrapper, stock):
    """logprobs_from_logits for HFModelWrapper.forward: SkyRL's own, unless fp32patch's wiring marked the wrapper."""
    if getattr(wrapper, "_fp32patch_lm_head", None) is None:
        return stock
    return _fp32patch_runtime("HFModelWrapper.forward").log_probs_fn(stock)


def _fp32patch_entropy_fn(wrapper, stock):
    """The entropy function HFModelWrapper.forward calls: SkyRL's own, unless fp32patch's wiring marked the wrapper."""
    if getattr(wrapper, "_fp32patch_lm_head", None) is None:
        return stock
    return _fp32patch_runtime("HFModelWrapper.forward").entropy_fn(stock)


def _fp32patch_fused_runtime(weight):
    """fp32patch's SkyRL runtime where weight is a Megatron head fp32patch wired; None: SkyRL's own fused code runs. fp32patch is never imported here: a head can only be wired where something imported it already."""
    import sys

    runtime = sys.modules.get("fp32patch.runtime.skyrl")
    if runtime is None or runtime.fused_mode(weight) is None:
        return None
    return runtime


def _fp32patch_scaled_weight(weight, temperature):
    """weight / temperature, as SkyRL's fused LM-head path divides the weight; a head fp32patch wired keeps its weight, and the temperature divides its fp32 logits instead."""
    runtime = _fp32patch_fused_runtime(weight)
    if runtime is None:
        return weight / temperature
    return runtime.scaled_weight(weight, temperature)


def _fp32patch_fused_logprobs(hidden, weight, target, vocab_start, tp_group, inference_only, chunk_size):
    """The fused LM-head path's token log-probs from fp32patch's fp32 head where weight is one it wired; None: SkyRL's own kernel runs."""
    runtime = _fp32patch_fused_runtime(weight)
    if runtime is None:
        return None
    return runtime.fused_logprobs(hidden, weight, target, vocab_start, tp_group, inference_only, chunk_size)


def _fp32patch_fused_entropy(hidden, weight, tp_group, temperature):
    """The fused LM-head path's entropy from fp32patch's fp32 head where weight is one it wired; None: SkyRL's own code runs."""
    runtime = _fp32patch_fused_runtime(weight)
    if runtime is None:
        return None
    return runtime.fused_entropy(hidden, weight, tp_group, temperature)
