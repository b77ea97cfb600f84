"""Runtime used by patched upstream code and by trainers.

Three layers, each a folder, each importing only the ones below it:

- ``kernels/``: the GEMMs and kernels (``fp32out``, ``lm_head_gemm`` and its backward, the
  Triton conversions, the chunked fused log-probs);
- ``heads/``: the engine heads (vLLM's, every model and every refit, and the probe's
  measurement inside a vLLM worker; SGLang's own fp32 head at fp32out cost; Megatron-Core's
  output layer; the PyTorch/HF head);
- the stacks: ``kit/`` (what every stack shares: the guard's skeleton, the rollout switches,
  the probe's verdicts, wiring with a role label, and the contract a stack follows), then one
  folder per stack (``nemo_rl/``, ``verl/``, ``trl/``) holding its config rules and thin adapters.

``modes`` (the values the switches take), ``errors`` and ``context_length`` (the NeMo-Gym
contract) are leaves every layer may read.

Nothing here imports torch, vLLM or Megatron at module import; each function imports what it
needs when called, so the CLI and the patched files stay importable anywhere. This package
never imports ``fp32patch.patcher``.

Files that an earlier fp32patch patched import modules by the paths they had before the layers
were folders (``fp32patch.runtime.vllm_lm_head``, ...). ``_MOVED`` keeps each of those paths
working: importing one gives the module at its new path, the same object, so its state (the
vLLM head's per-head bookkeeping, the guard's verdicts) is shared whichever path a caller used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old path -> new path, for every module that moved into a layer's folder
_MOVED = {
    f"{__name__}.{old}": f"{__name__}.{new}"
    for old, new in {
        "fp32out": "kernels.fp32out",
        "lm_head_gemm": "kernels.lm_head_gemm",
        "fp16_scale_triton": "kernels.fp16_scale_triton",
        "matmul_precision": "kernels.matmul_precision",
        "vllm_lm_head": "heads.vllm",
        "vllm_probe": "heads.vllm_probe",
        "megatron_lm_head": "heads.megatron",
        "hf_lm_head": "heads.hf",
        "switches": "kit.config",
        "config": "nemo_rl.config",
    }.items()
}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a moved module's old path and loads it as the module at the new path."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(_MOVED[spec.name])
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module):
        # Loaded already, at its new path. The import machinery has just set its __spec__ to
        # the old path's; give it back its own, which names its file and its real name.
        module.__spec__ = module.__spec__.loader_state


if not any(isinstance(finder, _Alias) for finder in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
