"""Two TRL trainers in one process: vLLM's switch that fp32patch sets for a colocated engine is
that engine's, not the process's.

A colocated vLLM (TRL's ``external_launcher``) runs in the trainer's process and, before vLLM
0.26, its patched logits processor reads the switch on every call. These tests drive TRL's
runtime as its patched files do (``set_vllm_env`` before ``LLM(...)``, ``probe_colocated`` after)
with an engine model that records the switch it computes its logits under; the real engines
meet the same code in tests/heavy/trl/test_two_trainers.py.
"""

from __future__ import annotations

import dataclasses
import os
import types
from typing import Any

import pytest
import torch

from fp32patch.runtime import trl as runtime
from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.heads import vllm_engine_switch
from fp32patch.runtime.modes import VLLM_SWITCHES
from fp32patch.runtime.trl.fused import MARK

GRPO = type("GRPOTrainer", (), {"__module__": "trl.trainer.grpo_trainer"})


@dataclasses.dataclass
class Args:
    fp32_lm_head: Any = None
    cast_lm_head_to_fp32: bool = False
    use_vllm: bool = True
    vllm_mode: str = "colocate"
    bf16: bool = True
    fp16: bool = False
    use_liger_kernel: bool = False


class EngineModel(torch.nn.Module):
    """vLLM's model as the colocated engine's runner holds it: ``compute_logits`` records the
    switch as the patched logits processor would read it at that call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, str | None]] = []

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.seen.append({name: os.environ.get(name) for name in VLLM_SWITCHES})
        return hidden


def _llm(model: EngineModel) -> Any:
    runner = types.SimpleNamespace(model=model)
    return types.SimpleNamespace(
        llm_engine=types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=types.SimpleNamespace(model_runner=runner)))
    )  # fmt: skip


def _trainer(mode: Any) -> Any:
    trainer = GRPO()
    trainer.args = Args(fp32_lm_head=mode)
    trainer.model = types.SimpleNamespace(dtype=torch.float32)
    return trainer


@pytest.fixture(autouse=True)
def clean_switch(monkeypatch):
    for name in VLLM_SWITCHES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fp32_probe(monkeypatch):
    """The in-process probe's report: whatever switch the engine computes under, float32 when on."""

    def probe(model):
        model.compute_logits(torch.zeros(1))
        name = next((name for name, value in model.seen[-1].items() if value), None)
        env = model.seen[-1][name] if name else None
        return {"dtype": "float32" if env else "bfloat16", "way": "copy" if env else "off", "env": env,
                "env_name": name, "host": "h", "pid": 1, "patched": True}  # fmt: skip

    monkeypatch.setattr("fp32patch.runtime.heads.vllm_probe.probe_vllm_model", probe)


def _colocated(mode: Any) -> EngineModel:
    """One trainer with its colocated engine, as TRL builds it: the guard, the wiring's mark,
    the switch set, ``LLM(...)``, the probe."""
    trainer = _trainer(mode)
    runtime.check_trainer(trainer, "fused")
    policy = torch.nn.Linear(2, 2)
    if mode is not None:
        setattr(policy, MARK, mode)
        runtime.set_vllm_env(policy, where="colocated vLLM")
    engine = EngineModel()
    if mode is not None:
        runtime.probe_colocated(_llm(engine), policy)
    return engine


def test_on_then_off_each_trainer_gets_what_it_asked(fp32_probe):
    first = _colocated("fp32out")
    assert all(os.environ.get(name) is None for name in VLLM_SWITCHES)  # the process's switch is put back
    second = _colocated(None)  # was refused: "NRL_VLLM_FP32_LM_HEAD="1" in this process but fp32_lm_head is off"
    first.compute_logits(torch.zeros(1))
    second.compute_logits(torch.zeros(1))
    assert first.seen[-1] == {"FP32PATCH_VLLM_LM_HEAD": None, "NRL_VLLM_FP32_LM_HEAD": "1"}  # still fp32
    assert second.seen[-1] == {"FP32PATCH_VLLM_LM_HEAD": None, "NRL_VLLM_FP32_LM_HEAD": None}  # stock
    assert all(os.environ.get(name) is None for name in VLLM_SWITCHES)
    assert vllm_engine_switch.held(first) == {"FP32PATCH_VLLM_LM_HEAD": None, "NRL_VLLM_FP32_LM_HEAD": "1"}
    assert vllm_engine_switch.held(second) is None


def test_off_then_on_then_off(fp32_probe):
    engines = [_colocated(None), _colocated("fp32out"), _colocated(None)]
    for engine in engines:
        engine.compute_logits(torch.zeros(1))
    assert [engine.seen[-1]["NRL_VLLM_FP32_LM_HEAD"] for engine in engines] == [None, "1", None]


def test_a_refused_probe_still_puts_the_switch_back(monkeypatch):
    monkeypatch.setattr(
        "fp32patch.runtime.heads.vllm_probe.probe_vllm_model",
        lambda model: {"dtype": "bfloat16", "way": "stock", "env": "1", "env_name": "NRL_VLLM_FP32_LM_HEAD",
                       "host": "h", "pid": 1, "patched": False, "patch_files": ["/x/layers/logits_processor.py"]},
    )  # fmt: skip
    with pytest.raises(runtime.Fp32LmHeadMismatchError, match="/x/layers/logits_processor.py"):
        _colocated("fp32out")
    assert all(os.environ.get(name) is None for name in VLLM_SWITCHES)
    _colocated(None)  # the next trainer, switch off, starts


def test_an_engine_that_never_got_built_leaves_nothing_for_the_next_trainer():
    policy = torch.nn.Linear(2, 2)
    setattr(policy, MARK, "fp32out")
    runtime.check_trainer(_trainer("fp32out"), "fused")
    runtime.set_vllm_env(policy, where="colocated vLLM")  # then LLM(...) raises: no probe
    assert os.environ["NRL_VLLM_FP32_LM_HEAD"] == "1"
    runtime.check_trainer(_trainer(None), "fused")  # the gate calls the guard: the variable is on
    assert all(os.environ.get(name) is None for name in VLLM_SWITCHES)


def test_a_switch_the_user_set_stays_theirs(fp32_probe, monkeypatch):
    monkeypatch.setenv("FP32PATCH_VLLM_LM_HEAD", "fp32out")
    engine = _colocated("fp32out")
    assert os.environ["FP32PATCH_VLLM_LM_HEAD"] == "fp32out" and vllm_engine_switch.held(engine) is None
    with pytest.raises(
        Fp32LmHeadConfigError, match='FP32PATCH_VLLM_LM_HEAD="fp32out" in this process but fp32_lm_head is off'
    ):
        runtime.set_vllm_env(torch.nn.Linear(2, 2), where="colocated vLLM")


def test_hold_wraps_once_and_follows_the_latest_values():
    engine = EngineModel()
    vllm_engine_switch.hold(engine, {"NRL_VLLM_FP32_LM_HEAD": "1"})
    vllm_engine_switch.hold(engine, {"FP32PATCH_VLLM_LM_HEAD": "copy"})
    engine.compute_logits(torch.zeros(1))
    assert engine.seen == [{"FP32PATCH_VLLM_LM_HEAD": "copy", "NRL_VLLM_FP32_LM_HEAD": None}]
    assert "compute_logits" in vars(engine) and not hasattr(vars(engine)["compute_logits"], "__wrapped__.__wrapped__")
    with pytest.raises(ValueError, match="not vLLM's switch"):
        vllm_engine_switch.hold(engine, {"PATH": "/"})


def test_the_probe_names_the_file_that_is_not_patched():
    """A Qwen2 worker in a venv left unpatched: the patch for every model lives in vLLM's
    layers/logits_processor.py, so that file is named, not the model's own."""
    report = {"dtype": "bfloat16", "way": "stock", "env": "1", "env_name": "NRL_VLLM_FP32_LM_HEAD", "host": "h",
              "pid": 1, "patched": False, "file": "/venv/vllm/model_executor/models/qwen2.py",
              "patch_files": ["/venv/vllm/model_executor/layers/logits_processor.py"]}  # fmt: skip
    with pytest.raises(runtime.Fp32LmHeadMismatchError) as caught:
        runtime.check_reports([report], "fp32out", where="vLLM server")
    said = str(caught.value)
    assert (
        "the model file is not patched (run fp32patch apply in that venv): /venv/vllm/model_executor/layers/logits_processor.py"
        in said
    )
    assert "qwen2.py" not in said
