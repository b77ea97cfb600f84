"""NeMo-RL's worker-start edit of vLLM's nemotron_h.py against a vLLM that fp32patch manages (issue 22).

Since its September 2026 rework NeMo-RL runs ``_patch_vllm_nemotron_h_fp32_lm_head`` at every
vLLM worker start: a string edit of the installed ``nemotron_h.py`` (an fp32 upcast of the
head in ``lm_head.forward``). The function run here is our stand-in from
``tests/fixtures/nemo_rl_newest.py`` (our text, not NeMo-RL's), in the fixture checkout
``logit-dtype``, with and without ``nemo-rl-fp32-lm-head``'s ``keep-fp32patch-vllm`` edit.

The stand-in finds vLLM with ``importlib.util.find_spec("vllm")`` and writes the file in
place, so each test gives it an import root of its own (``_vllm_root``): the environment's
``vllm`` dist-info (hardlinks), ``vllm/__init__.py`` and the two files fp32patch patches, as
copies (never links into the environment: a write in place would go through a link). While
it runs, that root is first on ``sys.path`` and the ``vllm`` already imported by the session
is out of ``sys.modules`` (``find_spec`` answers from ``sys.modules`` first). The models are
built by the session's vLLM (conftest's PATCHED_ROOT, every fp32patch spec applied).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.fixtures.nemo_rl_shapes import PATCHES, checkout
from tests.heavy.vllm import tiny
from tests.heavy.vllm.conftest import NEMOTRON, PATCHED_ROOT, REPO, SITE
from tests.heavy.vllm.test_vllm_logits import _expected_way

VAR = "NRL_VLLM_FP32_LM_HEAD"
COPY_VARS = "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY"  # _apply_vllm_patches sets it too
LOGITS = "vllm/model_executor/layers/logits_processor.py"
MARK = "# fp32patch: "
VLLM_PATCHES = ("nemotron-h-fp32-lm-head", "vllm-fp32-logits")


# ---------------------------------------------------------------- helpers


def _vllm_root(parent: Path, *, fp32patch: bool) -> Path:
    """An import root holding this environment's vLLM as far as the worker-start edit and
    fp32patch read it; ``fp32patch``: with ``fp32patch apply -s ROOT`` run on it."""
    root = parent / ("vllm-fp32patch" if fp32patch else "vllm-stock")
    root.mkdir(parents=True)
    for info in SITE.glob("vllm-*.dist-info"):
        shutil.copytree(info, root / info.name, copy_function=os.link)
    for relative in ("vllm/__init__.py", NEMOTRON, LOGITS):
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(SITE / relative, root / relative)  # a copy: the stand-in writes in place
    if fp32patch:
        result = _cli("apply", "-s", str(root))
        assert result.returncode == 0, result.stdout + result.stderr
        for relative in (NEMOTRON, LOGITS):
            assert MARK in (root / relative).read_text()
    return root


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fp32patch", *args], cwd=REPO, capture_output=True, text=True)


def _verify(root: Path) -> tuple[int, dict[str, str]]:
    """``fp32patch verify -s ROOT --json``: its exit status and each vLLM patch's status."""
    result = _cli("verify", "-s", str(root), "--json")
    statuses = {p["id"]: p["status"] for p in json.loads(result.stdout)["patches"] if p["id"] in VLLM_PATCHES}
    return result.returncode, statuses


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load(path: Path, name: str, monkeypatch):
    """The file at ``path`` as a module named ``name`` (in sys.modules until the test ends)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def _patches_module(tmp: Path, name: str, monkeypatch, *, fp32patch: bool):
    """patches.py of a fresh fixture checkout ``logit-dtype``; ``fp32patch``: after
    ``fp32patch apply -s CHECKOUT --patch nemo-rl-fp32-lm-head``."""
    root = checkout("logit-dtype", tmp / name)
    before = (root / PATCHES).read_text()
    if fp32patch:
        result = _cli("apply", "-s", str(root), "--patch", "nemo-rl-fp32-lm-head")
        assert result.returncode == 0, result.stdout + result.stderr
        assert "[keep-fp32patch-vllm]" in (root / PATCHES).read_text()
    else:
        assert MARK not in before
    return _load(root / PATCHES, name, monkeypatch)


@contextlib.contextmanager
def _vllm_found_at(root: Path):
    """``root`` first on sys.path and the session's ``vllm`` out of sys.modules, so that
    ``importlib.util.find_spec("vllm")`` finds the vLLM in ``root``; both restored after."""
    path, imported = list(sys.path), sys.modules.pop("vllm", None)
    sys.path.insert(0, str(root))
    try:
        yield
    finally:
        sys.path[:] = path
        if imported is not None:
            sys.modules["vllm"] = imported


def _run_worker_start_edit(patches, root: Path) -> bool:
    """The fixture's ``_patch_vllm_nemotron_h_fp32_lm_head`` on the vLLM in ``root``."""
    with _vllm_found_at(root):
        assert patches._get_vllm_file(patches._MODEL_FILE) == str(root / NEMOTRON)
        assert os.stat(root / NEMOTRON).st_nlink == 1  # never written through a link into the environment
        return patches._patch_vllm_nemotron_h_fp32_lm_head(logging.getLogger("t"))


def _anchors_hold(patches, text: str) -> bool:
    """Whether each place the stand-in edits is in ``text`` exactly once (its own condition)."""
    heads = patches._head_constructor(text)
    anchors = [patches._IMPORTS, patches._PROCESSOR, patches._COMPUTE]
    return len(heads) == 1 and all(text.count(anchor) == 1 for anchor in anchors)


def _skip_unless_anchors_hold(patches) -> None:
    if not _anchors_hold(patches, (SITE / NEMOTRON).read_text()):
        pytest.skip(
            "the worker-start edit's anchors (pinned by NeMo-RL to vLLM 0.25.1) are not each in this vLLM's "
            "stock nemotron_h.py exactly once: the stand-in refuses here"
        )


@pytest.fixture
def clean_env(monkeypatch):
    """VAR and COPY_VARS unset now and restored after the test, whoever sets them (the worker
    start writes os.environ directly)."""
    for name in (VAR, COPY_VARS):
        monkeypatch.setenv(name, "")  # records the value before the test
        monkeypatch.delenv(name)
    return monkeypatch


def _hidden(rows: int = 7, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, tiny.HIDDEN, generator=g) * 3).to(torch.bfloat16)


class _CountGemms(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.gemms: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(k in str(func) for k in ("mm", "linear", "matmul", "gemm")):
            self.gemms.append(str(func))
        return func(*args, **(kwargs or {}))


def _doubly_patched(tmp: Path, monkeypatch) -> Path:
    """A root whose nemotron_h.py fp32patch patched and the stock worker-start edit then edited."""
    stock = _patches_module(tmp, "nrl_patches_stock_2", monkeypatch, fp32patch=False)
    _skip_unless_anchors_hold(stock)
    root = _vllm_root(tmp, fp32patch=True)
    assert _run_worker_start_edit(stock, root) is True
    return root


# ---------------------------------------------------------------- 1. without our NeMo-RL patch


def test_without_our_nemo_rl_patch_the_worker_start_edit_drifts_fp32patchs_file(tmp_path, monkeypatch, clean_env):
    root = _vllm_root(tmp_path, fp32patch=True)
    assert _verify(root) == (0, dict.fromkeys(VLLM_PATCHES, "applied"))
    patched = (root / NEMOTRON).read_bytes()
    logits_sha = _sha(root / LOGITS)
    stock = _patches_module(tmp_path, "nrl_patches_stock_1", monkeypatch, fp32patch=False)

    if not _anchors_hold(stock, (SITE / NEMOTRON).read_text()):
        assert _run_worker_start_edit(stock, root) is False
        assert (root / NEMOTRON).read_bytes() == patched
        assert _verify(root)[0] == 0
        _skip_unless_anchors_hold(stock)

    assert _run_worker_start_edit(stock, root) is True
    edited = (root / NEMOTRON).read_text()
    assert edited.encode() != patched
    assert "self._nrl_fp32_lm_head = os.environ.get(" in edited and "head.forward = _fp32_head_forward" in edited
    assert MARK in edited  # fp32patch's route is still there: both are in the file now

    assert _verify(root) == (1, {"nemotron-h-fp32-lm-head": "drifted", "vllm-fp32-logits": "applied"})
    # revert refuses a drifted file without --force, and writes nothing
    refused = _cli("revert", "-s", str(root))
    assert refused.returncode != 0, refused.stdout
    assert "--force" in refused.stdout + refused.stderr
    assert (root / NEMOTRON).read_text() == edited and _sha(root / LOGITS) == logits_sha
    # a second worker start finds its edit in place and leaves the file alone
    assert _run_worker_start_edit(stock, root) is True
    assert (root / NEMOTRON).read_text() == edited


# ---------------------------------------------------------------- 2. both routes in the file


def test_both_routes_in_the_file_fp32patchs_gate_computes_the_logits(tmp_path, monkeypatch, clean_env, vllm_runtime):
    """fp32patch's compute_logits gate runs first and routes the head (its own fp32 GEMM up to
    vLLM 0.25, vLLM's head_dtype=float32 path from 0.26), one head GEMM gives the fp32 logits,
    and upstream's fp32 forward, installed on the same head, never runs."""
    from fp32patch.runtime import vllm_lm_head

    root = _doubly_patched(tmp_path, monkeypatch)
    module = _load(root / NEMOTRON, "nemotron_h_fp32patch_and_upstream", monkeypatch)
    assert hasattr(module, "_fp32patch_lm_head_runtime")  # fp32patch's gate
    monkeypatch.setenv(VAR, "1")  # before the model is built: the stand-in reads it in __init__
    model = vllm_runtime.model(module.NemotronHForCausalLM)
    head = model.lm_head
    assert model._nrl_fp32_lm_head is True and head.forward.calls == 0  # upstream's route is installed

    h = _hidden()
    model.compute_logits(h)  # a first call (the copy way builds its copy here)
    with _CountGemms() as counted:
        logits = model.compute_logits(h)
    assert logits.dtype == torch.float32 and logits.shape == (h.shape[0], tiny.VOCAB)
    assert tiny.rel_err(logits, tiny.reference(h, model)) < 1e-5
    assert len(counted.gemms) == 1, counted.gemms
    assert head.forward.calls == 0  # upstream's fp32 forward never ran

    [info] = vllm_lm_head.describe(model)
    assert info["patch"] == "nemotron-h-fp32-lm-head" and info["owner"] == "NemotronHForCausalLM"
    assert info["way"] == _expected_way("1"), info

    # the counter counts: the head called as a module runs upstream's route
    assert head(h).dtype == torch.float32 and head.forward.calls == 1


# ---------------------------------------------------------------- 3. with our NeMo-RL patch


def test_with_our_nemo_rl_patch_the_worker_start_leaves_fp32patchs_file_and_logits_are_fp32(
    tmp_path, monkeypatch, clean_env, vllm_runtime, caplog
):
    from fp32patch.runtime import vllm_lm_head

    root = _vllm_root(tmp_path, fp32patch=True)
    # the same files the session's models run (conftest patched the same release the same way)
    for relative in (NEMOTRON, LOGITS):
        assert (root / relative).read_bytes() == (PATCHED_ROOT / relative).read_bytes()
    before = {relative: (root / relative).read_bytes() for relative in (NEMOTRON, LOGITS)}
    patches = _patches_module(tmp_path, "nrl_patches_fp32patch_3", monkeypatch, fp32patch=True)

    caplog.set_level(logging.INFO, logger=patches.__name__)
    with _vllm_found_at(root):
        assert patches._get_vllm_file(patches._MODEL_FILE) == str(root / NEMOTRON)
        patches._apply_vllm_patches("python", nemotron_h_fp32_lm_head=True)  # the worker-start path
    assert os.environ[VAR] == "1" and VAR in os.environ[COPY_VARS].split(",")
    assert {relative: (root / relative).read_bytes() for relative in (NEMOTRON, LOGITS)} == before
    assert _verify(root) == (0, dict.fromkeys(VLLM_PATCHES, "applied"))
    assert any("fp32patch's vLLM patches are installed" in r.getMessage() for r in caplog.records)

    # with that environment, the models of that vLLM: a llama-like one and NemotronH
    h = _hidden()
    for name in ("llama-tied", "nemotron-h"):
        family = tiny.FAMILIES[name]
        model = vllm_runtime.model(family=family)
        logits = model.compute_logits(h)
        assert logits.dtype == torch.float32 and logits.shape == (h.shape[0], tiny.VOCAB), name
        err = tiny.rel_err(logits, tiny.family_reference(h, model, family))
        assert err < 1e-5, (name, err)
        [info] = vllm_lm_head.describe(model)
        assert info["patch"] == ("nemotron-h-fp32-lm-head" if name == "nemotron-h" else "vllm-fp32-logits"), info
        assert info["way"] == _expected_way("1"), info
        assert not hasattr(model, "_nrl_fp32_lm_head")  # the session's NemotronH carries no upstream edit


# ---------------------------------------------------------------- 4. without fp32patch's vLLM patches


def test_where_fp32patchs_vllm_patches_are_absent_the_worker_start_edit_is_upstreams(tmp_path, monkeypatch, clean_env):
    stock = _patches_module(tmp_path, "nrl_patches_stock_4", monkeypatch, fp32patch=False)
    ours = _patches_module(tmp_path, "nrl_patches_fp32patch_4", monkeypatch, fp32patch=True)
    original = (SITE / NEMOTRON).read_bytes()
    edited = {}
    for name, patches in (("stock", stock), ("ours", ours)):
        root = _vllm_root(tmp_path / name, fp32patch=False)
        for relative in (NEMOTRON, LOGITS):
            assert MARK not in (root / relative).read_text()
        returned = _run_worker_start_edit(patches, root)
        edited[name] = (returned, (root / NEMOTRON).read_bytes())
    assert edited["ours"] == edited["stock"]
    if _anchors_hold(stock, original.decode()):
        assert edited["stock"][0] is True and edited["stock"][1] != original
        assert b"head.forward = _fp32_head_forward" in edited["stock"][1]
    else:
        assert edited["stock"] == (False, original)
