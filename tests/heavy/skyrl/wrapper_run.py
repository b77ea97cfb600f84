"""One policy step of SkyRL 0.4.0's own ``HFModelWrapper`` (the FSDP backend's model wrapper), in
a process of its own (so that the stock tree and the patched one never meet in one interpreter):

    python -m tests.heavy.skyrl.wrapper_run SETTINGS_JSON OUT_DIR

The settings name the model folder and the switch (None: off, or a trainer mode). The run:

- the model loaded in bf16 with torch's SDPA (as SkyRL's reference worker loads it, ``bf16=True``;
  FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` hands the policy's head the same bf16 weight
  in its forward) and handed to ``HFModelWrapper`` with ``remove_microbatch_padding=True``, so
  that SkyRL packs the batch into one row (``unpad_input``; flash-attn is the OpenRLHF suite's
  stand-in) and rolls the targets, as its FSDP workers do;
- the switch, where on, wired as the patched FSDP worker wires the wrapper after
  ``strategy.prepare`` (the gate fp32patch put in SkyRL's files, ``trainer.fp32_lm_head`` on a
  config);
- a batch of two sequences of different lengths (the second left-padded), temperature 0.7: the old
  log-probs under ``no_grad``, then the log-probs and the entropy with gradients (SkyRL divides its
  logits by the temperature in place), a PPO-style loss with an entropy term, backward.

Recorded: the action log-probs, the old ones, the entropy, the loss, the final norm's hidden states
and the head weight (to recompute everything in float64 from the very operands), the head's
gradient, and whether fp32patch was imported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

TEMPERATURE = 0.7
RESPONSE = 5
ADVANTAGES = (1.0, -0.5)
ENTROPY_COEF = 0.01


def batch(vocab: int):
    """Two sequences (lengths 12 and 8 of 12, the second's prompt left-padded) and their mask."""
    import torch

    gen = torch.Generator().manual_seed(1000)
    sequences = torch.randint(1, vocab, (2, 12), generator=gen)
    attention_mask = torch.ones_like(sequences)
    attention_mask[1, :4] = 0
    sequences[1, :4] = 0
    return sequences, attention_mask


def loss_of(log_probs, old, entropy):
    """The step's loss: a clipped-ratio policy term and an entropy bonus over the action tokens."""
    import torch

    adv = torch.tensor(ADVANTAGES, dtype=log_probs.dtype).unsqueeze(1).expand_as(log_probs)
    ratio = torch.exp(log_probs - old)
    policy = -torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv).mean()
    return policy - ENTROPY_COEF * entropy.mean()


def main(settings_path: str, out_dir: str) -> None:
    from tests.heavy.skyrl.py311 import allow_skyrl

    allow_skyrl()
    import torch
    from skyrl.backends.skyrl_train.workers import model_wrapper
    from transformers import AutoModelForCausalLM

    settings = json.loads(Path(settings_path).read_text())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.bfloat16, attn_implementation="sdpa")
    wrapper = model_wrapper.HFModelWrapper(
        model, use_flash_attention_2=True, remove_microbatch_padding=True, logprobs_chunk_size=4
    )
    if settings["switch"] is not None:
        # what the patched FSDP worker does after strategy.prepare: its gate (the same snippet in
        # every patched file) with trainer.fp32_lm_head on the trainer config
        model_wrapper._fp32patch_wire(wrapper, SimpleNamespace(fp32_lm_head=settings["switch"]), "policy")
    captured: list = []
    hook = model.model.norm.register_forward_hook(lambda m, a, out: captured.append(out.detach().clone()))
    sequences, attention_mask = batch(model.config.vocab_size)
    with torch.no_grad():
        old = wrapper(sequences, RESPONSE, attention_mask, temperature=TEMPERATURE)
    captured.clear()
    log_probs, output = wrapper(
        sequences, RESPONSE, attention_mask, temperature=TEMPERATURE, return_output=True, compute_entropy=True
    )
    entropy = output["entropy"][:, -RESPONSE - 1 : -1]
    (hidden,) = captured
    hook.remove()
    loss = loss_of(log_probs, old, entropy)
    loss.backward()
    head = model.lm_head.weight
    record = {
        "log_probs": log_probs.detach(), "old_log_probs": old.detach(), "entropy": entropy.detach(),
        "entropy_full": output["entropy"].detach(), "loss": loss.detach(), "hidden": hidden,
        "weight": head.detach().clone(), "grad": head.grad.detach().clone(), "sequences": sequences,
        "attention_mask": attention_mask, "log_probs_dtype": str(log_probs.dtype),
        "fp32patch_imported": "fp32patch" in sys.modules, "skyrl_file": model_wrapper.__file__,
    }  # fmt: skip
    torch.save(record, Path(out_dir) / "record.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
