"""prime-rl-fp32-lm-head on the stand-in Prime-RL checkout (tests/fixtures/prime_rl_src:
Prime-RL's shapes, not its code): apply, verify, apply again, drift, revert to every byte; each
anchor missing is refused with nothing written. Then the patched files run: Prime-RL's own
switch (default on) resolves the trainer's key in the rl launcher's config and the trainer.json
it writes, the RL trainer's head computes at fp32 grade, the inference server probes its
workers; the guard refuses one side alone; off, the stock code runs bit for bit and fp32patch
is never imported. The real checkout: tests/test_prime_rl_checkout.py (opt-in)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import tree_digest
from tests.fixtures.prime_rl_shapes import (
    PATCHED,
    RL_CONFIG,
    SERVER,
    TRAIN,
    TRAINER_CONFIG,
    WORKERS,
    EngineClient,
    checkout,
    forget_prime_rl,
    install_vllm,
    roots,
)
from tests.support.lifecycle import checkout_rounds, outside_state

pytest.importorskip("pydantic")

SPEC = "prime-rl-fp32-lm-head"
EDITS = {
    TRAINER_CONFIG: ("key",),
    RL_CONFIG: ("gate-rl-config", "rl-guard"),
    TRAIN: ("gate-train", "wire"),
    SERVER: ("gate-server", "probe"),
    WORKERS["filesystem"]: ("gate-filesystem", "probe-filesystem"),
    WORKERS["nccl"]: ("gate-nccl", "probe-nccl"),
    WORKERS["nixl"]: ("gate-nixl", "probe-nixl"),
}


def test_lifecycle(tmp_path, cli):
    root = checkout(tmp_path)
    before = outside_state(root)

    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 0, out
    [entry] = out["patches"]
    assert entry["status"] == "applied" and entry["version"] == "0.8.0", entry
    assert entry["target"] == f"prime-rl:{TRAINER_CONFIG} (+6 more)", entry
    patched = {p: (root / p).read_text() for p in PATCHED}
    for path, edits in EDITS.items():
        for edit in edits:
            assert patched[path].count(f"# fp32patch: {SPEC} [{edit}]") == 1, (path, edit)
    assert "model = _fp32patch_wire_trainer(model, config)" in patched[TRAIN]

    checkout_rounds(cli, root, spec=SPEC, patched=patched, drift=TRAIN, before=before)


@pytest.mark.parametrize(
    ("path", "anchor", "edit"),
    [
        (TRAINER_CONFIG, "    debug: DebugModelConfig = DebugModelConfig()\n", "key"),
        (RL_CONFIG, "    def auto_setup_lora(self):\n", "rl-guard"),
        (TRAIN, "    model = setup_model(config.model, parallel_dims, loading_from_ckpt_later)\n", "wire"),
        (SERVER, "    await init_app_state(engine_client, state, args, supported_tasks)\n", "probe"),
        (WORKERS["nixl"], "    def liveness_probe(self) -> None:\n", "probe-nixl"),
    ],
)
def test_a_missing_anchor_is_refused_and_nothing_written(tmp_path, cli, path, anchor, edit):
    root = checkout(tmp_path)
    text = (root / path).read_text()
    assert text.count(anchor) == 1
    renamed = anchor.replace("debug:", "debugging:").replace("auto_setup_lora", "setup_lora")
    renamed = renamed.replace("setup_model(", "build_model(").replace("await init_app_state", "await init_state")
    renamed = renamed.replace("liveness_probe", "heartbeat")
    (root / path).write_text(text.replace(anchor, renamed))
    before = tree_digest(root)
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 3, out
    assert out["patches"][0]["status"] == "anchor-missing" and f"edit {edit} " in json.dumps(out)
    assert tree_digest(root) == before


def test_an_older_release_is_refused_by_name(tmp_path, cli):
    root = checkout(tmp_path)
    pyproject = root / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('version = "0.8.0"', 'version = "0.7.1"'))
    before = tree_digest(root)
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 3 and out["patches"][0]["status"] == "unsupported-version", out
    assert "0.7.1" in json.dumps(out)
    assert tree_digest(root) == before


# ---------------------------------------------------------------- the patched files run


@pytest.fixture
def patched(tmp_path, cli, monkeypatch):
    """The patched stand-in checkout importable, vLLM's init_app_state stood in."""
    root = checkout(tmp_path)
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 0, out
    for path in reversed(roots(root)):
        monkeypatch.syspath_prepend(path)
    for name in ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD"):
        monkeypatch.delenv(name, raising=False)
    install_vllm()
    forget_prime_rl()
    yield root
    forget_prime_rl()


def _rl(**sections):
    from prime_rl.configs.rl import RLConfig

    return RLConfig(**{"trainer": {}, **sections})


def test_the_default_run_is_both_sided_with_nothing_to_add(patched):
    config = _rl(inference={})
    assert config.inference.enable_fp32_lm_head is True
    assert config.trainer.model.fp32_lm_head == "fp32out"
    # the trainer.json the launcher writes carries it, and a trainer reading it wires its head
    written = json.loads(config.trainer.model_dump_json())
    assert written["model"]["fp32_lm_head"] == "fp32out"
    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.trainer.rl.train import train

    model = train(TrainerConfig(**written))
    assert "PrimeHeadForward(kind='FusedOutputLinear', mode='fp32out')" in repr(model.lm_head.forward)


def test_prime_rl_switch_off_turns_both_sides_off(patched):
    config = _rl(inference={"enable_fp32_lm_head": False})
    assert config.trainer.model.fp32_lm_head is False
    assert not hasattr(config.inference.to_namespace(), "additional_config")
    from prime_rl.trainer.rl.train import train

    model = train(config.trainer)
    assert "forward" not in model.lm_head.__dict__


@pytest.mark.parametrize(
    ("sections", "says"),
    [
        ({"inference": {"enable_fp32_lm_head": False}, "trainer": {"model": {"fp32_lm_head": "fp32out"}}}, "one"),
        ({"inference": {}, "trainer": {"model": {"fp32_lm_head": False}}}, "one"),
        ({"inference": {"enable_fp32_lm_head": False, "env_vars": {"FP32PATCH_VLLM_LM_HEAD": "1"}}}, "variable"),
        ({"inference": {"enable_fp32_lm_head": False, "vllm": {"head_dtype": "float32"}}}, "head_dtype"),
        ({"inference": {}, "trainer": {"model": {"lora": {"target_modules": ["q_proj", "lm_head"]}}}}, "lora"),
        ({"inference": {}, "trainer": {"model": {"quantization": {"ignore_patterns": ["router"]}}}}, "quantized"),
        ({"inference": {}, "trainer": {"model": {"fp32_lm_head": "FP32OUT"}}}, "mode"),
    ],
)
def test_the_rl_config_refuses_what_cannot_agree(patched, sections, says):
    from pydantic import ValidationError

    words = {
        "one": "the trainer would compute",
        "variable": "FP32PATCH_VLLM_LM_HEAD='1' turns fp32patch's vLLM head on while inference.enable_fp32_lm_head",
        "head_dtype": "inference.vllm.head_dtype = 'float32'",
        "lora": "trainer.model.lora.target_modules ['lm_head'] adapt lm_head",
        "quantized": "quantizes lm_head",
        "mode": 'did you mean "fp32out"',
    }
    with pytest.raises(ValidationError) as caught:
        _rl(**sections)
    assert "fp32patch (rl config): " in str(caught.value) and words[says] in str(caught.value)


def test_the_standalone_trainer_follows_prime_rl_default(patched):
    from prime_rl.configs.trainer import TrainerConfig
    from prime_rl.trainer.rl.train import train

    model = train(TrainerConfig(model={"name": "tiny-gemma", "fused_lm_head_token_chunk_size": "disabled"}))
    assert "GemmaVanillaOutputLinear" in repr(model.lm_head.forward)


def _worker(path_key: str, model):
    module = __import__(f"prime_rl.inference.vllm.worker.{path_key}", fromlist=["*"])
    cls = next(v for k, v in vars(module).items() if k.endswith("WeightUpdateWorker"))
    worker = cls()
    worker.model_runner = SimpleNamespace(model=model)
    return worker


def test_the_server_probes_every_worker_through_prime_rls_extensions(patched, monkeypatch):
    import fp32patch.runtime.heads.vllm_probe as vllm_probe
    from fp32patch.runtime.errors import Fp32LmHeadMismatchError

    answers = {"a": "float32", "b": "float32"}
    monkeypatch.setattr(
        vllm_probe, "probe_vllm_model", lambda m: {"dtype": answers[m], "way": "native", "host": "h", "pid": m}
    )
    monkeypatch.setattr("fp32patch.runtime.prime_rl.probe._prime_rl_state", lambda m: (True, True))
    from prime_rl.configs.inference import InferenceConfig
    from prime_rl.inference.vllm.server import custom_init_app_state

    args = InferenceConfig().to_namespace()
    client = EngineClient([_worker("filesystem", "a"), _worker("nixl", "b")])
    state = SimpleNamespace()
    asyncio.run(custom_init_app_state(client, state, args, ("generate",)))
    assert client.asked == ["fp32patch_probe_lm_head"] and state.liveness_timeout_seconds == 10

    answers["b"] = "bfloat16"
    monkeypatch.setattr("fp32patch.runtime.prime_rl.probe._prime_rl_state", lambda m: (m == "a", True))
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        asyncio.run(custom_init_app_state(EngineClient([_worker("nccl", "a"), _worker("nixl", "b")]), state, args, ()))
    text = str(caught.value)
    assert text.startswith("fp32patch (inference server): the vLLM workers' logits do not follow")
    assert "vLLM worker 1 (host h, pid b) computes bfloat16 logits" in text
    assert "monkey_patch_fp32_lm_head is not installed" in text


_OFF_RUN = textwrap.dedent(
    """
    import asyncio, json, sys
    sys.path[:0] = [*{roots!r}, {repo!r}]
    from tests.fixtures.prime_rl_shapes import EngineClient, install_vllm
    install_vllm()
    import torch
    from prime_rl.configs.rl import RLConfig
    from prime_rl.inference.vllm.server import custom_init_app_state
    from prime_rl.trainer.rl.train import step, train
    config = RLConfig(trainer={{"model": {{"name": {name!r}}}}}, inference={{"enable_fp32_lm_head": False}})
    client = EngineClient([])
    asyncio.run(custom_init_app_state(client, type("S", (), {{}})(), config.inference.to_namespace(), ()))
    model = train(config.trainer)
    ids = torch.tensor([[5, 17, 250, 3, 99, 42, 7, 120]])
    out = step(model, ids, torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]), ids.roll(-1, 1), torch.full((1, 8), 0.7))
    out["logprobs"].sum().backward()
    print(json.dumps({{"logprobs": out["logprobs"].tolist(), "grad": model.lm_head.weight.grad.float().sum().item(),
                      "asked": client.asked, "fp32patch": sorted(m for m in sys.modules if m.startswith("fp32patch"))}}))
    """
)


@pytest.mark.parametrize("name", ["tiny-gemma"])  # the capped fused head: the longest stock path
def test_off_runs_the_stock_code_bit_for_bit_and_never_imports_fp32patch(tmp_path, cli, name):
    runs = []
    for apply in (False, True):
        root = checkout(tmp_path / str(apply))
        if apply:
            assert cli("apply", "-s", root, "--patch", SPEC).exit_code == 0
        repo = str(Path(__file__).resolve().parents[1])
        code = _OFF_RUN.format(roots=roots(root), repo=repo, name=name)
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
        assert run.returncode == 0, run.stderr
        runs.append(json.loads(run.stdout.splitlines()[-1]))
    stock, patched_off = runs
    assert patched_off == stock and stock["fp32patch"] == [] and stock["asked"] == []


def test_the_rl_gate_imports_fp32patch_only_where_a_route_to_fp32_is_on(patched):
    from tests.support.lifecycle import gate_namespace

    cases = [
        ({"trainer": {"model": {"fp32_lm_head": False}}}, False),  # no [inference], the trainer off
        ({"trainer": {}, "inference": {"enable_fp32_lm_head": False}}, False),
        ({"trainer": {}}, True),  # no [inference]: the trainer follows the switch's default, on
        ({"trainer": {}, "inference": {}}, True),
    ]
    for sections, imports in cases:
        namespace, imported = gate_namespace((patched / RL_CONFIG).read_bytes())
        config = _rl(**sections)  # the class's own validator ran; the gate again, its imports recorded
        namespace["_fp32patch_rl_config"](config)
        assert ("fp32patch.runtime.prime_rl" in imported) is imports, sections
