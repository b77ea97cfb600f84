"""openrlhf-fp32-lm-head on every supported OpenRLHF release, beside the vLLM patches on the vLLM it pins.

Each import root holds an OpenRLHF release's real target files and ``.dist-info`` (from its PyPI
wheel, whose package sits under ``openrlhf-X.data/purelib/``, laid out as pip installs it) with
``nemotron_h.py`` and ``logits_processor.py`` of the vLLM its ``vllm`` extra pins, as one image
would: ``apply`` patches all three in the variant the release needs; every edit sits where it
belongs and nothing else changed; ``verify`` is green; re-applying changes nothing; a hand edit
reads ``drifted``; ``revert`` restores every byte. The release before the range (0.9.7) is
refused, nothing written. With the switch off, the gate each patched file
carries hands back what it was given and never imports fp32patch.

The release's own argument parser, patched, takes ``--fp32_lm_head`` with that release's spelling
of the importance-sampling flags and of the settings the guard reads (AutoTP, 4-bit, LoRA's
targets, the vLLM engines), and the guard reads its namespace as the release builds it.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import os
import sys
import types
from pathlib import Path
from typing import Any

import pytest

import fp32patch
from fp32patch.patcher.spec import load_specs
from fp32patch.runtime.errors import Fp32LmHeadConfigError
from fp32patch.runtime.openrlhf import MARK, check_config
from tests.conftest import LOGITS_PROCESSOR, NEMOTRON, tree_digest
from tests.support.lifecycle import drifted_then_forced, lifecycle, neighbour, without_ours
from tests.support.lifecycle import gate_namespace as _gate
from tests.support.pypi import import_root_from_members, member_files

pytestmark = pytest.mark.network

SPEC = "openrlhf-fp32-lm-head"
SNIPPETS = Path(fp32patch.__file__).parent / "patches" / "snippets"
VLLM_SPECS = ("nemotron-h-fp32-lm-head", "vllm-fp32-logits")

# (OpenRLHF release, the vLLM its vllm extra pins) -> the variant
PAIRS = {
    ("0.9.8", "0.18.0"): "llm-ray-actor",
    ("0.10.0", "0.19.0"): "llm-ray-actor",
    ("0.10.1", "0.19.0"): "llm-ray-actor",
    ("0.10.1.post2", "0.19.0"): "llm-ray-actor",
    ("0.10.2", "0.19.1"): "entropy-before-temperature",
    ("0.10.3", "0.19.1"): "entropy-before-temperature",
    ("0.10.4", "0.22.1"): "entropy-before-temperature",
    ("0.11.0", "0.27.1"): "entropy-before-temperature",
    ("0.11.1", "0.29.0"): "entropy-after-temperature",
    ("0.11.2", "0.29.0"): "entropy-after-temperature",
}
FILES = {
    "cli": "openrlhf/cli/train_ppo_ray.py",
    "actor": "openrlhf/models/actor.py",
    "policy": "openrlhf/trainer/ray/ppo_actor.py",
    "launcher": "openrlhf/trainer/ray/launcher.py",
    "engine": "openrlhf/trainer/ray/vllm_engine.py",
    "worker": "openrlhf/trainer/ray/vllm_worker_wrap.py",
}
CONFIG = "openrlhf/utils/config.py"  # hierarchize, 0.10.2 and later


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split(".")[:3])


def _nested(version: str) -> bool:
    return _key(version) >= (0, 10, 2)


def _engine_class(version: str) -> str:
    return "RolloutRayActor" if _nested(version) else "LLMRayActor"


def _spec():
    return next(s for s in load_specs() if s.id == SPEC)


def _root(version: str, vllm: str, where: Path) -> Path:
    import_root_from_members("openrlhf", version, [p for _, p in _spec().target.files], where)
    return import_root_from_members("vllm", vllm, [NEMOTRON, LOGITS_PROCESSOR], where)


# ---------------------------------------------------------------- where the edits are


def _edits(version: str) -> list[tuple[str, str | None, str | None, str, str, str]]:
    """Where each inserted statement must be: (file, class, function, the statement it sits next
    to (its start, as ast.unparse writes it), "after" or "before", the inserted statement's start)."""
    after = _key(version) >= (0, 11, 1)
    engine = _engine_class(version)
    return [
        ("cli", None, None, "args = parser.parse_args()", "before", "parser.add_argument('--fp32_lm_head'"),
        ("cli", None, None, "train(args)", "before", "_fp32patch_check_args(args)"),
        ("policy", "PolicyModelActor", "init_model_from_pretrained", "actor = Actor(", "after",
         "_fp32patch_wire(actor, strategy.args, 'actor')"),
        ("policy", "PolicyModelActor", "init_model_from_pretrained", "ema_model = Actor(", "after",
         "_fp32patch_wire(ema_model, strategy.args, 'EMA model')"),
        ("launcher", "ReferenceModelActor", "init_model_from_pretrained", "model = Actor(", "after",
         "_fp32patch_wire(model, strategy.args, 'reference model')"),
        ("actor", "Actor", "forward", "output = _fp32patch_model(", "after", "output['logits'] = output['logits']"),
        ("engine", None, "create_vllm_engines", "if vllm_enable_sleep:", "before", "_fp32patch_probe_engines(vllm_engines)"),
        ("engine", engine, None, "async def reset_prefix_cache(self)", "after", "async def fp32patch_probe_lm_head(self)"),
        ("worker", "WorkerWrap", None, "def update_weight(self,", "after", "def fp32patch_probe_lm_head(self)"),
    ] + [("actor", "Actor", "forward", "output = _fp32patch_model(", "at",
          "output = _fp32patch_model(self, rolled_sequences, action_mask is not None or return_logprobs, "
          f"return_entropy, {after})(sequences")]  # fmt: skip


def _scope(tree: ast.Module, cls: str | None, name: str | None) -> ast.AST:
    if cls is None and name is None:
        return tree
    body = tree.body if cls is None else next(n for n in tree.body if getattr(n, "name", "") == cls).body
    if name is None:
        return next(n for n in tree.body if getattr(n, "name", "") == cls)
    return next(n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def _is_ours(stmt: ast.stmt) -> bool:
    """A statement the patch inserts: the gate's helpers, the probe's methods, a call of the gate, the flag."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return stmt.name.startswith(("_fp32patch_", "fp32patch_"))
    first = ast.unparse(stmt).split("\n")[0]
    if isinstance(stmt, ast.Expr) and first.startswith("parser.add_argument('--fp32_lm_head'"):
        return True
    return isinstance(stmt, ast.Expr) and first.startswith("_fp32patch_")


class _Stock(ast.NodeTransformer):
    """The replacing edits undone: each gate call read as the expression it stands in for."""

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        name = node.func.id if isinstance(node.func, ast.Name) else None
        if name == "_fp32patch_model":
            return ast.Attribute(value=ast.Name("self", ast.Load()), attr="model", ctx=ast.Load())
        if name in ("_fp32patch_log_probs_fn", "_fp32patch_entropy_fn"):
            return node.args[1]
        if name == "_fp32patch_engine_options":
            return ast.Attribute(value=node.args[0], attr="options", ctx=ast.Load())
        return node


def _check_edits(version: str, originals: dict[str, bytes], patched: dict[str, bytes]) -> None:
    gate = [n.name for n in ast.parse((SNIPPETS / "openrlhf_gate.py").read_text()).body]
    assert {k for k, path in FILES.items() if patched[path] != originals[path]} == set(FILES)
    trees = {key: ast.parse(patched[path]) for key, path in FILES.items()}
    inserted = dict.fromkeys(FILES, 0)
    for key, cls, func, anchor, where, ours in _edits(version):
        found = neighbour(_scope(trees[key], cls, func), anchor, where)
        assert found.startswith(ours), (version, key, anchor, found[:200])
        inserted[key] += where != "at" and not ours.startswith("output['logits']")
    forward = ast.unparse(_scope(trees["actor"], "Actor", "forward"))
    assert "_fp32patch_entropy_fn(self, compute_entropy)(output['logits'])" in forward
    assert "_fp32patch_log_probs_fn(self, log_probs_from_logits)(output['logits'], rolled_sequences" in forward
    engines = ast.unparse(_scope(trees["engine"], None, "create_vllm_engines"))
    assert f"_fp32patch_engine_options({_engine_class(version)}, actor_kwargs)(" in engines

    for key, path in FILES.items():
        assert [n.name for n in trees[key].body if getattr(n, "name", "").startswith("_fp32patch_")] == gate, path
        stripped, removed = without_ours(_Stock().visit(ast.parse(patched[path])), _is_ours)
        assert removed == len(gate) + inserted[key], (path, removed)
        assert ast.dump(stripped) == ast.dump(ast.parse(originals[path])), f"{path}: more changed than the edits"
        compile(patched[path], path, "exec", dont_inherit=True)


# ---------------------------------------------------------------- the gate with the switch off


class _Engine:
    """A vLLM engine's Ray actor class as create_vllm_engines uses it."""

    options = object()


def _run_gate_off(source: bytes, monkeypatch) -> list[str]:
    """Every gate function with the switch off in each spelling, as OpenRLHF's code calls it."""
    ns, imported = _gate(source)
    # the driver gates read "the guard ran here" from sys.modules: it did not
    monkeypatch.delitem(sys.modules, "fp32patch.runtime.openrlhf", raising=False)
    actor = types.SimpleNamespace(model=object(), temperature=1.0)
    stock = object()
    for off in (None, False, "", "false", "False", "no", "0", "off"):
        args = types.SimpleNamespace(fp32_lm_head=off)
        assert ns["_fp32patch_check_args"](args) is None
        assert ns["_fp32patch_wire"](actor, args, "actor") is None
        assert ns["_fp32patch_model"](actor, None, True, True, True) is actor.model
        assert ns["_fp32patch_log_probs_fn"](actor, stock) is stock
        assert ns["_fp32patch_entropy_fn"](actor, stock) is stock
        kwargs = {"model": "m"}
        assert ns["_fp32patch_engine_options"](_Engine, kwargs) is _Engine.options
        assert kwargs == {"model": "m"}
        assert ns["_fp32patch_probe_engines"]([object()]) is None
    assert not hasattr(actor, MARK)
    return imported


# ---------------------------------------------------------------- the release's own parser


def _parser(patched: bytes) -> argparse.ArgumentParser:
    """The parser train_ppo_ray's main block builds (the patched file's, the flag included)."""
    main = [n for n in ast.parse(patched).body if isinstance(n, ast.If)][-1]
    body = []
    for stmt in main.body:
        if ast.unparse(stmt).startswith("args = parser.parse_args()"):
            break
        body.append(stmt)
    namespace: dict[str, Any] = {"argparse": argparse, "os": os, "datetime": datetime.datetime}
    exec(compile(ast.Module(body=body, type_ignores=[]), "train_ppo_ray", "exec"), namespace)  # noqa: S102
    return namespace["parser"]


def _hierarchize(version: str) -> Any:
    files = member_files("openrlhf", version, [CONFIG])
    namespace: dict[str, Any] = {}
    exec(compile(files[CONFIG].read_text(), CONFIG, "exec"), namespace)  # noqa: S102
    return namespace["hierarchize"]


def _flags(version: str) -> dict[str, list[str]]:
    """This release's spelling of each setting the guard reads."""
    if _key(version) >= (0, 11, 2):
        correction = ["--algo.advantage.is_correction_level", "token", "--algo.advantage.is_correction_mode", "clip"]
    elif _nested(version):
        correction = ["--algo.advantage.is_correction_enable"]
    else:
        correction = ["--enable_vllm_is_correction"]
    dotted = _nested(version)
    return {
        "engines": ["--vllm.num_engines" if dotted else "--vllm_num_engines", "2"],
        "correction": correction,
        "autotp": ["--ds.tensor_parallel_size" if dotted else "--ds_tensor_parallel_size", "2"],
        "four_bit": ["--ds.load_in_4bit" if dotted else "--load_in_4bit"],
        "lora": [
            *(
                ("--ds.lora.rank", "8", "--ds.lora.target_modules")
                if dotted
                else ("--lora_rank", "8", "--target_modules")
            ),
            "q_proj",
            "lm_head",
        ],
    }


def _args(version: str, parser: argparse.ArgumentParser, argv: list[str]) -> Any:
    args = parser.parse_args(argv)
    return _hierarchize(version)(args) if _nested(version) else args


def _check_parser(version: str, patched: bytes) -> None:
    parser = _parser(patched)
    flags = _flags(version)
    with pytest.raises(SystemExit):  # argparse's own refusal of a near-miss flag
        parser.parse_args(["--fp32-lm-head", "fp32out"])
    on = ["--fp32_lm_head", "fp32out", *flags["engines"]]
    settings = check_config(_args(version, parser, [*on, *flags["correction"]]), environ={})
    assert (settings.mode, settings.engines) == ("fp32out", 2)
    assert settings.is_correction is not None and settings.is_correction.startswith(flags["correction"][0])
    assert check_config(_args(version, parser, on), environ={}).is_correction is None
    off = check_config(_args(version, parser, [*flags["engines"], *flags["correction"]]), environ={})
    assert off.mode is None
    for refused, said in (("autotp", "AutoTP"), ("four_bit", "4-bit"), ("lora", "LoRA adapter on the head")):
        with pytest.raises(Fp32LmHeadConfigError, match=said):
            check_config(_args(version, parser, [*on, *flags[refused]]), environ={})
    with pytest.raises(Fp32LmHeadConfigError, match="no vLLM engine"):
        check_config(_args(version, parser, ["--fp32_lm_head", "true"]), environ={})
    with pytest.raises(Fp32LmHeadConfigError, match="is not valid"):
        check_config(_args(version, parser, ["--fp32_lm_head", "fp32-out", *flags["engines"]]), environ={})


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize(("version", "vllm"), sorted(PAIRS, key=lambda p: _key(p[0])), ids=lambda v: v)
def test_lifecycle_beside_the_vllm_patches(version, vllm, tmp_path, cli, monkeypatch):
    for name in ("NRL_VLLM_FP32_LM_HEAD", "FP32PATCH_VLLM_LM_HEAD"):
        monkeypatch.delenv(name, raising=False)
    root = _root(version, vllm, tmp_path / "site-packages")

    def check(originals, patched):
        _check_edits(version, originals, patched)
        for key, path in FILES.items():
            imported = _run_gate_off(patched[path], monkeypatch)
            assert not [n for n in imported if n.startswith("fp32patch")], (key, imported)
        ns, imported = _gate(patched[FILES["actor"]])
        actor = types.SimpleNamespace(model=object())
        setattr(actor, MARK, "fp32out")
        assert ns["_fp32patch_log_probs_fn"](actor, object()).__name__ == "log_probs_from_logits"
        assert "fp32patch.runtime.openrlhf" in imported
        _check_parser(version, patched[FILES["cli"]])

    lifecycle(
        cli,
        root,
        spec=SPEC,
        version=version,
        variant=PAIRS[version, vllm],
        vllm=vllm,
        vllm_specs=VLLM_SPECS,
        paths=FILES.values(),
        check=check,
    )


@pytest.mark.parametrize("version", ["0.9.8", "0.11.2"])
def test_a_hand_edited_file_is_drifted_and_reverted_only_by_force(version, tmp_path, cli):
    root = import_root_from_members("openrlhf", version, list(FILES.values()), tmp_path / "site-packages")
    drifted_then_forced(cli, root, spec=SPEC, paths=FILES.values(), edit=FILES["actor"])


def test_a_release_before_the_range_is_refused(tmp_path, cli):
    """0.9.7 (the release before the range, not read for this patch): refused with the range the
    patch supports; nothing written, the vLLM patches' files included."""
    root = _root("0.9.7", "0.18.0", tmp_path / "site-packages")
    before = tree_digest(root)
    result = cli("apply", "-s", root)
    assert result.exit_code == 3, result.stdout + result.stderr
    said = " ".join((result.stdout + result.stderr).split())
    assert "openrlhf-fp32-lm-head: cannot patch openrlhf/cli/train_ppo_ray.py (openrlhf 0.9.7)" in said
    assert "this patch supports openrlhf >=0.9.8" in said and "nothing was written" in said
    assert tree_digest(root) == before
