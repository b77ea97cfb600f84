"""SGLang's own ``logits_processor.py`` imported on a CPU without SGLang's runtime.

SGLang's wheels need CUDA kernels and a long list of dependencies; its ``logits_processor.py``
itself is plain Python over torch. ``load_logits_processor(path)`` imports the real file (as
``sglang.srt.layers.logits_processor``) with a stand-in module for each module it imports that is
not torch or the standard library: SGLang's other modules (``sglang.srt.distributed``,
``...dp_attention``, ``...vocab_parallel_embedding``, ``...server_args``, ``...utils``, ...),
``triton``, ``sgl_kernel`` and ``flashinfer``. A stand-in's every name is a callable that returns
False (so ``is_npu()``, ``use_intel_amx_backend(head)``, ``envs.X.get()`` are false, and a
decorator gives back the function it decorates); the test names the stand-ins it got (``made``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

NAME = "sglang.srt.layers.logits_processor"
STANDIN_ROOTS = ("sglang", "triton", "sgl_kernel", "flashinfer")


class StandIn:
    """Any name of a stand-in module: false, callable (returning False, or what it decorates)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and isinstance(args[0], types.FunctionType) and not kwargs:  # a decorator
            return args[0]
        return False

    def __bool__(self) -> bool:
        return False

    def __getitem__(self, key: Any) -> StandIn:
        return StandIn(f"{self._name}[{key!r}]")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __repr__(self) -> str:
        return f"<stand-in {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return StandIn(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, path: Path) -> None:
        self.path, self.made = path, []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name == NAME:
            return importlib.util.spec_from_file_location(name, self.path)
        if name.split(".")[0] in STANDIN_ROOTS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        self.made.append(spec.name)
        module = _StandInModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def _forget() -> None:
    for name in [n for n in sys.modules if n.split(".")[0] in STANDIN_ROOTS]:
        del sys.modules[name]


def load_logits_processor(path: Path) -> tuple[types.ModuleType, list[str]]:
    """The real file at ``path`` as a module, and the stand-in modules it got (in import order).
    Nothing stays in ``sys.modules``: each call loads afresh."""
    _forget()
    finder = _Finder(path)
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module(NAME)
    finally:
        sys.meta_path.remove(finder)
        _forget()
    return module, finder.made


def processor(module: types.ModuleType, *, vocab: int, fp32: bool, rl_on_policy_target: str | None = None) -> Any:
    """A ``LogitsProcessor`` of ``module`` as SGLang builds one for a single GPU (no TP gather, no
    DP attention, no scale, no soft-cap), with its flag ``fp32`` (``use_fp32_lm_head``), built
    without its ``__init__`` (which reads SGLang's global server arguments): any attribute it
    does not set reads None."""
    import torch

    class Processor(module.LogitsProcessor):
        def __getattr__(self, attr: str) -> Any:
            try:
                return super().__getattr__(attr)
            except AttributeError:
                return None

    # SGLang's global server arguments, which 0.5.5-0.5.8's head reads at call time
    module.get_global_server_args = lambda: _Anything(rl_on_policy_target=rl_on_policy_target, enable_fp32_lm_head=fp32)
    proc = Processor.__new__(Processor)
    torch.nn.Module.__init__(proc)
    proc.config = types.SimpleNamespace(vocab_size=vocab)
    proc.vocab_size = vocab
    proc.use_fp32_lm_head = fp32
    proc.rl_on_policy_target = rl_on_policy_target
    proc.logit_scale = proc.final_logit_softcapping = None
    proc.do_tensor_parallel_all_gather = proc.do_tensor_parallel_all_gather_dp_attn = False
    return proc


class _Anything(types.SimpleNamespace):
    """Named attributes as given; any other reads None."""

    def __getattr__(self, attr: str) -> Any:
        return None


class Metadata:
    """``LogitsMetadata`` of a plain decode step: no logits buffer; anything else None."""

    next_token_logits_buffer = None

    def __getattr__(self, attr: str) -> Any:
        return None
