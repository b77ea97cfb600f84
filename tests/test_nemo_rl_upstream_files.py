"""Opt-in: fp32patch against NeMo-RL's own files from after 2026-08-22 (issue 22).

The whole-repository snapshot of NeMo-RL that can be fetched ends on 2026-08-22; newer public
files can only be read one by one. Copies of the ones that matter here, byte for byte, are
kept outside this repository (never committed: they are NeMo-RL's code) in a folder named
by ``FP32PATCH_NEMO_RL_UPSTREAM``, one subfolder per generation, each with the files under
``files/`` at their paths in the repository and a ``manifest-*.jsonl`` saying which stored
version each is:

- ``nemo-rl-first-head/``: ``patches.py`` of upstream's first fp32 head (2026-08-31 until
  its September rework), whose worker start edits vLLM's ``nemotron_h.py``;
- ``nemo-rl-newest/``: the reworked files the NeMo-RL patch touches (``setup.py``,
  ``lm_policy.py``, ``policy/utils.py``, the vLLM worker, backend, generation and patches
  modules, the DTensor v2 worker, vLLM's config).

The newest generation is laid over a 2026-08-22 checkout (``FP32PATCH_NEMO_RL_CHECKOUT``) for
the files it lacks; DTensor v1 is removed, as upstream removed it. The vLLM files are
0.25.1's from its wheel, the release upstream's worker-start edit is written against.

What runs is upstream's own code where it can run alone: the worker-start edits of both
generations (plain functions of ``patches.py`` over the vLLM that ``find_spec`` finds), and the
reworked config check (``policy/utils.py``'s ``validate_fp32_lm_head_config``, stock and as
``fp32patch apply`` leaves it) with the switch parsing it calls (``utils/fp32_lm_head.py``,
``vllm/config.py``): their definitions run without the module imports they do not use.
"""

from __future__ import annotations
import __future__

import ast
import logging
import os
import shutil
import sys
import typing
import warnings
from pathlib import Path

import pytest

from tests.nemo_rl_harness import cli, load_module
from tests.test_nemo_rl_fp32_patch import FILES, UTILS, _markers, _sources
from tests.test_nemo_rl_newest import NEMOTRON, _vllm_root  # vLLM 0.25.1's files, as an import root

UPSTREAM = os.environ.get("FP32PATCH_NEMO_RL_UPSTREAM")
pytestmark = [
    pytest.mark.network,
    pytest.mark.skipif(
        not UPSTREAM,
        reason="set FP32PATCH_NEMO_RL_UPSTREAM to a folder of NeMo-RL's files newer than 2026-08-22 (see the docstring)",
    ),
]

VAR = "NRL_VLLM_FP32_LM_HEAD"
PATCHES = "nemo_rl/models/generation/vllm/patches.py"
VLLM_PATCHES = ("nemotron-h-fp32-lm-head", "vllm-fp32-logits")


def _generation(name: str) -> Path:
    folder = Path(UPSTREAM or "") / name / "files"
    if not folder.is_dir():
        pytest.skip(f"{folder} is not there")
    return folder


def _statuses(root: Path) -> tuple[int, dict[str, str]]:
    """``fp32patch verify`` of both vLLM patches at once: its exit code and each one's status."""
    code, out = cli("verify", "-s", str(root), "--patch", VLLM_PATCHES[0], "--patch", VLLM_PATCHES[1])
    return code, {p["id"]: p["status"] for p in out["patches"]}


def _patches_module(monkeypatch, path: Path, vllm_root: Path):
    """NeMo-RL's patches.py at ``path``, imported as a vLLM worker would, with ``vllm_root``'s
    vLLM first on the path (its worker-start edits find vLLM through ``find_spec``)."""
    monkeypatch.syspath_prepend(str(vllm_root))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    module = load_module(path)
    assert module._get_vllm_file("model_executor/models/nemotron_h.py") == str(vllm_root / NEMOTRON)
    return module


@pytest.fixture
def no_variable(monkeypatch):
    monkeypatch.delenv(VAR, raising=False)


# ---------------------------------------------------------------- the first head (2026-08-31 to the rework)


def test_first_heads_worker_start_leaves_fp32patchs_vllm_file_alone(monkeypatch, tmp_path, no_variable, caplog):
    """docs/nemo-rl.md's route for this window: fp32patch's vLLM patches alone. Upstream's own
    worker-start edit finds the variable named in the file and leaves it as apply wrote it."""
    upstream = _generation("nemo-rl-first-head") / PATCHES
    root = _vllm_root(tmp_path / "vllm", patched=True)
    before = (root / NEMOTRON).read_bytes()
    patches = _patches_module(monkeypatch, upstream, root)
    caplog.set_level(logging.INFO)
    patches._patch_vllm_nemotron_h_fp32_lm_head(logging.getLogger("vllm_patch"))
    assert (root / NEMOTRON).read_bytes() == before
    assert _statuses(root) == (0, dict.fromkeys(VLLM_PATCHES, "applied"))
    assert any("already present" in r.getMessage() for r in caplog.records)


def test_first_heads_worker_start_edits_a_stock_vllm_as_before(monkeypatch, tmp_path, no_variable):
    upstream = _generation("nemo-rl-first-head") / PATCHES
    root = _vllm_root(tmp_path / "vllm", patched=False)
    before = (root / NEMOTRON).read_text()
    patches = _patches_module(monkeypatch, upstream, root)
    patches._patch_vllm_nemotron_h_fp32_lm_head(logging.getLogger("vllm_patch"))
    after = (root / NEMOTRON).read_text()
    assert after != before and VAR in after
    _assert_apply_refuses(root)


def _assert_apply_refuses(root: Path) -> None:
    """fp32patch does not patch on top of NeMo-RL's worker-start edit, nor call it vLLM's fix."""
    before = (root / NEMOTRON).read_bytes()
    code, out = cli("apply", "-s", str(root), "--patch", "nemotron-h-fp32-lm-head")
    (entry,) = out["patches"]
    assert (code, entry["status"]) == (3, "unsupported-version"), out
    assert "NeMo-RL's worker-start fp32 edit in NemotronH" in entry["message"]
    assert (root / NEMOTRON).read_bytes() == before


# ---------------------------------------------------------------- after the rework (September 2026 on)

DTENSOR_V1 = "nemo_rl/models/policy/workers/dtensor_policy_worker.py"


@pytest.fixture
def newest_checkout(tmp_path) -> Path:
    """The newest files over a 2026-08-22 checkout's (for the files no newer version of could be
    read), DTensor v1 removed as upstream removed it; a copy of its own for each test."""
    newest = _generation("nemo-rl-newest")
    base = os.environ.get("FP32PATCH_NEMO_RL_CHECKOUT")
    if not base:
        pytest.skip("set FP32PATCH_NEMO_RL_CHECKOUT to a 2026-08-22 NeMo-RL checkout to lay the newest files over")
    root = tmp_path / "nemo-rl"
    for path in ["pyproject.toml", "nemo_rl/__init__.py", *FILES, UTILS]:
        if (Path(base) / path).is_file():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(Path(base) / path, root / path)
    for path in newest.rglob("*.py"):
        (root / path.relative_to(newest)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, root / path.relative_to(newest))
    (root / DTENSOR_V1).unlink(missing_ok=True)
    return root


def _apply_nemo_rl(root: Path) -> dict:
    code, out = cli("apply", "-s", str(root), "--patch", "nemo-rl-fp32-lm-head")
    (entry,) = out["patches"]
    assert (code, entry["status"]) == (0, "applied"), out
    return entry


def test_newest_files_get_the_reworked_variant_verify_and_revert_exactly(newest_checkout):
    before = _sources(newest_checkout)
    entry = _apply_nemo_rl(newest_checkout)
    assert entry["variant"] == "logit-dtype-v2-only"
    patched = {p: (newest_checkout / p).read_text() for p in [*FILES, UTILS] if (newest_checkout / p).is_file()}
    for path, text in patched.items():
        compile(text, path, "exec", dont_inherit=True)
    # upstream's Megatron head is kept (no fp32patch head added), its DTensor refusal lifted,
    # its worker-start edit kept out of a vLLM fp32patch manages
    setup = patched["nemo_rl/models/megatron/setup.py"]
    assert "logit_dtype" in setup and {"guard-worker", "residual"} <= _markers(setup)
    assert not {"wire-policy", "wire-inference-model"} & _markers(setup)
    assert "lift-refusals" in _markers(patched[UTILS])
    assert "keep-fp32patch-vllm" in _markers(patched[PATCHES])
    code, out = cli("verify", "-s", str(newest_checkout), "--patch", "nemo-rl-fp32-lm-head")
    assert code == 0 and out["patches"][0]["status"] == "applied"
    code, _ = cli("revert", "-s", str(newest_checkout), "--patch", "nemo-rl-fp32-lm-head")
    assert code == 0 and _sources(newest_checkout) == before


def _newest_worker_start(monkeypatch, checkout: Path, vllm_root: Path):
    return _patches_module(monkeypatch, checkout / PATCHES, vllm_root)


def test_newest_worker_start_with_the_nemo_rl_patch_leaves_fp32patchs_vllm_file_alone(
    monkeypatch, tmp_path, newest_checkout, no_variable, caplog
):
    _apply_nemo_rl(newest_checkout)
    root = _vllm_root(tmp_path / "vllm", patched=True)
    before = (root / NEMOTRON).read_bytes()
    patches = _newest_worker_start(monkeypatch, newest_checkout, root)
    caplog.set_level(logging.INFO)
    assert patches._patch_vllm_nemotron_h_fp32_lm_head(logging.getLogger("vllm_patch")) is True
    assert (root / NEMOTRON).read_bytes() == before
    assert _statuses(root) == (0, dict.fromkeys(VLLM_PATCHES, "applied"))
    assert any("fp32patch's vLLM patches are installed" in r.getMessage() for r in caplog.records)


def test_newest_worker_start_without_the_nemo_rl_patch_makes_fp32patchs_file_drift(
    monkeypatch, tmp_path, newest_checkout, no_variable
):
    root = _vllm_root(tmp_path / "vllm", patched=True)
    before = (root / NEMOTRON).read_text()
    patches = _newest_worker_start(monkeypatch, newest_checkout, root)  # stock NeMo-RL
    assert patches._patch_vllm_nemotron_h_fp32_lm_head(logging.getLogger("vllm_patch")) is True
    after = (root / NEMOTRON).read_text()
    assert after != before and "_nrl_fp32_lm_head" in after and "# fp32patch: nemotron-h-fp32-lm-head" in after
    code, statuses = _statuses(root)
    assert (code, statuses["nemotron-h-fp32-lm-head"]) == (1, "drifted")
    code, _ = cli("revert", "-s", str(root), "--patch", "nemotron-h-fp32-lm-head")
    assert code != 0 and (root / NEMOTRON).read_text() == after


def test_newest_worker_start_without_fp32patchs_vllm_patches_is_upstreams(
    monkeypatch, tmp_path, newest_checkout, no_variable
):
    stock_root = _vllm_root(tmp_path / "stock-vllm", patched=False)
    stock = _newest_worker_start(monkeypatch, newest_checkout, stock_root)
    assert stock._patch_vllm_nemotron_h_fp32_lm_head(logging.getLogger("vllm_patch")) is True
    _apply_nemo_rl(newest_checkout)
    ours_root = _vllm_root(tmp_path / "our-vllm", patched=False)
    ours = _newest_worker_start(monkeypatch, newest_checkout, ours_root)
    assert ours._patch_vllm_nemotron_h_fp32_lm_head(logging.getLogger("vllm_patch")) is True
    edited = (stock_root / NEMOTRON).read_text()
    assert "_nrl_fp32_lm_head" in edited and (ours_root / NEMOTRON).read_text() == edited
    _assert_apply_refuses(stock_root)


# ---------------------------------------------------------------- the reworked config check, real


def _definitions(path: Path, namespace: dict) -> dict:
    """The top-level definitions of ``path`` run into ``namespace``, its imports left out (they
    pull in Ray, ZMQ, CUDA IPC): each statement on its own, annotations unevaluated, and one
    that needs what is left out (a pydantic model of an imported type) skipped."""
    for statement in ast.parse(path.read_text()).body:
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            continue
        code = compile(
            ast.Module([statement], type_ignores=[]),
            str(path),
            "exec",
            flags=__future__.annotations.compiler_flag,
            dont_inherit=True,
        )
        try:
            exec(code, namespace)
        except NameError:
            continue
    return namespace


def _upstream_check(root: Path):
    """``validate_fp32_lm_head_config`` of the checkout at ``root`` with the switch parsing it
    calls, all upstream's (and fp32patch's gate, where applied)."""
    # the typing names they use (NotRequired is 3.11+; a definition that needs a missing one is skipped)
    wanted = ("Annotated", "Any", "Iterable", "Literal", "NotRequired", "Optional", "TypedDict", "cast")
    names = {name: getattr(typing, name) for name in wanted if hasattr(typing, name)}
    switch = _definitions(root / "nemo_rl/utils/fp32_lm_head.py", {"__name__": "fp32_lm_head", **names})
    config = _definitions(
        root / "nemo_rl/models/generation/vllm/config.py", {"__name__": "vllm_config", **names, **switch}
    )
    utils = _definitions(
        root / UTILS,
        {
            "__name__": "policy_utils",
            "os": os,
            "warnings": warnings,
            "VllmSpecificArgs": dict,
            **names,
            **{k: v for k, v in switch.items() if k == "fp32_lm_head_enabled"},
            **{k: config[k] for k in ("VLLM_NEMOTRON_H_FP32_LM_HEAD_ENV_VAR", "vllm_nemotron_h_fp32_lm_head_enabled")},
        },
    )
    return utils["validate_fp32_lm_head_config"]


class _Llama:
    architectures = ["LlamaForCausalLM"]
    model_type = "llama"


def _yaml(trainer: str, mode, vllm, **vllm_cfg) -> tuple[dict, dict]:
    """A policy section with the trainer's switch, vLLM's key, and the backends' flags."""
    megatron = {"enabled": trainer == "megatron"}
    cfg = {"megatron_cfg": megatron, "generation": {"backend": "vllm", "vllm_cfg": {"async_engine": False, **vllm_cfg}}}
    if mode is not None:
        (megatron if trainer == "megatron" else cfg.setdefault("dtensor_cfg", {"enabled": True}))["fp32_lm_head"] = mode
    elif trainer == "dtensor":
        cfg["dtensor_cfg"] = {"enabled": True}
    if vllm is not None:
        cfg["generation"]["vllm_cfg"]["fp32_lm_head"] = vllm
    kw = {"megatron_enabled": trainer == "megatron", "dtensor_enabled": trainer == "dtensor", "model_config": _Llama()}
    return cfg, kw


def _outcome(check, cfg, kw) -> tuple[str, list[str]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            check(cfg, **kw)
            outcome = "ok"
        except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
            outcome = f"{type(exc).__name__}: {exc}"
    return outcome, [str(w.message) for w in seen]


NOT_NEMOTRON_H = "only patches vLLM's Nemotron-H"


@pytest.mark.parametrize(
    ("yaml", "stock", "patched"),
    [
        # the DTensor YAML: upstream refuses it, fp32patch's guard passes it and its head is wired
        (("dtensor", "fp32out", True), "only supported with the Megatron trainer", "ok"),
        (("dtensor", True, True), "only supported with the Megatron trainer", "ok"),
        # Megatron's YAML: upstream's own head; its warning for a model that is not NemotronH gives
        # way to the probe (fp32patch's vLLM patches cover every model)
        (("megatron", True, True), "ok+warning", "ok"),
        (("megatron", "tf32", "tf32"), "ok+warning", "ok"),  # upstream's alias, on both keys
        # one side alone: upstream does not see it on DTensor, fp32patch's guard does
        (("dtensor", "fp32out", None), "ok", "Fp32LmHeadConfigError: fp32patch (driver)"),
        (("megatron", True, None), "fp32 LM head must be enabled on both", "Fp32LmHeadConfigError: fp32patch (driver)"),
        # fp32patch's mode names are not upstream's Megatron switch: upstream refuses them; patched,
        # fp32patch's guard refuses them first, saying why
        (("megatron", "fp32out", True), 'must be true, false, or "tf32"', "'fp32out' is one of fp32patch's modes"),
    ],
    ids=[
        "dtensor-fp32out",
        "dtensor-true",
        "megatron-true",
        "megatron-tf32-alias",
        "dtensor-alone",
        "megatron-alone",
        "megatron-fp32out",
    ],
)
def test_upstreams_reworked_check_stock_and_patched(newest_checkout, tmp_path, monkeypatch, yaml, stock, patched):
    monkeypatch.delenv(VAR, raising=False)
    cfg, kw = _yaml(*yaml)
    stock_check = _upstream_check(newest_checkout)
    _apply_nemo_rl(newest_checkout)
    patched_check = _upstream_check(newest_checkout)
    for check, expected in ((stock_check, stock), (patched_check, patched)):
        outcome, seen = _outcome(check, cfg, kw)
        if expected.startswith("ok"):
            assert outcome == "ok", (yaml, outcome)
            assert any(NOT_NEMOTRON_H in w for w in seen) == expected.endswith("+warning"), (yaml, seen)
        else:
            assert expected in outcome, (yaml, outcome)


def test_the_older_vllm_spelling_is_refused_by_upstream_on_the_reworked_shape(newest_checkout, monkeypatch):
    """NRL_VLLM_FP32_LM_HEAD in env_vars: upstream reserves it since the rework; fp32patch's guard
    (which names the key to use) does not overrule that refusal."""
    monkeypatch.delenv(VAR, raising=False)
    cfg, kw = _yaml("megatron", True, None, env_vars={VAR: "1"})
    _apply_nemo_rl(newest_checkout)
    outcome, _ = _outcome(_upstream_check(newest_checkout), cfg, kw)
    assert "is reserved for NeMo-RL internal" in outcome and "vllm_cfg.fp32_lm_head instead" in outcome
