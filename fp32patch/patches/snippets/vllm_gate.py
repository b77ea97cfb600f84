def _fp32patch_lm_head_runtime():
    """fp32patch's vLLM LM-head runtime when NRL_VLLM_FP32_LM_HEAD asks for it, else None."""
    import os

    mode = os.environ.get("NRL_VLLM_FP32_LM_HEAD", "").strip()
    if mode in ("", "0"):
        return None
    try:
        from fp32patch.runtime import vllm_lm_head
    except ImportError as exc:
        raise RuntimeError(
            f"NRL_VLLM_FP32_LM_HEAD={mode!r} asks for fp32 LM-head logits, but fp32patch "
            f"cannot be imported in this interpreter ({exc}). Install fp32patch into the "
            "environment that runs vLLM, or unset NRL_VLLM_FP32_LM_HEAD."
        ) from exc
    return vllm_lm_head
