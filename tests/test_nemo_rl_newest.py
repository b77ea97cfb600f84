"""nemo-rl-fp32-lm-head on NeMo-RL after its own fp32 LM head was reworked (September 2026).

The stand-in checkout is tests/fixtures/nemo_rl_newest.py's: vLLM's switch is
``generation.vllm_cfg.fp32_lm_head``, every vLLM worker edits vLLM's ``nemotron_h.py`` when it
starts, upstream's check refuses DTensor, and Megatron gets fp32 logits from the provider's
``logit_dtype``. What this file shows, with the real runtime and, for the worker-start path,
the real vLLM 0.25.1 files (fetched from its wheel, patched by ``fp32patch apply``):

- the spec applies, verifies and reverts exactly on that shape, with and without DTensor v1;
- Megatron keeps upstream's single fp32 head: fp32patch adds none;
- one YAML passes the driver on the oldest, the newest supported and the reworked shape, for
  Megatron and for DTensor (whose refusal upstream, not fp32patch, would make);
- at worker start, with fp32patch's vLLM patches installed, the vLLM file stays as ``apply``
  wrote it and ``verify`` stays green; without the NeMo-RL patch upstream's edit makes it
  ``drifted``; without fp32patch's vLLM patches upstream's edit is made as before;
- the older checkouts set the variable in each vLLM worker from the same key, and the driver's
  probe names that key.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.fixtures import nemo_rl_newest as newest
from tests.fixtures.nemo_rl_shapes import (
    MODEL_UTILS,
    NEWEST,
    NEWEST_SHAPES,
    SETUP,
    SHAPES,
    TRAIN,
    WORKER,
    checkout,
    files_at,
)
from tests.nemo_rl_harness import cli, load_module
from tests.test_nemo_rl_fp32_patch import (
    POLICY,
    VAR,
    Cluster,
    ModelProvider,
    _heads,
    _markers,
    _run,
    _sources,
    dtensor_policy_cfg,
    megatron_doubles,
    needs_runtime,
    patched_checkouts,
    policy_cfg,
    start_generation,
)

PATCHES = newest.PATCHES
NEMOTRON = "vllm/model_executor/models/nemotron_h.py"
LOGITS = "vllm/model_executor/layers/logits_processor.py"
VLLM = "0.25.1"  # the release upstream's worker-start patch was written against


def _importable(monkeypatch, root: Path) -> None:
    """The checkout ``root`` is where its files' own ``nemo_rl`` imports resolve, for this test."""
    monkeypatch.syspath_prepend(str(root))
    for name in [n for n in sys.modules if n == "nemo_rl" or n.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, name)


def _load(monkeypatch, root: Path, path: str) -> Any:
    """``root``'s ``path`` loaded as NeMo-RL's process imports it."""
    _importable(monkeypatch, root)
    return load_module(root / path)


def _vllm_on(**cfg: Any) -> dict:
    return {"backend": "vllm", "colocated": {"enabled": True}, "vllm_cfg": {"fp32_lm_head": True, **cfg}}


def _megatron_yaml() -> dict:
    """docs/nemo-rl.md's YAML for a Megatron policy."""
    cfg = policy_cfg(True)
    cfg["generation"] = _vllm_on()
    return cfg


def _dtensor_yaml() -> dict:
    """docs/nemo-rl.md's YAML for a DTensor policy."""
    return dtensor_policy_cfg("fp32out", generation=_vllm_on())


@pytest.fixture(autouse=True)
def _variable_restored():
    # the patched vLLM workers set the variable in this process, as they do in their own
    saved = os.environ.get(VAR)
    yield
    os.environ.pop(VAR, None)
    if saved is not None:
        os.environ[VAR] = saved


@pytest.fixture(scope="module")
def reworked(tmp_path_factory) -> dict[str, Path]:
    """Each reworked shape, patched once by the CLI."""
    return patched_checkouts(NEWEST_SHAPES, tmp_path_factory)


# ---------------------------------------------------------------- the spec on the reworked shape


@pytest.mark.parametrize("shape", NEWEST_SHAPES, ids=lambda s: s.name)
def test_each_reworked_shape_gets_its_variant_verifies_and_reverts_exactly(tmp_path, shape):
    root = checkout(shape.name, tmp_path / "nemo-rl")
    before = _sources(root)
    code, out = _run("apply", root)
    assert (code, out["status"], out["variant"]) == (0, "applied", shape.variant), out
    setup = (root / SETUP).read_text()
    # one fp32 head for Megatron: upstream's logit_dtype stays, nothing of ours wires a model
    assert "model_cfg.logit_dtype = torch.float32" in setup
    assert not {"wire-policy", "wire-inference-model"} & _markers(setup)
    assert "residual" in _markers(setup)
    assert {"gate-patches", "keep-fp32patch-vllm", "env-copy"} <= _markers((root / PATCHES).read_text())
    assert {"gate-utils", "lift-refusals"} <= _markers((root / newest.UTILS).read_text())
    # the fused log-prob path (its files are those of 2026-08-22)
    assert {"fused-logprobs"} <= _markers((root / MODEL_UTILS).read_text())
    assert {"fused-temperature", "fused-temperature-once"} <= _markers((root / TRAIN).read_text())
    assert "vllm-switch" not in _markers((root / WORKER).read_text())  # the workers set it themselves
    assert (root / newest.DTENSOR_V1).exists() == (shape.variant == "logit-dtype")
    assert _run("verify", root)[0] == 0
    code, out = _run("revert", root)
    assert code == 0, out
    assert _sources(root) == before


def test_the_older_variants_refuse_a_setup_that_sets_logit_dtype(tmp_path):
    # upstream's rework with the worker-start patch renamed: no variant of the rework holds, and
    # an older one must not give Megatron a second fp32 head on top of logit_dtype
    files = files_at(NEWEST.name)
    files[PATCHES] = files[PATCHES].replace("_patch_vllm_nemotron_h_fp32_lm_head", "_patch_nemotron_h_head")
    root = tmp_path / "nemo-rl"
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    before = _sources(root)
    code, out = _run("apply", root)
    assert code == 3 and out["status"] == "anchor-missing", out
    assert "keep-fp32patch-vllm" in out["message"] and "_patch_vllm_nemotron_h_fp32_lm_head" in out["message"]
    assert _sources(root) == before


# ---------------------------------------------------------------- Megatron: upstream's head, once


@dataclass
class LogitDtypeProvider(ModelProvider):
    """A Megatron-Bridge provider that has logit_dtype (Megatron's fp32-output logits)."""

    logit_dtype: Any = None


@dataclass
class SimpleMegatronCfg:
    model: Any
    ddp: Any = None


@needs_runtime
def test_megatron_keeps_upstreams_logit_dtype_and_gets_no_second_head(monkeypatch, reworked):
    from fp32patch.runtime.megatron_lm_head import fp32_lm_head_mode

    monkeypatch.delenv(VAR, raising=False)
    provider = LogitDtypeProvider()
    megatron_doubles(monkeypatch, provider)
    setup = _load(monkeypatch, reworked[NEWEST.name], SETUP)
    cfg = _megatron_yaml()
    model_cfg, _ = setup.validate_and_set_config(cfg, 0, "tiny", None, None, None)
    assert model_cfg.logit_dtype == torch.float32  # upstream's fp32 head
    state = setup.setup_model_and_optimizer(cfg, SimpleMegatronCfg(provider))
    (head,) = _heads(state.chunks)
    assert fp32_lm_head_mode(head) is None and "_forward_impl" not in head.__dict__  # none of ours


# ---------------------------------------------------------------- one YAML on every shape


@needs_runtime
@pytest.mark.parametrize("yaml", [_megatron_yaml, _dtensor_yaml], ids=["megatron", "dtensor"])
def test_one_yaml_passes_the_driver_on_the_old_and_the_reworked_shapes(monkeypatch, tmp_path, reworked, yaml):
    monkeypatch.delenv(VAR, raising=False)
    roots = {shape.name: checkout(shape.name, tmp_path / shape.name) for shape in (SHAPES[0], SHAPES[-1])}
    for root in roots.values():
        assert _run("apply", root)[0] == 0
    roots.update(reworked)
    for name, root in roots.items():
        cluster = Cluster()
        _load(monkeypatch, root, POLICY).Policy(cluster, yaml(), tokenizer=None)
        assert len(cluster.started) == 1, name


@needs_runtime
def test_upstream_alone_refuses_the_dtensor_yaml_and_our_modes_on_megatron(monkeypatch, tmp_path, reworked):
    monkeypatch.delenv(VAR, raising=False)
    stock = _load(monkeypatch, checkout(NEWEST.name, tmp_path / "stock"), POLICY)
    with pytest.raises(ValueError, match="DTensor has no fp32 LM head"):
        stock.Policy(Cluster(), _dtensor_yaml(), tokenizer=None)
    # with the patch it is fp32patch's guard that decides, and DTensor is wired (test above)
    stock_megatron = _load(monkeypatch, checkout(NEWEST.name, tmp_path / "stock-2"), POLICY)
    cfg = _megatron_yaml()
    cfg["megatron_cfg"]["fp32_lm_head"] = "fp32out"
    with pytest.raises(ValueError, match="must be true or false"):  # upstream alone
        stock_megatron.Policy(Cluster(), cfg, tokenizer=None)


@needs_runtime
@pytest.mark.parametrize("shape", NEWEST_SHAPES, ids=lambda s: s.name)
def test_our_modes_on_upstreams_megatron_head_are_refused_saying_why(monkeypatch, reworked, shape):
    """Megatron's switch stays upstream's there: fp32patch's guard, in the driver and in each
    Megatron worker, refuses a mode name before upstream's truthiness test takes it for true."""
    from fp32patch.runtime.errors import Fp32LmHeadConfigError

    monkeypatch.delenv(VAR, raising=False)
    cfg = _megatron_yaml()
    cfg["megatron_cfg"]["fp32_lm_head"] = "fp32out"
    patched = _load(monkeypatch, reworked[shape.name], POLICY)
    with pytest.raises(
        Fp32LmHeadConfigError, match=r"fp32patch \(driver\): .*'fp32out' is one of fp32patch's modes"
    ) as raised:
        patched.Policy(Cluster(), cfg, tokenizer=None)
    assert "logit_dtype" in str(raised.value) and "write true" in str(raised.value)
    megatron_doubles(monkeypatch, LogitDtypeProvider())
    setup = _load(monkeypatch, reworked[shape.name], SETUP)
    with pytest.raises(Fp32LmHeadConfigError, match=r"fp32patch \(megatron worker rank 3\)"):
        setup.validate_and_set_config(cfg, 3, "tiny", None, None, None)
    # upstream's value passes both (its later "tf32" alias: tests/test_nemo_rl_upstream_files.py,
    # on upstream's own check; this fixture has the earlier, boolean-only one)
    cfg["megatron_cfg"]["fp32_lm_head"] = True
    patched.Policy(Cluster(), cfg, tokenizer=None)
    model_cfg, _ = setup.validate_and_set_config(cfg, 3, "tiny", None, None, None)
    assert model_cfg.logit_dtype == torch.float32


@needs_runtime
@pytest.mark.parametrize("shape", NEWEST_SHAPES, ids=lambda s: s.name)
def test_upstreams_refusal_of_its_fp32_head_with_the_fused_path_is_lifted(monkeypatch, tmp_path, reworked, shape):
    """Upstream refuses megatron_cfg.fp32_lm_head with use_fused_linear_logprobs (that path never
    calls the output layer); with the patch, fp32patch's fused path computes it at fp32 grade from
    upstream's logit_dtype head, so the driver lets it start, and the caller's config is untouched."""
    monkeypatch.delenv(VAR, raising=False)
    cfg = _megatron_yaml()
    cfg["megatron_cfg"].update(use_fused_linear_logprobs=True, fused_linear_logprobs_chunk_size=256)
    stock = _load(monkeypatch, checkout(shape.name, tmp_path / "stock"), POLICY)
    with pytest.raises(ValueError, match="use_fused_linear_logprobs"):
        stock.Policy(Cluster(), cfg, tokenizer=None)
    cluster = Cluster()
    _load(monkeypatch, reworked[shape.name], POLICY).Policy(cluster, cfg, tokenizer=None)
    assert len(cluster.started) == 1
    assert cfg["megatron_cfg"]["use_fused_linear_logprobs"] is True
    # what upstream's check still refuses, it refuses with the fused path on too: one side alone
    cfg["generation"]["vllm_cfg"]["fp32_lm_head"] = False
    with pytest.raises(Exception, match="one side alone|both engines|both or in neither"):
        _load(monkeypatch, reworked[shape.name], POLICY).Policy(Cluster(), cfg, tokenizer=None)


@needs_runtime
def test_the_non_nemotron_h_warning_gives_way_to_the_probe(monkeypatch, tmp_path, reworked, recwarn):
    monkeypatch.delenv(VAR, raising=False)
    llama = type("Config", (), {"architectures": ["LlamaForCausalLM"]})()
    cluster = Cluster()
    cluster.model_config = llama
    _load(monkeypatch, reworked[NEWEST.name], POLICY).Policy(cluster, _megatron_yaml(), tokenizer=None)
    assert not [w for w in recwarn if "fp32 LM-head path" in str(w.message)]
    # upstream alone warns (and runs such a model with a bf16 head on vLLM)
    utils = _load(monkeypatch, checkout(NEWEST.name, tmp_path / "stock"), newest.UTILS)
    with pytest.warns(UserWarning, match="will not execute an fp32 LM-head path"):
        utils.validate_fp32_lm_head_config(
            _megatron_yaml(), megatron_enabled=True, dtensor_enabled=False, model_config=llama
        )


# ---------------------------------------------------------------- the worker-start path, on real vLLM files


def _vllm_root(where: Path, *, patched: bool) -> Path:
    """vLLM 0.25.1's two model files and its dist-info as an import root; ``patched``: after
    ``fp32patch apply`` of both vLLM patches."""
    from tests.support.pypi import import_root_from_members

    root = import_root_from_members("vllm", VLLM, [NEMOTRON, LOGITS], where)
    if patched:
        code, out = cli("apply", "-s", str(root), "--patch", "nemotron-h-fp32-lm-head", "--patch", "vllm-fp32-logits")
        assert code == 0, out
    return root


def _status(root: Path, patch_id: str) -> tuple[int, str]:
    code, out = cli("verify", "-s", str(root), "--patch", patch_id)
    (entry,) = [p for p in out["patches"] if p["id"] == patch_id]
    return code, entry["status"]


def _worker_start(monkeypatch, checkout_root: Path, vllm_root: Path) -> Any:
    """NeMo-RL's patches module as a vLLM worker imports it, with ``vllm_root``'s vLLM."""
    monkeypatch.syspath_prepend(str(vllm_root))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    return _load(monkeypatch, checkout_root, PATCHES)


@pytest.mark.network
def test_with_fp32patchs_vllm_patches_the_worker_start_leaves_the_file_alone(monkeypatch, tmp_path, reworked):
    monkeypatch.delenv(VAR, raising=False)
    vllm_root = _vllm_root(tmp_path / "vllm", patched=True)
    before = (vllm_root / NEMOTRON).read_bytes()
    patches = _worker_start(monkeypatch, reworked[NEWEST.name], vllm_root)
    patches._apply_vllm_patches("python", nemotron_h_fp32_lm_head=True)  # no RuntimeError
    assert os.environ[VAR] == "1"  # set by the worker, as upstream does: fp32patch's runtime reads it
    assert (vllm_root / NEMOTRON).read_bytes() == before
    assert _status(vllm_root, "nemotron-h-fp32-lm-head") == (0, "applied")
    assert _status(vllm_root, "vllm-fp32-logits") == (0, "applied")


@pytest.mark.network
def test_without_the_nemo_rl_patch_the_worker_start_makes_the_file_drift(monkeypatch, tmp_path):
    monkeypatch.delenv(VAR, raising=False)
    vllm_root = _vllm_root(tmp_path / "vllm", patched=True)
    before = (vllm_root / NEMOTRON).read_text()
    patches = _worker_start(monkeypatch, checkout(NEWEST.name, tmp_path / "stock"), vllm_root)
    assert patches._patch_vllm_nemotron_h_fp32_lm_head(logging.getLogger("test")) is True
    after = (vllm_root / NEMOTRON).read_text()
    assert after != before and "_nrl_fp32_lm_head" in after and "# fp32patch: nemotron-h-fp32-lm-head" in after
    assert _status(vllm_root, "nemotron-h-fp32-lm-head") == (1, "drifted")
    code, out = cli("revert", "-s", str(vllm_root), "--patch", "nemotron-h-fp32-lm-head")
    assert code != 0 and (vllm_root / NEMOTRON).read_text() == after  # refused, nothing written


@pytest.mark.network
def test_without_fp32patchs_vllm_patches_upstreams_edit_is_made_as_before(monkeypatch, tmp_path, reworked):
    monkeypatch.delenv(VAR, raising=False)
    ours = _vllm_root(tmp_path / "with-nemo-rl-patch", patched=False)
    patched = _worker_start(monkeypatch, reworked[NEWEST.name], ours)
    assert patched._patch_vllm_nemotron_h_fp32_lm_head(logging.getLogger("test")) is True
    theirs = _vllm_root(tmp_path / "stock", patched=False)
    stock = _worker_start(monkeypatch, checkout(NEWEST.name, tmp_path / "stock-checkout"), theirs)
    assert stock._patch_vllm_nemotron_h_fp32_lm_head(logging.getLogger("test")) is True
    edited = (ours / NEMOTRON).read_text()
    assert "_nrl_fp32_lm_head" in edited and edited == (theirs / NEMOTRON).read_text()
    _assert_apply_refuses_nemo_rls_edit(theirs)


def _assert_apply_refuses_nemo_rls_edit(root: Path) -> None:
    """``fp32patch apply`` on a nemotron_h.py that a NeMo-RL worker start edited: refused by
    name (neither stock nor vLLM's own fix), nothing written, whichever generation edited it."""
    before = (root / NEMOTRON).read_bytes()
    code, out = cli("apply", "-s", str(root), "--patch", "nemotron-h-fp32-lm-head")
    (entry,) = out["patches"]
    assert (code, entry["status"]) == (3, "unsupported-version"), out
    assert "NeMo-RL's worker-start fp32 edit in NemotronH" in entry["message"]
    assert "--force-reinstall" in entry["message"]
    assert (root / NEMOTRON).read_bytes() == before


@pytest.mark.network
def test_the_first_heads_worker_start_leaves_a_file_fp32patch_manages_alone(monkeypatch, tmp_path):
    """NeMo-RL's first head (2026-08-31 to the rework), where the NeMo-RL patch refuses and the
    docs/nemo-rl.md says to apply the vLLM patches alone: its worker-start edit skips a nemotron_h.py that
    names the variable, which fp32patch's gate does, so ``verify`` stays green after a run."""
    from tests.fixtures import nemo_rl_first_head as first

    vllm_root = _vllm_root(tmp_path / "vllm", patched=True)
    before = (vllm_root / NEMOTRON).read_bytes()
    assert before.count(first.COMPUTE.encode()) == 1  # the edit's anchor is still there: only the name protects
    monkeypatch.syspath_prepend(str(vllm_root))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert first.vllm_file(first.MODEL_FILE) == str(vllm_root / NEMOTRON)
    assert first.worker_start_edit(logging.getLogger("test")) == "skipped"
    assert (vllm_root / NEMOTRON).read_bytes() == before
    assert _status(vllm_root, "nemotron-h-fp32-lm-head") == (0, "applied")
    assert _status(vllm_root, "vllm-fp32-logits") == (0, "applied")

    stock = _vllm_root(tmp_path / "stock", patched=False)  # without fp32patch: upstream's edit, as before
    monkeypatch.syspath_prepend(str(stock))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    assert first.worker_start_edit(logging.getLogger("test")) == "edited"
    assert "_nrl_lm_head_fp32" in (stock / NEMOTRON).read_text()
    _assert_apply_refuses_nemo_rls_edit(stock)


# ---------------------------------------------------------------- vLLM's key in the older checkouts


@needs_runtime
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[-1]], ids=lambda s: s.name)
@pytest.mark.parametrize(
    ("vllm_cfg", "environ", "expected"),
    [
        ({"fp32_lm_head": True}, {}, "1"),
        ({"fp32_lm_head": True}, {VAR: "copy"}, "copy"),  # the older spelling may name the way
        ({"fp32_lm_head": "tf32"}, {}, "1"),  # upstream's alias of true
        ({"fp32_lm_head": False}, {}, None),
        ({}, {}, None),
    ],
    ids=["key-on", "key-on-variable-set", "key-tf32-alias", "key-off", "no-key"],
)
def test_older_checkouts_set_the_variable_in_each_vllm_worker_from_the_key(
    monkeypatch, tmp_path, shape, vllm_cfg, environ, expected
):
    monkeypatch.delenv(VAR, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    root = checkout(shape.name, tmp_path / "nemo-rl")
    assert _run("apply", root)[0] == 0
    worker = _load(monkeypatch, root, WORKER)
    cfg = {"vllm_cfg": {"async_engine": False, **vllm_cfg}}
    worker.BaseVllmGenerationWorker(cfg, llm=None)
    assert os.environ.get(VAR) == expected


@needs_runtime
@pytest.mark.network
@pytest.mark.parametrize("shape", [SHAPES[0], NEWEST], ids=lambda s: s.name)
def test_the_probe_names_vllms_key(monkeypatch, tmp_path, reworked, shape, caplog):
    monkeypatch.delenv(VAR, raising=False)
    caplog.set_level(logging.INFO, logger="nemo_rl.fp32patch")
    if shape is NEWEST:
        root = reworked[NEWEST.name]
        monkeypatch.syspath_prepend(str(_vllm_root(tmp_path / "vllm", patched=True)))
        monkeypatch.delitem(sys.modules, "vllm", raising=False)
    else:
        root = checkout(shape.name, tmp_path / "nemo-rl")
        assert _run("apply", root)[0] == 0
    _importable(monkeypatch, root)
    cfg = {"backend": "vllm", "vllm_cfg": {"async_engine": False, "fp32_lm_head": True}}
    start_generation(monkeypatch, tmp_path, root, cfg=cfg, engines=[[{VAR: "1"}, {VAR: "1"}]])
    lines = [r.getMessage() for r in caplog.records if r.name == "nemo_rl.fp32patch" and r.levelno == logging.INFO]
    assert any("as policy.generation.vllm_cfg.fp32_lm_head=True asks: 2 vLLM worker(s)" in line for line in lines), (
        lines
    )


def test_the_fixture_is_what_its_description_says():
    files = files_at(NEWEST.name)
    assert newest.DTENSOR_V1 not in files and newest.UTILS in files
    assert "def _patch_vllm_nemotron_h_fp32_lm_head(logger) -> bool:" in files[PATCHES]
    assert "def apply_fp32_lm_head" not in files[SETUP] and "logit_dtype" in files[SETUP]
    assert newest.DTENSOR_V1 in files_at(newest.NAME_WITH_V1)
