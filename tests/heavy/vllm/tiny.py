"""A tiny bf16 NemotronH built by the real vLLM on the CPU (no weights from any hub)."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

VOCAB, HIDDEN = 300, 64  # 300 pads to 320 in vLLM's head: the trim is exercised


def _config_dir(**overrides) -> str:
    from transformers import NemotronHConfig

    folder = tempfile.mkdtemp(prefix="tiny-nemotron-h-")
    NemotronHConfig(
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
        **overrides,
    ).save_pretrained(folder)
    return folder


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
    def __init__(self, vllm_config):
        self.vllm_config = vllm_config

    def model(self, cls=None, *, seed: int = 0, **config_overrides):
        from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

        if cls is None:
            from vllm.model_executor.models.nemotron_h import NemotronHForCausalLM as cls
        # a fresh config per model: vLLM registers each layer's name in its config
        extra = {"hf_overrides": config_overrides} if config_overrides else {}
        vllm_config = VllmConfig(
            model_config=_model_config(ModelConfig, **extra), parallel_config=self.vllm_config.parallel_config
        )
        torch.manual_seed(seed)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with set_current_vllm_config(vllm_config):
                model = cls(vllm_config=vllm_config)
        finally:
            torch.set_default_dtype(previous)
        head = model.lm_head
        head.quant_method.process_weights_after_loading(head)
        with torch.no_grad():
            head.weight.normal_(0.0, 0.5)
        return model


_CONFIG_DIR: list[str] = []


def _model_config(ModelConfig, **kwargs):
    if not _CONFIG_DIR:
        _CONFIG_DIR.append(_config_dir())
    return ModelConfig(model=_CONFIG_DIR[0], dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128, **kwargs)


def cpu_platform() -> None:
    """Releases before VLLM_TARGET_DEVICE was read at run time pick a platform only from
    their build; a CUDA wheel on a machine without a GPU then finds none. Give them vLLM's
    own CPU platform, as a CPU build would have."""
    import vllm.platforms as platforms

    if platforms.cpu_platform_plugin() is None and not platforms.current_platform.device_type:
        from vllm.platforms.cpu import CpuPlatform

        platforms._current_platform = CpuPlatform()


@contextlib.contextmanager
def session(port: int, world: int = 1, rank: int = 0) -> Iterator[Builder]:
    cpu_platform()
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    parallel = ParallelConfig(tensor_parallel_size=world)
    vllm_config = VllmConfig(model_config=_model_config(ModelConfig), parallel_config=parallel)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=world,
            rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}",
            local_rank=rank,
            backend="gloo",
        )
        initialize_model_parallel(world, 1)
        yield Builder(vllm_config)


def reference(hidden: torch.Tensor, model) -> torch.Tensor:
    """float64 logits of the head's live weight, trimmed to the real vocabulary."""
    weight = model.lm_head.weight.detach().double()[:VOCAB]
    return hidden.double() @ weight.T


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()
