"""Layer 1: the GEMMs and kernels every head and fused path computes with.

``fp32out``: bf16 operands, fp32 output (``torch.mm(out_dtype=float32)`` on CUDA, an exact
upcast elsewhere) and the pieces of its backward; ``lm_head_gemm``: the head's GEMM in every
trainer mode as one autograd function; ``fp16_scale_triton``: fused conversions of fp32out's
backward on CUDA; ``matmul_precision``: TF32 on or off for a block. Imports no engine.
"""
