def _fp32patch_sglang_fp32_logits(hidden_states, weight):
    """SGLang's enable_fp32_lm_head product through fp32patch: torch.mm(..., out_dtype=torch.float32) on CUDA with bf16/fp16 operands (no fp32 copy of the weight), elsewhere the exact upcast; where fp32patch cannot be imported, SGLang's own upcast."""
    try:
        from fp32patch.runtime.heads.sglang import fp32_logits
    except ImportError:
        import torch

        return torch.matmul(hidden_states.to(torch.float32), weight.to(torch.float32).T)
    return fp32_logits(hidden_states, weight)
