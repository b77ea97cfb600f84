def _fp32patch_lm_head_runtime():
    """fp32patch's vLLM LM-head runtime when vLLM's switch (either of its names) asks for it, else None."""
    import os

    asked = []
    for name in ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD"):
        if os.environ.get(name, "").strip() not in ("", "0"):
            asked.append(f"{name}={os.environ[name].strip()!r}")
    if not asked:
        return None
    try:
        from fp32patch.runtime import vllm_lm_head
    except ImportError as exc:
        message = f"{' and '.join(asked)} asks for fp32 LM-head logits, but fp32patch cannot be imported in this "
        message += f"interpreter ({exc}). Install fp32patch into the environment that runs vLLM, or unset the variable."
        raise RuntimeError(message) from exc
    return vllm_lm_head
