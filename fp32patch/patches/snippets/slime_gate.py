def _fp32patch_asked(value):
    """Whether --fp32-lm-head asks for the fp32 LM head: anything but unset, "false", "no", "0" or "" (else the stock code runs, fp32patch unimported)."""
    if value is None or value is False:
        return False
    return str(value).strip().lower() not in ("", "false", "no", "0")


def _fp32patch_runtime(where):
    """fp32patch's slime runtime; a command line that asks for it where fp32patch is missing is an error."""
    try:
        import fp32patch.runtime.slime as runtime
    except ImportError as exc:
        import sys

        raise RuntimeError(
            f"{where}: this slime run asks for fp32patch's fp32 LM head (--fp32-lm-head, or SGLang's "
            f"--sglang-enable-fp32-lm-head), but fp32patch cannot be imported by {sys.executable} ({exc}). "
            "Install fp32patch into the environment slime's actors and rollout servers run in, or drop those options."
        ) from exc
    return runtime


def _fp32patch_spelled_like_ours(argv):
    """Whether the command line holds an option spelled like --fp32-lm-head that is not it (a parser drops it silently)."""
    for token in argv:
        name = str(token).split("=", 1)[0]
        plain = name.lower().replace("-", "").replace("_", "")
        if name.startswith("-") and name not in ("--fp32-lm-head", "--sglang-enable-fp32-lm-head"):
            if "fp32" in plain and "head" in plain:
                return True
    return False


def _fp32patch_check_args(args):
    """fp32patch's guard, where the command line asks for the fp32 LM head, turns an fp32 head on in SGLang (its flag, a model override, DSpark's variable), or misspells ours."""
    import os
    import sys

    if (
        _fp32patch_asked(getattr(args, "fp32_lm_head", None))
        or getattr(args, "sglang_enable_fp32_lm_head", False)
        or "lm_head" in str(getattr(args, "sglang_json_model_override_args", None) or "")
        or os.environ.get("SGLANG_DSPARK_FP32_LM_HEAD", "").strip().lower() in ("1", "true", "yes", "on")
        or _fp32patch_spelled_like_ours(sys.argv[1:])
    ):
        _fp32patch_runtime("parse_args").check_args(args, where="parse_args")


def _fp32patch_wire_model(model, args, role):
    """The Megatron chunks get_model returned, with fp32patch's fp32 output layer where --fp32-lm-head asks."""
    if _fp32patch_asked(getattr(args, "fp32_lm_head", None)):
        return _fp32patch_runtime(f"slime {role}").wire_model(model, args, role=role)
    return model


def _fp32patch_server_args(kwargs, args, server_args_cls, overrides=None):
    """SGLang's server arguments with its own enable_fp32_lm_head from --fp32-lm-head (overrides: the server group's own, from --sglang-config)."""
    if _fp32patch_asked(getattr(args, "fp32_lm_head", None)) or kwargs.get("enable_fp32_lm_head"):
        where = "SGLang rollout server"
        return _fp32patch_runtime(where).server_args(kwargs, args, server_args_cls, where=where, overrides=overrides)
    return kwargs


def _fp32patch_probe_engine(engine):
    """fp32patch's startup probe of the SGLang server this engine launched or reached, where --fp32-lm-head asks."""
    if _fp32patch_asked(getattr(engine.args, "fp32_lm_head", None)):
        _fp32patch_runtime("SGLang rollout server").probe_engine(engine)
