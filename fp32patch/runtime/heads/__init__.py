"""Layer 2: the engine heads, computed with ``kernels``.

``vllm``: fp32 logits for every vLLM model across every refit (the patched vLLM files call
it); ``vllm_probe``: what a loaded vLLM model's head computes, measured inside its worker;
``sglang``: SGLang 0.5.3-0.5.17's own fp32 head (``enable_fp32_lm_head``) at fp32out cost;
``megatron``: Megatron-Core's output layer; ``hf``: a PyTorch / Hugging Face ``nn.Linear`` head
under FSDP1/2 and tensor parallelism. No stack's config is read here.
"""
