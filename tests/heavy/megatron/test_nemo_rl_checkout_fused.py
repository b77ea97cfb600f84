"""Opt-in: NeMo-RL's own fused log-prob path, from a real checkout, on a real megatron-core GPTModel.

``FP32PATCH_NEMO_RL_CHECKOUT`` names a NeMo-RL checkout that has the fused path (2026-03-19 on;
the fetchable snapshot is 2026-08-22's, 7ea279abf: ``git -C <mirror> archive HEAD | tar -x -C
DIR``). Its ``nemo_rl/`` is copied twice, one copy patched by ``fp32patch apply`` (the checkout
itself is never touched). In this process (the megatron environment, TP=1 over gloo), for each
copy:

- NeMo-RL's real ``nemo_rl/distributed/model_utils.py`` is imported and its real
  ``patch_gpt_model_forward_for_linear_ce_fusion`` replaces ``GPTModel.forward``; the fused
  forward it installs runs on a real GPTModel (untied, and tied to its embedding), wired by
  fp32patch's ``wire_megatron`` or not, called as NeMo-RL's ``model_forward`` calls it (labels,
  ``return_logprobs_for_linear_ce_fusion=True``) on a packed batch-1 micro-batch, then backward;
- NeMo-RL's real ``apply_temperature_scaling`` (``nemo_rl/models/megatron/train.py``, as
  patched or not; the module itself imports Megatron's pipeline machinery and NeMo-RL's loss
  stack, so its definitions run on their own) is applied to what that forward returns, as
  ``forward_with_post_processing_fn`` does; on the patched copy, fp32patch's temperature
  hand-over, the first statement ``apply`` put into ``forward_with_post_processing_fn``, runs first.

What it shows: the stock fused path gives bf16-rounded log-probs divided by the temperature
(``log p / T``: NeMo-RL's bug at T != 1); the patched path, wired, gives fp32-grade log-probs of
``softmax(z / T)``; unwired, the patched copy is the stock one bit for bit; each Megatron
worker's guard accepts the fp32 head with ``use_fused_linear_logprobs`` where the fused path is
patched, and refuses it where the process imported NeMo-RL's fused path unpatched.
"""

from __future__ import annotations

import ast
import importlib
import os
import shutil
import sys
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer.module import Float16Module
from megatron_harness import config, no_rng_fork
from nemo_rl_fused import (
    CHUNK,
    TEMPERATURE,
    advantages,
    output_weight,
    packed_microbatch,
    reference,
    tensor_parallel_gpt,
)

CHECKOUT = os.environ.get("FP32PATCH_NEMO_RL_CHECKOUT")
pytestmark = [
    pytest.mark.usefixtures("tp1", "cpu_rng"),
    pytest.mark.skipif(not CHECKOUT, reason="set FP32PATCH_NEMO_RL_CHECKOUT to a NeMo-RL checkout (see the docstring)"),
]

MODEL_UTILS = "nemo_rl/distributed/model_utils.py"
TRAIN = "nemo_rl/models/megatron/train.py"
FP32_BOUND = 2e-5


@pytest.fixture(scope="module")
def cpu_rng():
    with no_rng_fork():
        yield


@pytest.fixture(scope="module")
def copies(tmp_path_factory) -> dict[str, Path]:
    from tests.nemo_rl_harness import cli

    real = Path(CHECKOUT or "")
    if (
        not (real / MODEL_UTILS).is_file()
        or "_gpt_forward_with_linear_ce_fusion" not in (real / MODEL_UTILS).read_text()
    ):
        pytest.skip(f"{real} has no fused log-prob path (NeMo-RL from 2026-03-19 on)")
    roots = {}
    for name in ("stock", "patched"):
        root = tmp_path_factory.mktemp(name)
        shutil.copytree(real / "nemo_rl", root / "nemo_rl")
        shutil.copy(real / "pyproject.toml", root / "pyproject.toml")
        roots[name] = root
    code, data = cli("apply", "-s", str(roots["patched"]), "--patch", "nemo-rl-fp32-lm-head")
    assert code == 0, data
    return roots


def _import_from(monkeypatch, root: Path):
    """``root``'s nemo_rl as this process's (its own imports resolve there)."""
    monkeypatch.syspath_prepend(str(root))
    for name in [n for n in sys.modules if n == "nemo_rl" or n.startswith("nemo_rl.")]:
        monkeypatch.delitem(sys.modules, name)
    return importlib.import_module("nemo_rl.distributed.model_utils")


def _train_definitions(root: Path) -> dict:
    """train.py's top-level definitions, run without its imports (see the module docstring)."""
    from tests.test_nemo_rl_upstream_files import _definitions

    names = {
        name: getattr(typing, name)
        for name in ("Any", "Callable", "Dict", "Iterator", "List", "Optional", "Tuple", "Union")
    }
    return _definitions(root / TRAIN, {"__name__": "nemo_rl_train", "torch": torch, **names})


def _step(monkeypatch, root: Path, *, mode, tied: bool) -> dict:
    """One training step through the checkout's fused forward; what nemo_rl_fused records."""
    from megatron.core.models.gpt import GPTModel

    model_utils = _import_from(monkeypatch, root)
    monkeypatch.setattr(GPTModel, "forward", GPTModel.forward)
    monkeypatch.setattr(GPTModel, "_linear_ce_fusion_forward_patched", False, raising=False)
    model_utils.patch_gpt_model_forward_for_linear_ce_fusion(chunk_size=CHUNK)
    assert GPTModel.forward is model_utils._gpt_forward_with_linear_ce_fusion

    cfg = config(hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    model = tensor_parallel_gpt(cfg, tied)
    wrapped = Float16Module(cfg, model)
    if mode is not None:
        from fp32patch.runtime.nemo_rl import wire_megatron

        wire_megatron([wrapped], {"fp32_lm_head": mode})
    seen: dict = {}
    model.decoder.register_forward_hook(lambda module, args, out: seen.__setitem__("hidden", out.detach()))

    train = _train_definitions(root)
    sampling = SimpleNamespace(temperature=TEMPERATURE, top_k=None, top_p=1.0)
    if "_fp32patch_fused_temperature" in train:  # the patched forward_with_post_processing_fn's first line
        train["_fp32patch_fused_temperature"](sampling)
    batch = packed_microbatch()
    ids = batch["input_ids"]
    out = wrapped(
        input_ids=ids,
        position_ids=batch["position_ids"],
        attention_mask=batch["attention_mask"],
        labels=ids,
        return_logprobs_for_linear_ce_fusion=True,
    )
    log_probs = train["apply_temperature_scaling"](out, sampling)
    mask = batch["has_next"][:, :-1]
    (-(log_probs * advantages() * mask).sum() / mask.sum()).backward()
    weight = output_weight(model)
    return {
        "log_probs": log_probs.detach().clone(),
        "hidden": seen["hidden"],
        "weight": weight.detach().float(),
        "weight_grad": weight.main_grad.clone(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "ids": ids,
        "has_next": batch["has_next"],
    }


def _error(record: dict, temperature: float = TEMPERATURE, scale: float = 1.0) -> float:
    want = reference(record, temperature=temperature)["log_probs"]
    return (record["log_probs"].double() * scale - want).abs().max().item()


def test_the_patch_edits_the_real_fused_forward_and_temperature(copies):
    patched = (copies["patched"] / MODEL_UTILS).read_text()
    assert "# fp32patch: nemo-rl-fp32-lm-head [fused-logprobs]" in patched
    train = ast.parse((copies["patched"] / TRAIN).read_text())
    step = next(n for n in train.body if isinstance(n, ast.FunctionDef) and n.name == "forward_with_post_processing_fn")
    first = step.body[1] if isinstance(step.body[0].value, ast.Constant) else step.body[0]  # after the docstring
    assert ast.unparse(first) == "_fp32patch_fused_temperature(sampling_params)"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_upstreams_fused_path_is_bf16_and_divides_the_log_probs_by_the_temperature(monkeypatch, copies, tied):
    stock = _step(monkeypatch, copies["stock"], mode=None, tied=tied)
    # log p / T: each log-prob of softmax(z) divided by T, bf16-rounded logits
    assert _error(stock, temperature=1.0, scale=TEMPERATURE) < 0.05
    assert _error(stock) > 0.1


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_unwired_the_patched_checkout_is_upstreams_bit_for_bit(monkeypatch, copies, tied):
    stock = _step(monkeypatch, copies["stock"], mode=None, tied=tied)
    monkeypatch.undo()
    patched = _step(monkeypatch, copies["patched"], mode=None, tied=tied)
    assert torch.equal(stock["log_probs"], patched["log_probs"])
    assert torch.equal(stock["weight_grad"], patched["weight_grad"])
    assert stock["grads"].keys() == patched["grads"].keys()
    assert all(torch.equal(stock["grads"][n], patched["grads"][n]) for n in stock["grads"])


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_wired_the_real_fused_forward_is_fp32_grade_at_the_temperature(monkeypatch, copies, tied):
    wired = _step(monkeypatch, copies["patched"], mode="fp32out", tied=tied)
    monkeypatch.undo()
    stock_error = _error(_step(monkeypatch, copies["stock"], mode=None, tied=tied), temperature=1.0, scale=TEMPERATURE)
    error = _error(wired)
    assert error < FP32_BOUND and stock_error > 100 * error, (error, stock_error)
    rows = torch.ones(wired["weight"].shape[0], dtype=torch.bool)
    if tied:  # the input tokens' rows of a tied weight also get the embedding's gradient
        rows[wired["ids"][0]] = False
    want = reference(wired)["weight_grad"][rows]
    assert ((wired["weight_grad"][rows].double() - want).norm() / want.norm()).item() < 2.0**-10


def test_each_worker_guard_accepts_the_fused_path_only_where_it_is_patched(monkeypatch, copies):
    from fp32patch.runtime.nemo_rl import Fp32LmHeadConfigError, check_config

    cfg = {
        "megatron_cfg": {"enabled": True, "fp32_lm_head": "fp32out", "use_fused_linear_logprobs": True},
        "generation": {"backend": "vllm", "vllm_cfg": {"fp32_lm_head": True}},
    }
    _import_from(monkeypatch, copies["patched"])
    assert check_config(cfg, where="megatron worker rank 0").megatron == "fp32out"
    monkeypatch.undo()
    _import_from(monkeypatch, copies["stock"])
    with pytest.raises(Fp32LmHeadConfigError, match=r"model_utils\.py is not patched by fp32patch"):
        check_config(cfg, where="megatron worker rank 0")
