"""Shared pieces of the verl suite: the patched import root, the tiny model verl loads, the
2-rank gloo jobs, and the CPU platform verl 0.9 needs.

Nothing here imports verl or fp32patch at import time: the spawned ranks import this module
first and only then choose which verl tree (patched or not) they import, and a rank whose
switch is off must end with fp32patch never imported.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

PATCH = "verl-fp32-lm-head"
MARKER = f"# fp32patch: {PATCH}"
REPO = Path(__file__).resolve().parents[3]
SITE = Path(sysconfig.get_paths()["purelib"])
# the file whose edit puts the head on the actor's and the ref's model
FSDP_ENGINE = "verl/workers/engine/fsdp/transformer_impl.py"

VOCAB, HIDDEN, LAYERS = 512, 64, 2
TEMPERATURE = 0.7
WORLD = 2


def installed_dist_info() -> Path:
    """The environment's ``verl-<version>.dist-info``."""
    (found,) = SITE.glob("verl-*.dist-info")
    return found


def patched_root(parent: Path) -> Path:
    """A copy of the environment's ``verl`` package and its ``.dist-info`` under a temp folder
    of ``parent``, patched with fp32patch's CLI (the repository on ``PYTHONPATH``; fp32patch is
    not installed in the environment)."""
    parent.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="verl-patched-", dir=parent))
    for item in [SITE / "verl", installed_dist_info()]:
        shutil.copytree(item, root / item.name, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(
        [sys.executable, "-m", "fp32patch", "apply", "-s", str(root), "--patch", PATCH],
        check=True,
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
    )
    text = (root / FSDP_ENGINE).read_text()
    assert MARKER in text, f"{root / FSDP_ENGINE} carries no {MARKER!r}"
    return root


def use_tree(root: str | None) -> None:
    """Make ``import verl`` find the patched tree at ``root`` (first on ``sys.path``), or, for
    None, the environment's own installed verl (every patched root taken off ``sys.path``)."""
    sys.path[:] = [p for p in sys.path if "verl-patched-" not in p]
    if root is not None:
        sys.path.insert(0, root)
    for name in [m for m in sys.modules if m == "verl" or m.startswith("verl.")]:
        del sys.modules[name]


def imported_from(root: str | None) -> str:
    """Check that ``verl`` comes from ``root`` (None: the environment); returns its file."""
    import verl

    where = Path(verl.__file__).resolve()
    if root is None:
        assert where.is_relative_to(SITE.resolve()), f"verl from {where}, not the environment's {SITE}"
    else:
        assert where.is_relative_to(Path(root).resolve()), f"verl from {where}, not the patched root {root}"
        assert MARKER in (Path(root) / FSDP_ENGINE).read_text()
    return str(where)


def fp32patch_modules() -> list[str]:
    return sorted(m for m in sys.modules if m == "fp32patch" or m.startswith("fp32patch."))


# ---------------------------------------------------------------- the tiny model


def save_tiny_qwen2(path: str | Path, tied: bool = False) -> None:
    """A real Qwen2ForCausalLM (bf16 config, untied head unless ``tied``: the head is then the
    embedding) with a locally built word-level tokenizer, saved where verl's HFModelConfig loads
    it: nothing comes from the hub. The head is drawn N(0, 1), so the logits reach |z| ~ 30,
    where bf16 rounding shows."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)
    model.to(torch.bfloat16).save_pretrained(str(path))
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))


def save_tiny_critic(path: str | Path) -> None:
    """The same tiny Qwen2 as a value model (Qwen2ForTokenClassification, one label), its
    tokenizer beside it: what verl's critic loads."""
    import torch
    from transformers import AutoTokenizer, Qwen2ForTokenClassification

    save_tiny_qwen2(path)
    config = Qwen2ForTokenClassification.config_class.from_pretrained(str(path), num_labels=1)
    torch.manual_seed(1)
    model = Qwen2ForTokenClassification(config)
    model.to(torch.bfloat16).save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(path))  # the tokenizer saved with the language model loads


# ---------------------------------------------------------------- verl >= 0.9 on the CPU


def register_cpu_platform() -> None:
    """verl 0.9 finds its device through ``verl.plugin.platform``, which knows NVIDIA, Ascend and
    AMD; without an accelerator it falls back to NVIDIA ("cuda", nccl). A "cpu" platform (gloo,
    the CPU as the device) is registered and chosen with ``VERL_PLATFORM`` before any verl
    module asks for the platform. verl 0.7 has no registry and finds the CPU by itself; both
    call device functions ``torch.cpu`` lacks (``empty_cache``, the RNG state), given here."""
    import contextlib

    import torch

    # verl calls these through get_torch_device(), which is torch.cpu here (0.7 too)
    for name, fn in {
        "empty_cache": lambda: None,
        "get_rng_state": torch.get_rng_state,
        "set_rng_state": torch.set_rng_state,
        "manual_seed": torch.manual_seed,
        "manual_seed_all": torch.manual_seed,
    }.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    try:
        from verl.plugin.platform.platform_cuda import PlatformCUDA
        from verl.plugin.platform.platform_manager import PlatformRegistry
    except ImportError:
        return

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformCUDA):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: torch.cpu)

        def is_available(self):
            return True

        def is_platform_available(self, use_smi_check=False):
            return True

        def current_device(self):
            return "cpu"  # tensor.to(get_device_id()) stays on the CPU

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def synchronize(self, device_index=None):
            pass

        def manual_seed(self, seed):
            torch.manual_seed(seed)

        def manual_seed_all(self, seed):
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings):
            pass

        def empty_cache(self):
            pass

        def get_device_capability(self, device_index=0):
            return None, None

        def communication_backend_name(self):
            return "gloo"

        def is_ipc_supported(self):
            return False

        def get_collective_module(self):
            return None

        def nvtx_range(self, msg):
            return contextlib.nullcontext()

        def profiler_start(self):
            pass

        def profiler_stop(self):
            pass

        def cudart(self):
            return None

    os.environ["VERL_PLATFORM"] = "cpu"


# ---------------------------------------------------------------- 2-rank gloo jobs


def spawn(worker: Callable, job: dict, world: int = WORLD) -> None:
    """Run ``worker(rank, world, job)`` on ``world`` gloo ranks, each a fresh process."""
    import torch.multiprocessing as mp

    from tests.support.rendezvous import file_store

    with file_store() as init_method:
        mp.spawn(_entry, args=(worker, world, init_method, job), nprocs=world, join=True)


def _entry(rank: int, worker: Callable, world: int, init_method: str, job: dict) -> None:
    import datetime
    import warnings

    import torch
    import torch.distributed as dist

    from tests.support.rendezvous import init_gloo

    warnings.filterwarnings("ignore")
    # verl's Worker records MASTER_ADDR and MASTER_PORT (KeyError without them); the group itself is met at
    # the file store below and exists before any verl code runs, so no port is listened on or raced for
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK=str(rank), WORLD_SIZE=str(world))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), VERL_LOGGING_LEVEL="WARN")
    os.environ.pop("NRL_VLLM_FP32_LM_HEAD", None)
    torch.set_num_threads(1)  # two ranks on a two-core machine
    # a rank that fails alone leaves the other in a collective: time out rather than hang
    init_gloo(rank, world, init_method, timeout=datetime.timedelta(minutes=3))
    try:
        worker(rank, world, job)
    finally:
        dist.destroy_process_group()
