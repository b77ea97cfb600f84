"""slime-fp32-lm-head on a real slime checkout (opt-in: slime is not on PyPI, and its files are not
in this repository):

    FP32PATCH_SLIME_CHECKOUT=/path/to/slime python -m pytest tests/test_slime_checkout.py

A copy of the checkout's ``slime/`` package is patched, never the checkout itself: apply, the
edits where they belong, every patched file compiles, verify, apply again (nothing changes), a
drifted file, revert to every byte. Then slime's own patched files run where they import on this
machine, with named stand-ins for what needs a GPU, a cluster or the network (``STAND_INS``):
slime's argument functions register ``--fp32-lm-head`` beside all of slime's and SGLang's options,
the guard in ``arguments.py`` refuses what it must, ``_compute_server_args`` sets SGLang's flag in
a server's arguments, and ``SGLangEngine.init`` probes the server it launched (the launch and the
HTTP answers stood in). The Megatron side needs Megatron-LM's ``megatron.training``: it runs on the
stand-in checkout in tests/heavy/megatron/test_slime_step.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import tree_digest
from tests.fixtures.slime_shapes import PATCHED, ServerArgs, forget_slime, sglang_http
from tests.support.lifecycle import checkout_rounds

CHECKOUT = os.environ.get("FP32PATCH_SLIME_CHECKOUT")
pytestmark = pytest.mark.skipif(
    not CHECKOUT, reason="set FP32PATCH_SLIME_CHECKOUT to a slime checkout (slime/ and setup.py) to try the spec on it"
)
SPEC = "slime-fp32-lm-head"


@pytest.fixture
def root(tmp_path) -> Path:
    copy = tmp_path / "slime"
    shutil.copytree(Path(CHECKOUT) / "slime", copy / "slime")
    shutil.copy(Path(CHECKOUT) / "setup.py", copy / "setup.py")
    return copy


def test_lifecycle_on_the_real_files(root, cli):
    before = tree_digest(root)
    code, out = cli.json("apply", "-s", root, "--patch", SPEC)
    assert code == 0 and out["patches"][0]["status"] == "applied", out
    assert len(out["patches"][0]["edits"]) == 9
    for path in PATCHED:
        text = (root / path).read_text()
        compile(text, path, "exec", dont_inherit=True)
        assert f"# fp32patch: {SPEC} [gate-" in text
    model = (root / "slime/backends/megatron_utils/model.py").read_text()
    wired = model.index("model = _fp32patch_wire_model(model, args, role)")
    assert model.rindex("get_model(", 0, wired) > model.index("def setup_model_and_optimizer")

    patched = {p: (root / p).read_text() for p in PATCHED}
    checkout_rounds(cli, root, spec=SPEC, patched=patched, drift=PATCHED[2], before=before)


# ---------------------------------------------------------------- slime's patched files, run


@dataclasses.dataclass
class Sglang015ServerArgs(ServerArgs):
    """The stand-in ServerArgs with the further fields slime's _compute_server_args sets (SGLang 0.5.15's names)."""

    trust_remote_code: bool = False
    random_seed: int | None = None
    enable_memory_saver: bool = False
    nnodes: int = 1
    gpu_id_step: int = 1
    base_gpu_id: int = 0
    dp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    skip_server_warmup: bool = False
    enable_draft_weights_cpu_backup: bool = False
    enable_metrics: bool = False
    dtype: str = "auto"

    @staticmethod
    def add_cli_args(parser) -> None:
        ServerArgs.add_cli_args(parser)
        for name in ("--dp-size", "--pp-size", "--ep-size"):
            parser.add_argument(name, type=int, default=1)


class RouterArgs:
    """Stands in for sglang_router's RouterArgs (slime adds its options; none matter here)."""

    @staticmethod
    def add_cli_args(parser, use_router_prefix=False, exclude_host_port=False):
        return parser


def _module(name: str, **attrs) -> ModuleType:
    module = ModuleType(name)
    module.__dict__.update(attrs)
    return module


def stand_ins(asked: list) -> dict[str, ModuleType]:
    """What slime's files import that does not run here: SGLang (a CUDA build) and its router,
    wandb, httpx and urllib3 (clients of services not reached), Ray's actor base, the logging set-up
    (slime.observability imports wandb), the accelerator registry (a GPU's device ids), and requests
    (the probe's HTTP client: answers recorded)."""
    get, post = sglang_http(asked)

    class RequestException(Exception):
        pass

    return {
        "sglang": _module("sglang"),
        "sglang.srt": _module("sglang.srt"),
        "sglang.srt.server_args": _module("sglang.srt.server_args", ServerArgs=Sglang015ServerArgs),
        "sglang.srt.utils": _module("sglang.srt.utils", kill_process_tree=lambda *a, **k: None),
        "sglang_router": _module("sglang_router", __version__="0.3.2-slime"),
        "sglang_router.launch_router": _module("sglang_router.launch_router", RouterArgs=RouterArgs),
        "wandb": _module("wandb"),
        "ray": _module("ray"),  # v0.2.4's slime.utils.misc imports it
        "httpx": _module("httpx", AsyncClient=object),
        "urllib3": _module("urllib3"),
        "urllib3.exceptions": _module("urllib3.exceptions", NewConnectionError=ConnectionError),
        "requests": _module("requests", get=get, post=post, RequestException=RequestException, Session=object),
        "slime.observability": _module("slime.observability", __path__=[]),
        "slime.observability.logging_utils": _module(
            "slime.observability.logging_utils", configure_logger=lambda *a: None
        ),
        "slime.utils.accelerator": _module(
            "slime.utils.accelerator",
            initialize_accelerator=lambda: None,
            resolve_visible_device_id=lambda index: index,
        ),
        "slime.ray": _module("slime.ray", __path__=[]),
        "slime.ray.ray_actor": _module("slime.ray.ray_actor", RayActor=object),
    }


@pytest.fixture
def slime(root, cli, monkeypatch):
    """The patched copy importable, its imports that need a GPU or a cluster stood in."""
    assert cli("apply", "-s", root, "--patch", SPEC).exit_code == 0
    asked: list = []
    forget_slime()
    for name, module in stand_ins(asked).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.syspath_prepend(str(root))
    yield asked
    forget_slime()


def _args(monkeypatch, *argv: str) -> argparse.Namespace:
    """slime's namespace as parse_args builds it, from slime's own argument functions and SGLang's
    options through slime's sglang_parse_args (Megatron's parser stood in by a plain one)."""
    from slime.utils import arguments

    line = ["train.py", "--hf-checkpoint", "/models/qwen", "--rollout-batch-size", "8", *argv]
    monkeypatch.setattr(sys, "argv", line)
    parser = argparse.ArgumentParser(allow_abbrev=False)
    arguments.get_slime_extra_args_provider()(parser)
    args, _ = parser.parse_known_args(line[1:])
    for key, value in [*vars(arguments._pre_parse_mode()).items(), *vars(arguments.sglang_parse_args()).items()]:
        setattr(args, key, value)
    args.seed, args.fp16 = 1234, False  # Megatron's options
    # what slime_validate_args derives (the rest of it reads Megatron's options)
    args.rollout_external = args.rollout_external_engine_addrs is not None
    args.use_critic = args.advantage_estimator == "ppo"
    return args


def test_the_flag_reaches_sglang_and_the_server_is_probed(slime, monkeypatch):
    args = _args(monkeypatch, "--fp32-lm-head", "fp32out")
    from slime.backends.sglang_utils import sglang_engine
    from slime.utils import arguments

    assert arguments._fp32patch_check_args(args) is None  # the guard as parse_args calls it
    launched = []
    monkeypatch.setattr(sglang_engine, "launch_server_process", launched.append)
    engine = sglang_engine.SGLangEngine(args, rank=0)
    engine.init("127.0.0.1:5000", 30001, 5001, host="127.0.0.1")
    [server_args] = launched
    assert dataclasses.asdict(server_args)["enable_fp32_lm_head"] is True
    assert [(method, url) for method, url, _ in slime] == [
        ("GET", "http://127.0.0.1:30001/server_info"),
        ("POST", "http://127.0.0.1:30001/generate"),
    ]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--sglang-enable-fp32-lm-head"], "--sglang-enable-fp32-lm-head is on but --fp32-lm-head is off"),
        (["--fp32_lm_head", "fp32out"], "--fp32_lm_head is not an option"),
        (["--fp32-lm-head", "fp32out", "--sglang-rl-on-policy-target", "fsdp"], "rl_on_policy_target='fsdp'"),
    ],
)
def test_the_guard_in_slimes_arguments_refuses(slime, monkeypatch, argv, match):
    from fp32patch.runtime.errors import Fp32LmHeadConfigError

    args = _args(monkeypatch, *argv)
    from slime.utils import arguments

    with pytest.raises(Fp32LmHeadConfigError, match=r"^fp32patch \(parse_args\): ") as caught:
        arguments._fp32patch_check_args(args)
    assert match in str(caught.value)


def test_off_the_server_arguments_are_stock(slime, monkeypatch):
    args = _args(monkeypatch)
    from slime.backends.sglang_utils import sglang_engine
    from slime.utils import arguments

    for name in [m for m in sys.modules if m.startswith("fp32patch.runtime.slime")]:
        monkeypatch.delitem(sys.modules, name)
    arguments._fp32patch_check_args(args)
    kwargs, _ = sglang_engine._compute_server_args(args, 0, "127.0.0.1:5000", 5001, "127.0.0.1", 30001)
    assert kwargs["enable_fp32_lm_head"] is False and args.fp32_lm_head is None
    assert "fp32patch.runtime.slime" not in sys.modules  # the gates kept fp32patch's slime glue out
