"""Runtime used by patched upstream code and by trainers.

Nothing here imports torch, vLLM or Megatron at module import; each function imports
what it needs when called, so the CLI and the patched files stay importable anywhere.
This package never imports ``fp32patch.patcher``.
"""
