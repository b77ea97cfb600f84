"""fp32patch: fp32 LM-head logits for NeMo-RL, patched into vLLM at image-build time.

The patcher (``fp32patch.patcher``, driven by the ``fp32patch`` CLI) rewrites upstream
source files from declarative specs; the runtime (``fp32patch.runtime``) is what the
patched code and trainers call. Importing this package imports neither torch nor vLLM.
"""

__version__ = "0.1.0"
