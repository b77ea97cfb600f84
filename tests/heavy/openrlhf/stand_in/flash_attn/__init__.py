"""A test-only stand-in for flash-attn, for tests/heavy/openrlhf (never installed, never shipped).

flash-attn (a CUDA build) is a hard dependency of every OpenRLHF release, and
``openrlhf/models/ring_attn_utils.py`` imports it at module load, which pulls it into
``openrlhf.models`` and everything above it. This folder goes on ``PYTHONPATH`` in the suite's
processes only, and gives what that import names: ``bert_padding``'s packing helpers
(``unpad_input``, ``pad_input``, ``index_first_axis``, ``rearrange``), written here for the CPU
with torch's indexing, and ``utils.distributed.all_gather``. Nothing else of flash-attn exists
here: its attention kernels (the model runs torch's SDPA), its Triton cross-entropy (OpenRLHF's
``log_probs_from_logits`` then takes its own chunked-logsumexp branch: an ImportError is what it
catches) and ring attention (``ring_flash_attn``) are left untested by the suite.
"""

__version__ = "0+fp32patch.test.stand.in"
