def _fp32patch_asked(value):
    """Whether fp32_lm_head asks for the fp32 LM head: anything but false, null, "" or TRL's command-line spellings of false (else the stock code runs, fp32patch unimported)."""
    if value is None or value is False:
        return False
    return str(value).strip().lower() not in ("", "false", "no", "f", "n", "0")


def _fp32patch_env_asked(environ=None):
    """Whether vLLM's switch (FP32PATCH_VLLM_LM_HEAD or NRL_VLLM_FP32_LM_HEAD) in this process, or in environ, asks vLLM for fp32 logits."""
    import os

    environ = os.environ if environ is None else environ
    names = ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD")
    return any(str(environ.get(name, "")).strip() not in ("", "0") for name in names)


def _fp32patch_runtime(where):
    """fp32patch's TRL runtime; a config that asks for it where fp32patch is missing is an error."""
    try:
        import fp32patch.runtime.trl as runtime
    except ImportError as exc:
        import sys

        raise RuntimeError(
            f"{where}: this TRL run asks for fp32patch's fp32 LM head (fp32_lm_head, or vLLM's switch "
            f"FP32PATCH_VLLM_LM_HEAD / NRL_VLLM_FP32_LM_HEAD), but fp32patch cannot be imported by {sys.executable} "
            f"({exc}). Install fp32patch into this environment, or drop those settings."
        ) from exc
    return runtime


def _fp32patch_mode(model):
    """The fp32 LM-head mode fp32patch's wiring left on this model (its policy or reference model), or None."""
    return getattr(model, "_fp32patch_lm_head", None)


def _fp32patch_check_trainer(trainer, path):
    """fp32patch's guard, where the trainer's config asks for an fp32 LM head (fp32_lm_head, cast_lm_head_to_fp32) or vLLM's switch is on."""
    args = trainer.args
    if (
        _fp32patch_asked(getattr(args, "fp32_lm_head", None))
        or getattr(args, "cast_lm_head_to_fp32", False)
        or _fp32patch_env_asked()
    ):
        _fp32patch_runtime(type(trainer).__name__).check_trainer(trainer, path)


def _fp32patch_wire_trainer(trainer, path):
    """The policy's and the reference model's fp32 LM head, where fp32_lm_head asks for it."""
    if _fp32patch_asked(getattr(trainer.args, "fp32_lm_head", None)):
        _fp32patch_runtime(type(trainer).__name__).wire_trainer(trainer, path)


def _fp32patch_fused_kernel(model, stock):
    """The chunked log-prob kernel for this model: fp32patch's, where its wiring marked the model, else TRL's own."""
    if _fp32patch_mode(model) is None:
        return stock
    return _fp32patch_runtime("fused log-probs").fused_kernel(model)


def _fp32patch_vllm_env(model):
    """vLLM's switch in this process before a colocated vLLM is built, from the trainer's fp32_lm_head."""
    if _fp32patch_mode(model) is not None or _fp32patch_env_asked():
        _fp32patch_runtime("colocated vLLM").set_vllm_env(model, where="colocated vLLM")


def _fp32patch_probe_colocated(llm, model):
    """fp32patch's startup probe of the colocated vLLM's model, where fp32_lm_head is on."""
    if _fp32patch_mode(model) is not None:
        _fp32patch_runtime("colocated vLLM").probe_colocated(llm, model)


def _fp32patch_probe_server(client, model):
    """fp32patch's startup probe of every worker of the vLLM server, where fp32_lm_head is on."""
    if _fp32patch_mode(model) is not None:
        _fp32patch_runtime("vLLM server").probe_server(client, model)


def _fp32patch_serve(script_args, command, env):
    """trl vllm-serve's command line and environment for fp32 LM heads, where --fp32_lm_head (or vLLM's switch) asks."""
    if _fp32patch_asked(getattr(script_args, "fp32_lm_head", None)) or _fp32patch_env_asked(env):
        return _fp32patch_runtime("trl vllm-serve").serve_command(script_args, command, env)
    return command
