"""The runtime's layers: each folder imports only the ones below it, and every import path a
patched file or a user's trainer may hold from before the layers were folders still works."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import fp32patch.runtime as runtime

RUNTIME = Path(runtime.__file__).parent
# lowest first; a module may import its own layer and those below it
LAYERS = ["kernels", "heads", "kit", "stacks"]
STACKS = ("nemo_rl", "verl", "trl", "openrlhf", "slime", "prime_rl", "areal", "skyrl")
LEAVES = ("errors", "modes", "context_length")


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["fp32patch", "runtime"] or len(parts) < 3:
        return None
    head = parts[2]
    if head in STACKS:
        return "stacks"
    return head if head in LAYERS else None


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


LAYERED = sorted(p for p in RUNTIME.rglob("*.py") if p.relative_to(RUNTIME).parts[0] in (*LAYERS, *STACKS))


@pytest.mark.parametrize("path", LAYERED, ids=lambda p: str(p.relative_to(RUNTIME)))
def test_a_layer_imports_only_the_layers_below(path: Path) -> None:
    own = _layer("fp32patch.runtime." + path.relative_to(RUNTIME).parts[0])
    allowed = set(LAYERS[: LAYERS.index(own) + 1])
    for name in _imports(path):
        layer = _layer(name)
        if name.startswith("fp32patch.patcher"):
            pytest.fail(f"{path}: the runtime never imports the patcher ({name})")
        assert layer is None or layer in allowed, f"{path} ({own}) imports {name} ({layer})"
        if own == "stacks" and layer == "stacks":
            stack = path.relative_to(RUNTIME).parts[0]
            assert name.split(".")[2] == stack, f"{path}: a stack imports no other stack ({name})"


@pytest.mark.parametrize("old, new", sorted(runtime._MOVED.items()))
def test_every_moved_module_keeps_its_old_path(old: str, new: str) -> None:
    moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert moved.__spec__.name == new and moved.__name__ == new
    assert getattr(importlib.import_module("fp32patch.runtime"), old.rsplit(".", 1)[1]) is moved


def test_old_paths_work_in_a_fresh_interpreter_as_patched_files_import_them() -> None:
    code = (
        "from fp32patch.runtime import vllm_lm_head\n"
        "import fp32patch.runtime.hf_lm_head as hf\n"
        "from fp32patch.runtime.megatron_lm_head import apply_fp32_lm_head\n"
        "from fp32patch.runtime.config import validate_fp32_lm_head_config\n"
        "import fp32patch.runtime.heads.vllm as new\n"
        "assert vllm_lm_head is new and hf.__name__ == 'fp32patch.runtime.heads.hf'\n"
        "import sys; assert 'torch' not in sys.modules, 'the runtime imports torch lazily'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_top_level_holds_only_leaves_and_layers() -> None:
    modules = {p.stem for p in RUNTIME.glob("*.py")} - {"__init__"}
    folders = {p.name for p in RUNTIME.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert modules == set(LEAVES)
    assert folders <= {"kernels", "heads", "kit", *STACKS}
