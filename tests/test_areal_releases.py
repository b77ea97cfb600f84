"""areal-fp32-lm-head on AReaL 1.0.4 (its PyPI wheel) and on its repository's 2.0 line (a checkout).

1.0.4's import root holds the release's real target files and ``.dist-info``, read out of its wheel
and cached under ``$FP32PATCH_TEST_CACHE``: ``apply`` patches them in the ``1.0.4`` variant; every
edit sits where it belongs and every patched file compiles; ``verify`` is green; re-applying
changes nothing; a hand edit reads ``drifted``; ``revert`` restores every byte. 1.0.3, before the
range, is refused by name, nothing written. The gate each patched file carries leaves AReaL's
stock code and never imports fp32patch while no engine's ``enable_fp32_lm_head`` is on.

The 2.0 line is not on PyPI and its files are not in this repository, so its test is opt-in (a
checkout before the 2.0 line is checked to be refused, nothing written):

    FP32PATCH_AREAL_CHECKOUT=/path/to/AReaL python -m pytest tests/test_areal_releases.py

(a checkout of the repository at or after cbff54d6, 2026-08-22: its ``areal/`` and
``pyproject.toml`` are copied, never patched in place).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

import fp32patch
from fp32patch.patcher.locate import checkout_names
from tests.support.lifecycle import gate_namespace, outside_state
from tests.support.pypi import import_root_from_members

SPEC = "areal-fp32-lm-head"
SNIPPETS = Path(fp32patch.__file__).parent / "patches" / "snippets"
FILES = {
    "config": "areal/api/cli_args.py",
    "fsdp": "areal/engine/fsdp_engine.py",
    "megatron": "areal/engine/megatron_engine.py",
    "registry": "areal/models/mcore/registry.py",
    "trainer": "areal/trainer/rl_trainer.py",
    "vllm_server": "areal/engine/vllm_ext/areal_vllm_server.py",
    "vllm_worker": "areal/engine/vllm_ext/vllm_worker_extension.py",
}
CHECKOUT = os.environ.get("FP32PATCH_AREAL_CHECKOUT")

# where each edit's inserted line sits: (file, the edit's first code line, the line it follows or
# precedes in the release, "after"/"before")
PLACES = [
    ("config", "_fp32patch_check_config(cfg)", "assert isinstance(cfg, config_cls)", "after"),
    ("fsdp", "_fp32patch_wire_fsdp(self)", "self._create_optimizer(ft_spec)", "before"),
    ("megatron", "_fp32patch_wire_megatron(self)", "self.model = _MegatronModelList(models)", "after"),
    (
        "trainer",
        'server_args = _fp32patch_server_args(server_args, self.config, "sglang")',
        "server_args = SGLangConfig.build_args(",
        "after",
    ),
    (
        "trainer",
        'server_args = _fp32patch_server_args(server_args, self.config, "vllm")',
        "server_args = vLLMConfig.build_args(",
        "after",
    ),
    (
        "trainer",
        '_fp32patch_probe_rollout(controller, self.config, rollout_backend, init_kwargs["role"])',
        "controller.initialize(**init_kwargs)",
        "after",
    ),
]


def _check(variant: str):
    def check(originals, patched):
        texts = {name: patched[path].decode() for name, path in FILES.items() if path in patched}
        for name, text in texts.items():
            compile(text, FILES[name], "exec", dont_inherit=True)
        for name, line, anchor, side in PLACES:
            text = texts[name]
            at = text.index(line)
            near = text.rindex(anchor, 0, at) if side == "after" else text.index(anchor, at)
            assert abs(at - near) < 400, (name, line)
            assert text.count(line) == 1, (name, line)
        # the keys: FSDP's on both, Megatron's added on 1.0.4 and AReaL's own on 2.0
        config = texts["config"]
        fsdp_cls = config[config.index("class FSDPEngineConfig") :]
        assert fsdp_cls.index("enable_fp32_lm_head: bool") < fsdp_cls.index("\nclass ")
        mcore = config[config.index("class MegatronEngineConfig") :]
        mcore = mcore[: mcore.index("\nclass ")]
        assert mcore.count("enable_fp32_lm_head: bool") == 1
        assert ("[key-megatron]" in mcore) == (variant == "1.0.4")
        # 2.0: AReaL's IEEE head and mbridge's option step aside
        registry = texts["registry"]
        megatron = texts["megatron"]
        assert ("_fp32patch_their_head(_enable_fp32_lm_head_forward)(" in registry) == (variant == "2.0")
        assert ("_fp32patch_precision_args(_mbridge_precision_args)(" in megatron) == (variant == "2.0")
        if variant == "1.0.4":
            assert patched[FILES["registry"]] == originals[FILES["registry"]]
        assert 'router.post("/fp32patch_probe_lm_head")' in texts["vllm_server"]
        assert "def fp32patch_probe_lm_head(self):" in texts["vllm_worker"]

    return check


def _lifecycle(cli, root: Path, *, version: str, variant: str) -> None:
    """apply, the edits checked, verify, apply again (nothing changes), a hand edit reads drifted,
    revert to every byte, verify (not applied): one full apply (each costs ~20 s of libcst)."""
    before = outside_state(root)
    originals = {p: (root / p).read_bytes() for p in FILES.values()}
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 0, out
    entry = out["patches"][0]
    assert (entry["status"], entry["version"], entry["variant"]) == ("applied", version, variant), entry
    patched = {p: (root / p).read_bytes() for p in originals}
    _check(variant)(originals, patched)

    code, out = cli.json("verify", "-s", root, "--patch", SPEC)
    assert code == 0 and out["patches"][0]["status"] == "applied", out
    manifest = (root / ".fp32patch" / "manifest.json").read_bytes()
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 0 and out["patches"][0]["status"] == "already-applied", out
    assert {p: (root / p).read_bytes() for p in originals} == patched
    assert (root / ".fp32patch" / "manifest.json").read_bytes() == manifest

    path = root / FILES["trainer"]
    path.write_bytes(patched[FILES["trainer"]] + b"\n# a local edit\n")
    code, out = cli.json("verify", "-s", root, "--patch", SPEC)
    assert code == 1 and out["patches"][0]["status"] == "drifted", out
    path.write_bytes(patched[FILES["trainer"]])

    reverted = cli("revert", "-s", root, "--patch", SPEC)
    assert reverted.exit_code == 0, reverted.stdout + reverted.stderr
    assert outside_state(root) == before  # every byte, the dist-info's RECORD included
    code, out = cli.json("verify", "-s", root, "--patch", SPEC)
    assert code == 1 and out["patches"][0]["status"] == "not-applied", out


@pytest.mark.network
def test_1_0_4_lifecycle(tmp_path, cli):
    root = import_root_from_members("areal", "1.0.4", list(FILES.values()), tmp_path / "site")
    _lifecycle(cli, root, version="1.0.4", variant="1.0.4")


@pytest.mark.network
def test_a_release_before_is_refused_by_name(tmp_path, cli):
    """PyPI holds 1.0.4 alone; the repository's 1.0.x tags before it install as areal 1.0.1-1.0.3.
    The real 1.0.4 files under a dist-info that says 1.0.3 are refused by name, nothing written."""
    root = import_root_from_members("areal", "1.0.4", list(FILES.values()), tmp_path / "site")
    info = root / "areal-1.0.4.dist-info"
    metadata = info / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 1.0.4", "Version: 1.0.3", 1))
    info.rename(root / "areal-1.0.3.dist-info")
    before = {p: (root / p).read_bytes() for p in FILES.values()}
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 3, out
    entry = out["patches"][0]
    assert (entry["status"], entry["version"]) == ("unsupported-version", "1.0.3")
    assert {p: (root / p).read_bytes() for p in before} == before
    assert not (root / ".fp32patch").exists()


@pytest.mark.skipif(not CHECKOUT, reason="set FP32PATCH_AREAL_CHECKOUT to an AReaL checkout (areal/, pyproject.toml)")
def test_a_checkout_is_patched_on_the_2_0_line_and_refused_cleanly_before_it(tmp_path, cli):
    """A 2.0 checkout: the whole lifecycle. A checkout before the 2.0 line (main between releases,
    whose files need not be 1.0.4's wheel's: the repository's main of 2026-05-21 says 1.0.4 and
    lacks the Megatron config field the 1.0.4 variant anchors on): refused, exit 3, nothing
    written, no state folder."""
    root = tmp_path / "AReaL"
    shutil.copytree(Path(CHECKOUT) / "areal", root / "areal")
    shutil.copy(Path(CHECKOUT) / "pyproject.toml", root / "pyproject.toml")
    version = checkout_names(root)["areal"]  # as fp32patch reads it to choose the variant
    if version.startswith("2."):
        _lifecycle(cli, root, version=version, variant="2.0")
        return
    before = outside_state(root)
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    entry = out["patches"][0]
    assert code == 3 and entry["version"] == version, out
    if entry["status"] != "unsupported-version":  # its files are not 1.0.4's: an anchor says where
        assert entry["status"] in ("anchor-missing", "anchor-ambiguous") and "nothing was written" in entry["message"]
    assert outside_state(root) == before and not (root / ".fp32patch").exists()


class _Section:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_the_gate_leaves_the_stock_code_without_the_key(monkeypatch):
    """Every gate function hands back what it was given (or does nothing) and imports nothing of
    fp32patch while no engine's key is on; on, it asks fp32patch's runtime."""
    for name in ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD", "SGLANG_DSPARK_FP32_LM_HEAD"):
        monkeypatch.delenv(name, raising=False)
    gate, imported = gate_namespace((SNIPPETS / "areal_gate.py").read_bytes())
    off = _Section(megatron=_Section(enable_fp32_lm_head=False), fsdp=_Section(enable_fp32_lm_head=False))
    config = _Section(actor=off, ref=off, critic=None)
    engine = _Section(config=off, model=object())
    args = {"tp_size": 1}
    gate["_fp32patch_check_config"](config)
    gate["_fp32patch_wire_fsdp"](engine)
    gate["_fp32patch_wire_megatron"](engine)
    assert gate["_fp32patch_server_args"](args, config, "sglang") is args and args == {"tp_size": 1}
    gate["_fp32patch_probe_rollout"](object(), config, "sglang", "rollout")
    calls = []

    def precision(chunked, fp32, fusion):
        calls.append((chunked, fp32, fusion))
        return {"enable_fp32_lm_head": True} if fp32 else {}

    assert gate["_fp32patch_precision_args"](precision)(False, False, True) == {}
    assert gate["_fp32patch_their_head"](lambda models, *, enabled: calls.append(enabled) or 0)([], enabled=False) == 0
    assert not [m for m in imported if m.startswith("fp32patch")], imported
    # on: mbridge's own fp32 head is never asked for, AReaL's forward steps aside
    assert gate["_fp32patch_precision_args"](precision)(False, True, False) == {}
    assert calls == [(False, False, True), False, (False, False, False)]
    assert gate["_fp32patch_their_head"](lambda models, *, enabled: 1 / 0)([object()], enabled=True) == 0
    assert not [m for m in imported if m.startswith("fp32patch")], imported
    on = _Section(megatron=_Section(enable_fp32_lm_head=True), fsdp=_Section(enable_fp32_lm_head=False))
    assert gate["_fp32patch_config_asked"](_Section(actor=on))
    monkeypatch.setenv("FP32PATCH_VLLM_LM_HEAD", "1")
    assert gate["_fp32patch_config_asked"](config)
