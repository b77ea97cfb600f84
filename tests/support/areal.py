"""AReaL 1.0.4's own files for the heavy step tests (tests/heavy/megatron/test_areal_step.py,
tests/heavy/transformers/test_areal_fsdp_step.py): an engine file as the spec patches it, read from
the wheel (cached under $FP32PATCH_TEST_CACHE), and AReaL's own log-prob module imported from its
file with its one AReaL import stood in."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from fp32patch.patcher.spec import load_specs
from fp32patch.patcher.transform import transform
from tests.support.pypi import member_files

SPEC = "areal-fp32-lm-head"
VERSION = "1.0.4"
VOCAB_PARALLEL = "areal/utils/functional/vocab_parallel.py"


def engine_files(engine: str) -> dict[str, bytes]:
    """``engine`` (a path in AReaL's wheel) stock and as the spec patches it, and
    ``vocab_parallel.py``: ``{"stock", "patched", "vocab"}``."""
    spec = next(s for s in load_specs() if s.id == SPEC)
    paths = [p for _, p in spec.target.files]
    files = member_files("areal", VERSION, [*paths, VOCAB_PARALLEL])
    stock = {p: files[p].read_bytes() for p in paths if p in files}
    result = transform(spec, stock, path=engine, version=VERSION)
    assert result.status == "applied", result.message
    return {"stock": stock[engine], "patched": result.files[engine], "vocab": files[VOCAB_PARALLEL].read_bytes()}


def load_vocab_parallel(source: bytes, folder: Path) -> ModuleType:
    """AReaL's ``vocab_parallel.py`` from ``source`` (its wheel's bytes), written into ``folder``
    under a name of this process's own: ranks of one spawn share a folder, and one rank writing the
    file while another imports it hands the importer a truncated module (seen once in CI)."""
    platforms = ModuleType("areal.infra.platforms")
    platforms.is_npu_available = False  # stand-in: AReaL's platform probe (CUDA, NPU, CPU)
    for name in ("areal", "areal.infra"):
        sys.modules.setdefault(name, ModuleType(name))
    sys.modules["areal.infra.platforms"] = platforms
    path = folder / f"vocab_parallel_{os.getpid()}.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("areal_vocab_parallel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
