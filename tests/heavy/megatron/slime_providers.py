"""Two providers a slime user could name with --custom-model-provider-path (slime_step.py's runs):
a GPTModel of Megatron's own, and one whose last stage ends in a plain torch Linear head, which
fp32patch cannot give fp32 logits (it wires Megatron-Core's ColumnParallelLinear)."""

from __future__ import annotations

import torch
from megatron_harness import H, V, config, gpt_model


def gpt(pre_process: bool = True, post_process: bool = True):
    return gpt_model(config(hidden_dropout=0.0, attention_dropout=0.0), pre_process, post_process)


def linear_head(pre_process: bool = True, post_process: bool = True):
    model = gpt(pre_process, post_process)
    model.output_layer = torch.nn.Linear(H, V, bias=False)
    return model
