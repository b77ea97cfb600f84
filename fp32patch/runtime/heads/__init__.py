"""Layer 2: the engine heads, computed with ``kernels``.

``vllm``: fp32 logits for every vLLM model across every refit (the patched vLLM files call
it); ``vllm_probe``: what a loaded vLLM model's head computes, measured inside its worker;
``megatron``: Megatron-Core's output layer; ``hf``: a PyTorch / Hugging Face ``nn.Linear`` head
under FSDP1/2 and tensor parallelism. No stack's config is read here.
"""
