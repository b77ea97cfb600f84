"""prime-rl-fp32-lm-head on a real Prime-RL checkout (opt-in: Prime-RL is not on PyPI, and its
files are not in this repository):

    FP32PATCH_PRIME_RL_CHECKOUT=/path/to/prime-rl python -m pytest tests/test_prime_rl_checkout.py

A copy of the checkout's patched files (and its ``pyproject.toml``) is patched, never the checkout
itself: apply, the edits where they belong, every patched file compiles, verify, apply again
(nothing changes), a drifted file, revert to every byte. Then the patched files' gates run as
they are in the files (Prime-RL's own modules need Python 3.12 and a GPU stack): the trainer's
key sits in ``ModelConfig`` with its own docstring, after ``lora``'s; the wiring comes right after
``setup_model``; the probe right after ``init_app_state``; each worker extension answers the
probe's RPC. Prime-RL's real heads in a real training step on the CPU:
tests/heavy/transformers/test_prime_rl_step.py.
"""

from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import tree_digest
from tests.fixtures.prime_rl_shapes import PATCHED, RL_CONFIG, SERVER, TRAIN, TRAINER_CONFIG, WORKERS
from tests.support.lifecycle import checkout_rounds, gate_namespace, neighbour

CHECKOUT = os.environ.get("FP32PATCH_PRIME_RL_CHECKOUT")
pytestmark = pytest.mark.skipif(
    not CHECKOUT, reason="set FP32PATCH_PRIME_RL_CHECKOUT to a Prime-RL checkout to try the spec on it"
)
SPEC = "prime-rl-fp32-lm-head"


@pytest.fixture
def root(tmp_path) -> Path:
    copy = tmp_path / "prime-rl"
    for path in (*PATCHED, "pyproject.toml"):
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(CHECKOUT) / path, copy / path)
    return copy


def test_lifecycle_on_the_real_files(root, cli):
    before = tree_digest(root)
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 0 and out["patches"][0]["status"] == "applied", out
    assert len(out["patches"][0]["edits"]) == 13
    for path in PATCHED:
        text = (root / path).read_text()
        compile(text, path, "exec", dont_inherit=True)
    patched = {p: (root / p).read_text() for p in PATCHED}
    checkout_rounds(cli, root, spec=SPEC, patched=patched, drift=SERVER, before=before)


def _scope(tree: ast.AST, name: str) -> ast.AST:
    return next(
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
    )


def test_the_edits_sit_where_prime_rl_needs_them(root, cli):
    assert cli("apply", "-s", root, "--patch", SPEC).exit_code == 0
    trainer = ast.parse((root / TRAINER_CONFIG).read_text())
    model_config = _scope(trainer, "ModelConfig")
    body = [ast.unparse(s) for s in model_config.body]
    key = next(i for i, s in enumerate(body) if s.startswith("fp32_lm_head: bool | str | None = None"))
    assert body[key - 2].startswith("lora:") and body[key - 1].startswith("'LoRA configuration")
    assert body[key + 1].lstrip("'\"").startswith("fp32patch: ") and body[key + 2].startswith("debug:")
    rl = ast.parse((root / RL_CONFIG).read_text())
    methods = [n.name for n in _scope(rl, "RLConfig").body if isinstance(n, ast.FunctionDef)]
    assert methods[methods.index("auto_setup_lora") + 1] == "fp32patch_fp32_lm_head"
    train = ast.parse((root / TRAIN).read_text())
    assert neighbour(_scope(train, "train"), "model = setup_model(", "after") == (
        "model = _fp32patch_wire_trainer(model, config)"
    )
    server = ast.parse((root / SERVER).read_text())
    assert neighbour(_scope(server, "custom_init_app_state"), "await init_app_state(", "after") == (
        "await _fp32patch_probe_workers(engine_client, args)"
    )
    for path in WORKERS.values():
        tree = ast.parse((root / path).read_text())
        worker = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name.endswith("WeightUpdateWorker"))
        assert "fp32patch_probe_lm_head" in [n.name for n in worker.body if isinstance(n, ast.FunctionDef)]


def test_the_gates_off_import_nothing_and_on_reach_the_runtime(root, cli):
    assert cli("apply", "-s", root, "--patch", SPEC).exit_code == 0
    namespace, imported = gate_namespace((root / TRAIN).read_bytes())
    model = object()
    off = type("C", (), {"model": type("M", (), {"fp32_lm_head": False})()})()
    assert namespace["_fp32patch_wire_trainer"](model, off) is model and imported == []
    namespace, imported = gate_namespace((root / RL_CONFIG).read_bytes())
    rl_off = type("R", (), {})()
    rl_off.trainer = type("T", (), {"model": type("M", (), {"fp32_lm_head": None})()})()
    rl_off.inference = type("I", (), {"enable_fp32_lm_head": False, "env_vars": {}, "vllm": None})()
    rl_off.env_vars = {}
    assert namespace["_fp32patch_rl_config"](rl_off) is rl_off and imported == ["os"]
    assert rl_off.trainer.model.fp32_lm_head is False

    class Config:  # what the guard reads of a pydantic RLConfig: its dump and its attributes
        def __init__(self, data):
            self.data = data
            self.trainer = type("T", (), {"model": type("M", (), {"fp32_lm_head": None})()})()

        def model_dump(self):
            return self.data

    rl_on = Config({"trainer": {"model": {}}, "inference": {"enable_fp32_lm_head": True}})
    assert namespace["_fp32patch_rl_config"](rl_on) is rl_on
    assert "fp32patch.runtime.prime_rl" in imported and rl_on.trainer.model.fp32_lm_head == "fp32out"
