"""verl's real FSDP engine on two gloo ranks (CPU), no Ray: what each rank runs.

A job names one verl tree (the patched root, or None for the environment's unpatched verl)
and phases of engine runs. Each run builds verl's own config dataclasses (``HFModelConfig``,
``FSDPEngineConfig``, ``FSDPOptimizerConfig``, ``CheckpointConfig``), then the engine class the
trainer would (``FSDPEngineWithLMHead`` for the actor and the reference policy,
``FSDPEngineWithValueHead`` for the critic), ``initialize()``, one ``infer_batch`` in
``eval_mode`` and, for the actor, one ``train_batch`` in ``train_mode`` with verl's own
``sft_loss`` at temperature 0.7, and ``lr_scheduler_step``. Seeds are fixed per run, so a
run on one tree and the same run on another compare bit for bit.

What is recorded per run: what the head saw and returned in each forward (its input, its
weight as the forward used it, its output before verl scales it, in place on 0.7), the dtype
of the logits verl's ``prepare_model_outputs`` got, the log-probs (or values), the loss, and
each parameter's update. After each phase: which fp32patch modules the process has imported.
The engines are built directly: verl's registry has no CPU entry, and its device is the CPU
platform ``verl_harness.register_cpu_platform`` adds (0.9; 0.7 finds the CPU by itself).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from unittest import mock

import torch
from verl_harness import TEMPERATURE, VOCAB, fp32patch_modules, imported_from, register_cpu_platform, use_tree

# sequence lengths of each rank's batch (two micro-batches of two), the first 4 tokens a prompt
LENGTHS = (9, 12, 7, 10)
MICRO = 2


def run(
    name: str,
    strategy: str,
    key=None,
    role: str = "actor",
    train: bool = True,
    shims: bool = True,
    fused: str | None = None,
) -> dict:
    """One engine run. ``key``: actor_rollout_ref.model.fp32_lm_head as passed to
    HFModelConfig (None: not passed at all; the unpatched HFModelConfig has no such field).
    ``shims``: lift the two CPU-only refusals (``cpu_shims``) verl's FSDP1 and its reference
    policy's FSDP2 offload meet on a machine without an accelerator. ``fused``: verl's fused
    kernels on (``use_fused_kernels``) with this ``impl_backend``, the entropy asked for too."""
    return {
        "name": name,
        "strategy": strategy,
        "key": key,
        "role": role,
        "train": train and role == "actor",
        "shims": shims,
        "fused": fused,
    }


@contextlib.contextmanager
def cpu_shims(spec: dict):
    """What verl's FSDP engine asks of torch that a CPU-only machine refuses, lifted for one run
    (nothing else of verl's or torch's code changes; the names lifted are recorded):

    - FSDP1: verl wraps with ``sync_module_states=True``, which torch refuses for parameters on
      the CPU ("requires them to be on GPU": NCCL broadcasts device memory); gloo broadcasts CPU
      tensors, so the check is skipped.
    - The reference policy: verl offloads its parameters (FSDP1 ``CPUOffload(offload_params=True)``,
      FSDP2 ``CPUOffloadPolicy(pin_memory=True)``), and torch pins the offloaded shards, which
      needs an accelerator; a pinned copy is the tensor itself here (the parameters live on the
      CPU either way).
    """
    lifted: list[str] = []
    with contextlib.ExitStack() as stack:
        import torch.distributed.fsdp._init_utils  # noqa: F401  (before verl's FSDP import reaches it)

        if spec["shims"] and spec["strategy"] == "fsdp":
            from torch.distributed.fsdp import _init_utils

            name = "_check_module_states_for_sync_module_states"
            stack.enter_context(mock.patch.object(_init_utils, name, lambda states: None))
            lifted.append(f"torch.distributed.fsdp._init_utils.{name}")
        if spec["shims"] and spec["role"] == "ref":
            stack.enter_context(mock.patch.object(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self))
            lifted.append("torch.Tensor.pin_memory")
        yield lifted


def worker(rank: int, world: int, job: dict) -> None:
    use_tree(job["root"])
    register_cpu_platform()
    results: dict = {"verl_file": imported_from(job["root"]), "runs": {}, "modules": []}
    for phase in job["phases"]:
        for spec in phase:
            try:
                results["runs"][spec["name"]] = {"ok": True, **one_run(rank, spec, job)}
            except Exception as exc:  # recorded for the test to show; both ranks fail alike
                results["runs"][spec["name"]] = {
                    "ok": False,
                    "error": f"{type(exc).__name__}: {exc}"[:2000],
                    "traceback": traceback.format_exc()[-4000:],
                }
        results["modules"].append(fp32patch_modules())
    torch.save(results, os.path.join(job["out"], f"rank{rank}.pt"))


def one_run(rank: int, spec: dict, job: dict) -> dict:
    with cpu_shims(spec) as lifted:
        return _one_run(rank, spec, job, lifted)


def _one_run(rank: int, spec: dict, job: dict, lifted: list[str]) -> dict:
    from functools import partial

    import verl
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead
    from verl.workers.utils.losses import sft_loss

    critic = spec["role"] == "critic"
    model = dict(
        path=job["critic_dir"] if critic else job["model_dir"],
        use_remove_padding=True,
        override_config={"attn_implementation": "sdpa"},  # verl's default is flash_attention_2
    )
    if spec["key"] is not None:
        model["fp32_lm_head"] = spec["key"]
    if spec["fused"] is not None:
        model.update(use_fused_kernels=True, fused_kernel_options={"impl_backend": spec["fused"]})
    if critic and "model_type" in HFModelConfig.__dataclass_fields__:
        model["model_type"] = "value_model"  # verl 0.9 (0.7: the checkpoint's architecture decides)
        _value_model_without_flash_attention()
    extra = {}
    if not verl.__version__.startswith("0.9"):
        # verl < 0.9 indexes model._no_split_modules[0], a set in transformers 5: name the layer
        extra["wrap_policy"] = {"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}
    engine_config = FSDPEngineConfig(
        **extra,
        strategy=spec["strategy"],
        forward_only=spec["role"] == "ref",
        use_dynamic_bsz=False,
        micro_batch_size_per_gpu=MICRO,
        infer_micro_batch_size_per_gpu=MICRO,
        use_remove_padding=True,
        use_torch_compile=False,
    )
    cls = FSDPEngineWithValueHead if critic else FSDPEngineWithLMHead
    torch.manual_seed(1234)
    engine = cls(
        model_config=HFModelConfig(**model),
        engine_config=engine_config,
        optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=1),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    out: dict = {"engine": type(engine).__name__, "module": type(engine.module).__name__, "lifted": lifted}
    inner = getattr(engine.module, "_fsdp_wrapped_module", engine.module)  # FSDP1 wraps the model
    head = inner.score if critic else inner.get_output_embeddings()
    out["head"] = type(head).__name__
    out["head_weight_at_rest"] = (type(head.weight).__name__, head.weight.dtype)
    # modules whose forward was replaced on the instance (fp32patch's head is such a forward)
    out["instance_forwards"] = {
        n: _qualname(m.__dict__["forward"]) for n, m in inner.named_modules() if "forward" in m.__dict__
    }
    calls = watch(head)
    dtypes = watch_outputs(engine)
    fused_inputs = watch_fused_inputs(inner, head) if spec["fused"] else []

    with engine.eval_mode():
        result = engine.infer_batch(batch(rank, spec["fused"]))
    output = result["model_output"]
    values = output["values" if critic else "log_probs"]
    out["infer"] = (values.values() if values.is_nested else values).detach().clone()
    if spec["fused"]:
        entropy = output["entropy"]
        out["infer_entropy"] = (entropy.values() if entropy.is_nested else entropy).detach().clone()
        out["infer_fused_inputs"] = list(fused_inputs)
        fused_inputs.clear()
    out["infer_head"], out["infer_logits_dtypes"] = list(calls), list(dtypes)
    calls.clear()
    dtypes.clear()

    if spec["train"]:
        before = params(engine)
        with engine.train_mode():
            trained = engine.train_batch(batch(rank, spec["fused"]), loss_function=partial(sft_loss, config=None))
        engine.lr_scheduler_step()
        after = params(engine)
        out["update"] = {n: after[n] - before[n] for n in before}
        out["loss"] = trained["loss"]
        out["grad_norm"] = trained["metrics"].get("grad_norm")
        out["train_head"], out["train_logits_dtypes"] = list(calls), list(dtypes)
    del engine
    return out


def batch(rank: int, fused: str | None = None):
    """Each rank's batch, as verl's trainer hands it to the engine: jagged input ids, positions
    and a loss mask (prompt tokens out), the temperature and micro-batching as non-tensor data
    (with ``fused``: the fused kernels on, and the entropy asked for)."""
    from verl.utils import tensordict_utils as tu

    generator = torch.Generator().manual_seed(100 + rank)
    ids = [torch.randint(3, VOCAB, (n,), generator=generator) for n in LENGTHS]
    masks = [torch.cat([torch.zeros(4, dtype=torch.long), torch.ones(n - 4, dtype=torch.long)]) for n in LENGTHS]

    def nested(tensors):
        return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)

    return tu.get_tensordict(
        tensor_dict={
            "input_ids": nested(ids),
            "position_ids": nested([torch.arange(n) for n in LENGTHS]),
            "loss_mask": nested(masks),
        },
        non_tensor_dict={
            "temperature": TEMPERATURE,
            "use_remove_padding": True,
            "use_dynamic_bsz": False,
            "micro_batch_size_per_gpu": MICRO,
            "use_fused_kernels": fused is not None,
            "calculate_entropy": fused is not None,
            "pad_token_id": 0,
        },
    )


def watch(head: torch.nn.Module) -> list[dict]:
    """What ``head`` saw and returned in each forward, recorded through hooks. The weight is
    taken in a pre-hook, which runs after FSDP's unshard: the bf16 weight the forward used."""
    calls: list[dict] = []
    pending: list[torch.Tensor] = []

    def pre_hook(module, args):
        pending.append(_local(module.weight).detach().clone())

    def hook(module, args, output):
        calls.append(
            {
                "x": _local(args[0]).detach().clone(),
                "w": pending.pop(),
                "out": _local(output).detach().clone(),
            }
        )

    head.register_forward_pre_hook(pre_hook)
    head.register_forward_hook(hook)
    return calls


def watch_outputs(engine) -> list[torch.dtype]:
    """The dtype of the logits (values) verl's prepare_model_outputs is handed."""
    dtypes: list[torch.dtype] = []
    original = engine.prepare_model_outputs

    def prepare_model_outputs(*args, **kwargs):
        output = args[0] if args else kwargs["output"]
        dtypes.append(getattr(output.logits, "dtype", None))  # None: the fused kernels' output has no logits
        return original(*args, **kwargs)

    engine.prepare_model_outputs = prepare_model_outputs
    return dtypes


def watch_fused_inputs(inner: torch.nn.Module, head: torch.nn.Module) -> list[dict]:
    """What the fused kernels are handed in each forward: the decoder's output, the head's weight
    as the fused forward reads it (right after the decoder, inside the model's forward; gathered
    whole where FSDP2 holds it sharded) and the input ids, whose next tokens are the targets."""
    seen: list[dict] = []

    def hook(module, args, kwargs, output):
        weight = head.weight.detach()
        seen.append(
            {
                "hidden": _local(output[0]).detach().clone(),
                "w": weight.full_tensor() if hasattr(weight, "full_tensor") else weight.clone(),
                "w_type": type(head.weight).__name__,
                "ids": kwargs["input_ids"].detach().clone(),
            }
        )

    inner.model.register_forward_hook(hook, with_kwargs=True)
    return seen


def params(engine) -> dict[str, torch.Tensor]:
    """Every parameter as float32, whole (FSDP2: gathered; FSDP1: this rank's flat shard)."""
    out = {}
    for name, p in engine.module.named_parameters():
        value = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        out[name] = value.float().clone()
    return out


def _qualname(forward) -> str:
    """The class of what a bound forward calls (fp32patch's head binds an instance of its own)."""
    target = getattr(forward, "__func__", forward)
    kind = target if isinstance(target, type) or callable(target) and not hasattr(target, "__code__") else None
    kind = type(target) if kind is not None else target
    return f"{kind.__module__}.{kind.__qualname__}"


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _value_model_without_flash_attention() -> None:
    """verl 0.9 loads the critic's model with attn_implementation="flash_attention_2" forced,
    which this CPU machine has no kernel for: the same AutoModelForTokenClassification load
    with sdpa instead (what the critic's value head is does not change)."""
    import verl.utils.model as verl_model

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            local_path,
            torch_dtype=torch_dtype,
            config=model_config,
            attn_implementation="sdpa",
            trust_remote_code=trust_remote_code,
        )

    verl_model.load_valuehead_model = load_valuehead_model
