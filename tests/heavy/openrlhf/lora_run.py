"""One process, no DeepSpeed: OpenRLHF 0.11.2's own ``Actor`` with a LoRA adapter on the attention
(``lora_rank`` 4 on ``q_proj``/``v_proj``: PEFT's ``get_peft_model``, the head not adapted) as the
policy, a plain ``Actor`` as the reference model and one as the EMA model (built as 0.11.2's
``PolicyModelActor`` builds it with ``enable_ema``: no temperature, so 1.0), each wired as the
patched ``PolicyModelActor`` / reference actor wire theirs (the gate fp32patch put in OpenRLHF's
files); packed input, temperature 0.7, the log-probs and entropy with gradients, a loss, backward.

    python -m tests.heavy.openrlhf.lora_run SETTINGS_JSON OUT_DIR

Recorded (``OUT_DIR/run.pt``): per model its action log-probs and entropy (the EMA model's
without gradients), the final norm's hidden
states and the head's weight (for float64 to recompute from the very operands), and for the
policy the gradients of its LoRA matrices and of the frozen head; the EMA model's parameter names
and shapes in order (what ``DeepspeedStrategy.moving_average`` zips); whether fp32patch was imported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from tests.heavy.openrlhf.actor_run import RESPONSE, TEMPERATURE, batch

TARGETS = ["q_proj", "v_proj"]


def _forward(actor, module, sequences, attention_mask, action_mask, *, grad: bool) -> dict:
    import torch

    captured: list = []
    hook = module.model.norm.register_forward_hook(lambda m, a, out: captured.append(out.detach().clone()))
    with torch.set_grad_enabled(grad):
        log_probs, output = actor(sequences, action_mask, attention_mask, return_output=True, return_entropy=True)
    hook.remove()
    return {"log_probs": log_probs, "entropy": output.entropy[:, -RESPONSE:], "hidden": captured[0],
            "weight": module.lm_head.weight.detach().clone(), "dtype": str(log_probs.dtype)}  # fmt: skip


def main(settings_path: str, out_dir: str) -> None:
    import torch
    from openrlhf.models import Actor
    from openrlhf.models import actor as actor_module

    settings = json.loads(Path(settings_path).read_text())
    switch = settings["switch"]
    args = SimpleNamespace(fp32_lm_head=switch, lora_rank=4, target_modules=TARGETS)
    torch.manual_seed(0)
    policy = Actor(settings["model"], attn_implementation="sdpa", param_dtype="bf16", lora_rank=4, lora_alpha=8,
                   target_modules=TARGETS, packing_samples=True, temperature=TEMPERATURE)  # fmt: skip
    reference = Actor(settings["model"], attn_implementation="sdpa", param_dtype="bf16", packing_samples=True,
                      temperature=TEMPERATURE)  # fmt: skip
    ema = Actor(settings["model"], attn_implementation="sdpa", param_dtype="bf16", packing_samples=True)
    if switch is not None:
        actor_module._fp32patch_wire(policy, args, "actor")
        actor_module._fp32patch_wire(reference, args, "reference model")
        actor_module._fp32patch_wire(ema, args, "EMA model")
    base = policy.model.get_base_model()
    vocab = base.config.vocab_size
    sequences, attention_mask, action_mask = batch(0, vocab)
    with torch.no_grad():
        ref = _forward(reference, reference.model, sequences, attention_mask, action_mask, grad=False)
        ema_out = _forward(ema, ema.model, sequences, attention_mask, action_mask, grad=False)
    out = _forward(policy, base, sequences, attention_mask, action_mask, grad=True)
    mask = action_mask.float()
    kl = ((out["log_probs"] - ref["log_probs"]) * mask).sum() / mask.sum()
    loss = -(out["log_probs"] * mask).sum() / mask.sum() + 0.1 * kl - 0.01 * (out["entropy"] * mask).sum() / mask.sum()
    loss.backward()
    lora = {
        n: p.grad.detach().clone() for n, p in policy.model.named_parameters() if "lora_" in n and p.grad is not None
    }
    record = {
        "policy": {k: (v.detach() if torch.is_tensor(v) else v) for k, v in out.items()},
        "reference": {k: (v.detach() if torch.is_tensor(v) else v) for k, v in ref.items()},
        "ema": ema_out,
        "ema_params": [(n, tuple(p.shape)) for n, p in ema.named_parameters()],
        "lora_grads": lora,
        "lora_params": sum(1 for n, _ in policy.model.named_parameters() if "lora_" in n),
        "head_requires_grad": base.lm_head.weight.requires_grad,
        "head_grad": None if base.lm_head.weight.grad is None else base.lm_head.weight.grad.clone(),
        "loss": loss.detach(),
        "sequences": sequences,
        "attention_mask": attention_mask,
        "fp32patch_imported": "fp32patch" in sys.modules,
    }
    torch.save(record, Path(out_dir) / "run.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
