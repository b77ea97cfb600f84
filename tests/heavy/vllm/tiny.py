"""Tiny bf16 models built by the real vLLM on the CPU from transformers configs (no
weights from any hub): NemotronH, and one model of each head shape for the generic
logits patch."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import operator
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

VOCAB, HIDDEN = 300, 64  # 300 pads to 320 in vLLM's head: the trim is exercised


def _nemotron_config():
    from transformers import NemotronHConfig

    return NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        hybrid_override_pattern="M*",
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
        conv_kernel=4,
        tie_word_embeddings=False,
        architectures=["NemotronHForCausalLM"],
    )


def stock_module():
    """The unpatched nemotron_h.py of the environment, loaded under another name."""
    import sysconfig

    path = Path(sysconfig.get_paths()["purelib"]) / "vllm/model_executor/models/nemotron_h.py"
    spec = importlib.util.spec_from_file_location("stock_nemotron_h", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["stock_nemotron_h"] = module
    spec.loader.exec_module(module)
    assert not hasattr(module, "_fp32patch_lm_head_runtime")
    return module


class Builder:
    def __init__(self, vllm_config, root: Path):
        self.vllm_config = vllm_config
        self.root = root  # the session's folder, removed when it ends
        self._folders: dict[str, str] = {}

    def folder(self, name: str, config) -> str:
        """``config`` (a transformers config) saved once per session, under the session's folder."""
        if name not in self._folders:
            config.save_pretrained(self.root / name)
            self._folders[name] = str(self.root / name)
        return self._folders[name]

    def model(self, cls=None, *, seed: int = 0, family: Family | None = None, **config_overrides):
        from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

        if family is not None:
            module = importlib.import_module(f"vllm.model_executor.models.{family.module}")
            _cpu_activations(module)
            cls = getattr(module, family.cls)
            folder = self.folder(family.module, _family_config(family))
        else:
            folder = self.folder("nemotron_h", _nemotron_config())
        if cls is None:
            from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM as cls
        # a fresh config per model: vLLM registers each layer's name in its config
        extra = {"hf_overrides": config_overrides} if config_overrides else {}
        vllm_config = VllmConfig(
            model_config=_model_config(ModelConfig, folder, **extra), parallel_config=self.vllm_config.parallel_config
        )
        torch.manual_seed(seed)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with set_current_vllm_config(vllm_config):
                model = cls(vllm_config=vllm_config)
        finally:
            torch.set_default_dtype(previous)
        lm_head = head(model, family) if family is not None else model.lm_head
        force_plain_cpu_gemm()
        lm_head.quant_method.process_weights_after_loading(lm_head)
        check_plain_cpu_gemm(lm_head)
        with torch.no_grad():
            lm_head.weight.normal_(0.0, 0.5)
        return model


def _model_config(ModelConfig, folder: str, **kwargs):
    return ModelConfig(model=folder, dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128, **kwargs)


# ---------------------------------------------------------------- the generic patch's families


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its transformers config, its vLLM class, and where its head is."""

    config: str  # transformers config class
    module: str  # vLLM module under vllm.model_executor.models
    cls: str
    head: str  # attribute path of the head the model hands its LogitsProcessor
    weight: str  # checkpoint name of that head's weight, for load_weights
    settings: dict
    soft_cap: float | None = None


_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {
    "qwen2": Family(
        "Qwen2Config",
        "qwen2",
        "Qwen2ForCausalLM",
        "lm_head",
        "lm_head.weight",
        dict(_COMMON, intermediate_size=128, tie_word_embeddings=False),
    ),
    "llama-tied": Family(
        "LlamaConfig",
        "llama",
        "LlamaForCausalLM",
        "lm_head",
        "model.embed_tokens.weight",
        dict(_COMMON, intermediate_size=128, tie_word_embeddings=True),
    ),
    "gemma2": Family(
        "Gemma2Config",
        "gemma2",
        "Gemma2ForCausalLM",
        "model.embed_tokens",
        "model.embed_tokens.weight",
        dict(_COMMON, intermediate_size=128, head_dim=16, final_logit_softcapping=30.0),
        soft_cap=30.0,
    ),
    "qwen3-moe": Family(
        "Qwen3MoeConfig",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "lm_head",
        "lm_head.weight",
        dict(
            _COMMON,
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            tie_word_embeddings=False,
        ),
    ),
    "nemotron-h": Family(
        "NemotronHConfig",
        "nemotron_h",
        "NemotronHForCausalLM",
        "lm_head",
        "lm_head.weight",
        {},
    ),
}


def _family_config(family: Family):
    import transformers

    if family.cls == "NemotronHForCausalLM":
        return _nemotron_config()
    return getattr(transformers, family.config)(architectures=[family.cls], **family.settings)


class _GeluAndMul(torch.nn.Module):
    """GeluAndMul without vLLM's compiled kernel, for a CPU-only run of a CUDA wheel."""

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return torch.nn.functional.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]


def _cpu_activations(module) -> None:
    """vLLM's GeluAndMul looks its CUDA kernel up when built; without one (a CUDA wheel on
    the CPU) the model module gets the plain-torch activation instead. Only the test
    process's module object changes, never a file."""
    act = getattr(module, "GeluAndMul", None)
    if act is None or act is _GeluAndMul:
        return
    try:
        act(approximate="tanh")
    except AttributeError:
        module.GeluAndMul = _GeluAndMul


def head(model, family: Family):
    return operator.attrgetter(family.head)(model)


def family_reference(hidden: torch.Tensor, model, family: Family) -> torch.Tensor:
    """float64 logits of the live head weight, trimmed to the vocabulary, soft-capped as vLLM does."""
    weight = head(model, family).weight.detach().double()[:VOCAB]
    logits = hidden.double() @ weight.T
    if family.soft_cap is not None:
        logits = torch.tanh(logits / family.soft_cap) * family.soft_cap
    return logits


# ---------------------------------------------------------------- the CPU GEMM a CUDA wheel can run


def plain_cpu_dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
    """What vLLM's CPU GEMM dispatch chooses on a CPU without any of its accelerated kernels:
    torch's own linear for a 2-D weight, kept as loaded; any other weight (a conv or an expert
    stack) untouched."""
    if layer.weight.is_meta or layer.weight.ndim == 2:
        layer.cpu_linear = torch.nn.functional.linear


def force_plain_cpu_gemm() -> None:
    """Make vLLM's CPU platform take the plain GEMM path whatever this CPU offers.

    vLLM picks a layer's CPU kernel when its weights are processed after loading, from what
    the CPU reports: sgl-kernel's packed AMX GEMM (``amx_tile``), oneDNN, zentorch on AMD
    Zen. Those kernels are in vLLM's CPU build only; the CUDA wheel that these tests run on
    the CPU has none of them (``torch.ops._C.convert_weight_packed`` is missing), so on such a
    CPU every model build would fail. The choice is made in one function,
    ``dispatch_cpu_unquantized_gemm``, looked up from ``vllm.model_executor.layers.utils``
    at each call (and held by name in modules of releases that imported it): it is replaced,
    in this test process only, by the choice a CPU without those kernels makes. The head's
    GEMM, which the tests measure, is unchanged on such a CPU: torch's linear on the head's
    own weight. No file changes.
    """
    original = stock_cpu_dispatch()
    if original is None or original is plain_cpu_dispatch:
        return
    for module in list(sys.modules.values()):
        name = getattr(module, "__name__", "") or ""
        if name.startswith("vllm") and getattr(module, "dispatch_cpu_unquantized_gemm", None) is original:
            module.dispatch_cpu_unquantized_gemm = plain_cpu_dispatch


_STOCK_DISPATCH: list = []


def stock_cpu_dispatch():
    """vLLM's own ``dispatch_cpu_unquantized_gemm`` (None in releases without one)."""
    if not _STOCK_DISPATCH:
        import vllm.model_executor.layers.utils as utils

        _STOCK_DISPATCH.append(utils.__dict__.get("dispatch_cpu_unquantized_gemm"))
    return _STOCK_DISPATCH[0]


def check_plain_cpu_gemm(layer: torch.nn.Module) -> None:
    """Refuse a head whose CPU GEMM is not torch's linear on its own weight: a test on it
    would measure another kernel (or fail inside one the wheel lacks)."""
    chosen = getattr(layer, "cpu_linear", torch.nn.functional.linear)
    if chosen is not torch.nn.functional.linear or layer.weight.numel() == 0:
        raise RuntimeError(
            f"the test harness did not get vLLM's plain CPU GEMM for {type(layer).__name__}: "
            f"cpu_linear is {chosen!r}, weight {tuple(layer.weight.shape)}"
        )


def cpu_platform() -> None:
    """Releases before VLLM_TARGET_DEVICE was read at run time pick a platform only from
    their build; a CUDA wheel on a machine without a GPU then finds none. Give them vLLM's
    own CPU platform, as a CPU build would have."""
    import vllm.platforms as platforms

    if platforms.cpu_platform_plugin() is None and not platforms.current_platform.device_type:
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()


@contextlib.contextmanager
def session(init_method: str, world: int = 1, rank: int = 0) -> Iterator[Builder]:
    """vLLM's distributed state over gloo, its ranks met at ``init_method`` (a ``file://`` store from
    tests/support/rendezvous.py: no port to race for), and a builder of tiny models."""
    cpu_platform()
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    parallel = ParallelConfig(tensor_parallel_size=world)
    # the models' config folders live as long as the session (one per family, not one per model)
    with tempfile.TemporaryDirectory(prefix="fp32patch-tiny-") as root:
        builder = Builder(None, Path(root))
        nemotron = builder.folder("nemotron_h", _nemotron_config())
        builder.vllm_config = VllmConfig(model_config=_model_config(ModelConfig, nemotron), parallel_config=parallel)
        with set_current_vllm_config(builder.vllm_config):
            init_distributed_environment(
                world_size=world,
                rank=rank,
                distributed_init_method=init_method,
                local_rank=rank,
                backend="gloo",
            )
            initialize_model_parallel(world, 1)
            yield builder


def reference(hidden: torch.Tensor, model) -> torch.Tensor:
    """float64 logits of the head's live weight, trimmed to the real vocabulary."""
    weight = model.lm_head.weight.detach().double()[:VOCAB]
    return hidden.double() @ weight.T


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()
