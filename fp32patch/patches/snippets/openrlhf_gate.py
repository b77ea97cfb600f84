def _fp32patch_asked(value):
    """Whether --fp32_lm_head asks for the fp32 LM head: anything but absent, false, "" or a command line's spellings of false (else the stock code runs, fp32patch unimported)."""
    if value is None or value is False:
        return False
    return str(value).strip().lower() not in ("", "false", "no", "f", "n", "0", "off")


def _fp32patch_env_asked():
    """Whether vLLM's switch (FP32PATCH_VLLM_LM_HEAD or NRL_VLLM_FP32_LM_HEAD) in this process asks vLLM for fp32 logits."""
    import os

    names = ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD")
    return any(str(os.environ.get(name, "")).strip() not in ("", "0") for name in names)


def _fp32patch_runtime(where):
    """fp32patch's OpenRLHF runtime; a run that asks for it where fp32patch is missing is an error."""
    try:
        import fp32patch.runtime.openrlhf as runtime
    except ImportError as exc:
        import sys

        raise RuntimeError(
            f"{where}: this OpenRLHF run asks for fp32patch's fp32 LM head (--fp32_lm_head, or vLLM's switch "
            f"FP32PATCH_VLLM_LM_HEAD / NRL_VLLM_FP32_LM_HEAD), but fp32patch cannot be imported by {sys.executable} "
            f"({exc}). Install fp32patch into this environment, or drop those settings."
        ) from exc
    return runtime


def _fp32patch_check_args(args):
    """fp32patch's guard on train_ppo_ray's arguments, where --fp32_lm_head or vLLM's switch asks for an fp32 LM head."""
    if _fp32patch_asked(getattr(args, "fp32_lm_head", None)) or _fp32patch_env_asked():
        _fp32patch_runtime("train_ppo_ray").check_config(args)


def _fp32patch_wire(actor, args, role):
    """The fp32 LM head and chunked log-probs for this Actor (policy, reference or EMA model), where --fp32_lm_head asks."""
    if _fp32patch_asked(getattr(args, "fp32_lm_head", None)):
        _fp32patch_runtime(role).wire_actor(actor, args, role=role)


def _fp32patch_model(actor, targets, log_probs, entropy, entropy_after_temperature):
    """The model Actor.forward calls: its own, unless fp32patch's wiring marked the actor."""
    if getattr(actor, "_fp32patch_lm_head", None) is None:
        return actor.model
    return _fp32patch_runtime("Actor.forward").model_call(
        actor, targets, log_probs, entropy, entropy_after_temperature=entropy_after_temperature
    )


def _fp32patch_log_probs_fn(actor, stock):
    """log_probs_from_logits for Actor.forward: OpenRLHF's own, unless fp32patch's wiring marked the actor."""
    if getattr(actor, "_fp32patch_lm_head", None) is None:
        return stock
    return _fp32patch_runtime("Actor.forward").log_probs_fn(stock)


def _fp32patch_entropy_fn(actor, stock):
    """compute_entropy for Actor.forward: OpenRLHF's own, unless fp32patch's wiring marked the actor."""
    if getattr(actor, "_fp32patch_lm_head", None) is None:
        return stock
    return _fp32patch_runtime("Actor.forward").entropy_fn(stock)


def _fp32patch_rollout_on():
    """Whether this driver's guard ran (--fp32_lm_head was asked for), or vLLM's switch is on here."""
    import sys

    return "fp32patch.runtime.openrlhf" in sys.modules or _fp32patch_env_asked()


def _fp32patch_engine_options(actor_cls, actor_kwargs):
    """The vLLM engine actor's .options: Ray's own, or with vLLM's fp32 head turned on where the guard asked."""
    if not _fp32patch_rollout_on():
        return actor_cls.options
    return _fp32patch_runtime("create_vllm_engines").engine_options(actor_cls, actor_kwargs)


def _fp32patch_probe_engines(engines):
    """fp32patch's startup probe of every vLLM engine's workers, where the guard asked for the fp32 LM head."""
    if _fp32patch_rollout_on():
        _fp32patch_runtime("create_vllm_engines").probe_engines(engines)
