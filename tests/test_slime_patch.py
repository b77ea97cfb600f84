"""slime-fp32-lm-head on the stand-in slime checkout (tests/fixtures/slime_src: slime's shapes,
not its code): apply, verify, apply again, drift, revert to every byte; each anchor missing is
refused with nothing written; slime v0.2.4's shape of the wiring's anchor. Then the patched files
run (SGLang's ServerArgs and requests stood in, tests/fixtures/slime_shapes.py): one flag turns
both engines on, the guard refuses through slime's parse_args, each server's arguments carry
SGLang's flag and its server is probed; without the flag the stock code runs and fp32patch is
never imported. The real snapshot: tests/test_slime_checkout.py (opt-in)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import tree_digest
from tests.fixtures.slime_shapes import (
    ARGUMENTS,
    ENGINE,
    MODEL,
    PATCHED,
    checkout,
    forget_slime,
    install_sglang,
    sglang_http,
)
from tests.support.lifecycle import checkout_rounds, outside_state

SPEC = "slime-fp32-lm-head"
EDITS = {
    ARGUMENTS: ("gate-arguments", "flag", "guard"),
    MODEL: ("gate-model", "wire"),
    ENGINE: ("gate-engine", "server-args", "probe", "probe-external"),
}


def test_lifecycle(tmp_path, cli):
    root = checkout(tmp_path)
    before = outside_state(root)

    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 0, out
    [entry] = out["patches"]
    assert entry["status"] == "applied" and entry["target"] == f"slime:{ARGUMENTS} (+2 more)", entry
    assert entry["edits"] == [edit for edits in EDITS.values() for edit in edits]
    patched = {p: (root / p).read_text() for p in PATCHED}
    for path, edits in EDITS.items():
        for edit in edits:
            assert patched[path].count(f"# fp32patch: {SPEC} [{edit}]") >= 1, (path, edit)
    assert "model = _fp32patch_wire_model(model, args, role)" in patched[MODEL]

    checkout_rounds(cli, root, spec=SPEC, patched=patched, drift=MODEL, before=before)


@pytest.mark.parametrize(
    ("path", "anchor", "edit"),
    [
        (ARGUMENTS, "        parser = add_custom_megatron_plugins_arguments(parser)\n", "flag"),
        (ARGUMENTS, "    slime_validate_args(args)\n\n    return args", "guard"),
        (MODEL, "    model = get_model(get_model_provider_func(args, role), ModelType.encoder_or_decoder)\n", "wire"),
        (ENGINE, "    return kwargs, external_engine_need_check_fields\n", "server-args"),
        (ENGINE, "            self._init_normal(server_args_dict)\n", "probe"),
    ],
)
def test_a_missing_anchor_is_refused_and_nothing_written(tmp_path, cli, path, anchor, edit):
    root = checkout(tmp_path)
    text = (root / path).read_text()
    assert text.count(anchor) == 1
    indent = anchor[: len(anchor) - len(anchor.lstrip())]
    replacement = indent + ("return args" if edit == "guard" else "pass\n")
    (root / path).write_text(text.replace(anchor, replacement))
    before = tree_digest(root)
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 3, out
    assert out["patches"][0]["status"] == "anchor-missing" and edit in json.dumps(out)
    assert tree_digest(root) == before


def test_slime_v0_2_4_shape_of_the_wiring_anchor(tmp_path, cli):
    """v0.2.4 (2026-03-29) wrapped the provider in get_model's call; main wraps it inside get_model_provider_func."""
    root = checkout(tmp_path)
    text = (root / MODEL).read_text()
    older = text.replace(
        "get_model(get_model_provider_func(args, role), ModelType.encoder_or_decoder)",
        "get_model(\n        wrap_model_provider_with_freeze(get_model_provider_func(args, role), args), "
        "ModelType.encoder_or_decoder\n    )",
    ).replace(
        "from .model_provider import get_model_provider_func",
        "from .model_provider import get_model_provider_func, wrap_model_provider_with_freeze",
    )
    (root / MODEL).write_text(older)
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 0 and out["patches"][0]["status"] == "applied", out
    assert "_fp32patch_wire_model(model, args, role)" in (root / MODEL).read_text()


# ---------------------------------------------------------------- the patched files run


@pytest.fixture
def patched(tmp_path, cli, monkeypatch):
    """The patched stand-in checkout on sys.path, SGLang's ServerArgs and requests stood in."""
    root = checkout(tmp_path)
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 0, out
    install_sglang()
    asked: list = []
    get, post = sglang_http(asked)
    requests = ModuleType("requests")  # stands in for the HTTP client the probe uses by default
    requests.get, requests.post = get, post
    monkeypatch.setitem(sys.modules, "requests", requests)
    monkeypatch.syspath_prepend(str(root))
    forget_slime()
    yield asked
    forget_slime()
    for name in ("sglang", "sglang.srt", "sglang.srt.server_args"):
        sys.modules.pop(name, None)


def _parse(monkeypatch, *argv: str):
    monkeypatch.setattr(sys, "argv", ["train.py", "--hf-checkpoint", "/models/qwen", *argv])
    from slime.utils.arguments import parse_args

    return parse_args()


def test_one_flag_turns_sglang_on_and_each_server_is_probed(patched, monkeypatch):
    args = _parse(monkeypatch, "--fp32-lm-head", "fp32out", "--sglang-api-key", "k")
    assert args.fp32_lm_head == "fp32out" and args.sglang_enable_fp32_lm_head is False
    from slime.backends.sglang_utils import sglang_engine

    engine = sglang_engine.SGLangEngine(args, rank=0)
    engine.init("127.0.0.1:5000", 30001, 5001)
    [launched] = sglang_engine.LAUNCHED
    assert launched.enable_fp32_lm_head is True and launched.model_path == "/models/qwen"
    headers = {"Authorization": "Bearer k"}
    assert patched == [
        ("GET", "http://127.0.0.1:30001/server_info", headers),
        ("POST", "http://127.0.0.1:30001/generate", headers),
    ]


def test_a_group_override_that_turns_sglang_flag_off_is_refused(patched, monkeypatch):
    args = _parse(monkeypatch, "--fp32-lm-head", "fp32out")
    from slime.backends.sglang_utils import sglang_engine

    from fp32patch.runtime.errors import Fp32LmHeadConfigError

    engine = sglang_engine.SGLangEngine(args, rank=0, sglang_overrides={"enable-fp32-lm-head": False})
    with pytest.raises(Fp32LmHeadConfigError, match="enable_fp32_lm_head is False: the two disagree"):
        engine.init("127.0.0.1:5000", 30001, 5001)
    assert sglang_engine.LAUNCHED == []


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--sglang-enable-fp32-lm-head"], "--sglang-enable-fp32-lm-head is on but --fp32-lm-head is off"),
        (["--fp32_lm_head", "fp32out"], "--fp32_lm_head is not an option"),
        (["--fp32-lm-head", "fp32out", "--sglang-rl-on-policy-target", "fsdp"], "rl_on_policy_target='fsdp'"),
        (["--fp32-lm-head", "TF32"], 'did you mean "tf32"'),
    ],
)
def test_parse_args_refuses(patched, monkeypatch, argv, match):
    from fp32patch.runtime.errors import Fp32LmHeadConfigError

    with pytest.raises(Fp32LmHeadConfigError, match=r"^fp32patch \(parse_args\): ") as caught:
        _parse(monkeypatch, *argv)
    assert match in str(caught.value)


_OFF_RUN = textwrap.dedent(
    """
    import json, sys
    sys.path[:0] = [{root!r}, {repo!r}]
    from tests.fixtures.slime_shapes import install_sglang
    install_sglang()
    sys.argv = ["train.py", "--hf-checkpoint", "/models/qwen"]
    from slime.utils.arguments import parse_args
    from slime.backends.sglang_utils import sglang_engine
    args = parse_args()
    sglang_engine.SGLangEngine(args, rank=0).init("127.0.0.1:5000", 30001, 5001)
    [launched] = sglang_engine.LAUNCHED
    print(json.dumps({{"flag": launched.enable_fp32_lm_head, "ours": getattr(args, "fp32_lm_head", "absent"),
                      "fp32patch": sorted(m for m in sys.modules if m.startswith("fp32patch"))}}))
    """
)


@pytest.mark.parametrize("apply", [False, True], ids=["stock", "patched"])
def test_off_runs_the_stock_code_and_never_imports_fp32patch(tmp_path, cli, apply):
    root = checkout(tmp_path)
    if apply:
        assert cli("apply", "-s", root, "--patch", SPEC).exit_code == 0
    repo = str(Path(__file__).resolve().parents[1])
    run = subprocess.run(
        [sys.executable, "-c", _OFF_RUN.format(root=str(root), repo=repo)], capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.splitlines()[-1])
    assert got == {"flag": False, "ours": None if apply else "absent", "fp32patch": []}
