"""OpenRLHF's own ``Actor`` and its log-prob helpers, taken from a release's real files, runnable in
the main venv (torch alone: no transformers, peft, DeepSpeed or flash-attn).

``actor_class(files)`` compiles, from a release's ``models/actor.py`` (patched or not), the class
``Actor`` and, where the file is patched, the gate functions fp32patch inserted; from its
``models/utils.py`` ``log_probs_from_logits``, ``_logsumexp_by_chunk`` and ``compute_entropy``
(without its ``torch.compile``: inductor would compile C++ on this CPU for the same math); from
``models/ring_attn_utils.py`` the packing helpers ``unpad_and_slice_tensor`` and
``gather_and_pad_tensor``. Only those definitions are compiled, each as the release wrote it;
the imports they would have pulled in are given instead:

- flash-attn's ``bert_padding`` (``unpad_input``, ``pad_input``, ``index_first_axis``) and einops'
  ``rearrange`` pattern that ring_attn_utils uses: test-only stand-ins below, on one process (no
  ring attention: its all-gather path stays untested here);
- ``log_probs_from_logits``'s ``flash_attn.ops.triton.cross_entropy`` import fails, so it takes
  its own chunked-logsumexp branch, the one OpenRLHF runs without flash-attn.

``TinyCausalLM`` stands in for the HF model: an embedding, one tanh layer and an ``nn.Linear``
head, bf16, returning a dict-like output with ``logits`` as transformers' ``ModelOutput`` does.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

ACTOR = "openrlhf/models/actor.py"
UTILS = "openrlhf/models/utils.py"
RING = "openrlhf/models/ring_attn_utils.py"
FILES = (ACTOR, UTILS, RING)


class Output(dict):
    """transformers' ``ModelOutput`` as OpenRLHF uses it: items and attributes."""


class TinyCausalLM(nn.Module):
    def __init__(self, vocab: int = 96, hidden: int = 32, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, hidden)
        self.body = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.mul_(4.0)  # logits of a trained model's size, where bf16 rounding shows
        self.to(torch.bfloat16)
        self.config = None

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.embed(input_ids)))

    def forward(self, input_ids, attention_mask=None, position_ids=None, **kwargs) -> Output:
        return Output(logits=self.lm_head(self.hidden(input_ids)))


# ---------------------------------------------------------------- flash-attn stand-ins (test only)


def unpad_input(hidden, attention_mask):
    seqlens = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden.reshape(-1, *hidden.shape[2:])
    return flat[indices], indices, cu_seqlens, int(seqlens.max()), seqlens


def pad_input(hidden, indices, batch, seqlen):
    out = torch.zeros(batch * seqlen, *hidden.shape[1:], dtype=hidden.dtype, device=hidden.device)
    out[indices] = hidden
    return out.reshape(batch, seqlen, *hidden.shape[1:])


def index_first_axis(x, indices):
    return x[indices]


def rearrange(x, pattern):
    assert pattern == "b s ... -> (b s) ...", pattern
    return x.reshape(-1, *x.shape[2:])


# ---------------------------------------------------------------- the release's own definitions


def _definitions(path: Path, names: set[str] | None, *, prefix: str | None = None) -> list[ast.stmt]:
    tree = ast.parse(path.read_text())
    out = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            continue
        if (names is not None and node.name in names) or (prefix is not None and node.name.startswith(prefix)):
            if node.name == "compute_entropy":
                node.decorator_list = []
            out.append(node)
    return out


def actor_class(files: dict[str, Path]) -> tuple[type, dict[str, Any]]:
    """``Actor`` of the release whose files ``files`` maps (``FILES`` -> path), and the namespace
    it runs in (its helpers, and fp32patch's gate functions where the file is patched)."""
    namespace: dict[str, Any] = {
        "__name__": "openrlhf_actor_under_test",
        "torch": torch,
        "nn": nn,
        "dist": dist,
        "Optional": Optional,
        "F": torch.nn.functional,
        "unpad_input": unpad_input,
        "pad_input": pad_input,
        "index_first_axis": index_first_axis,
        "rearrange": rearrange,
    }
    body = [
        *_definitions(files[UTILS], {"log_probs_from_logits", "_logsumexp_by_chunk", "compute_entropy"}),
        *_definitions(files[RING], {"unpad_and_slice_tensor", "gather_and_pad_tensor"}),
        *_definitions(files[ACTOR], {"Actor"}, prefix="_fp32patch_"),
    ]
    code = compile(ast.Module(body=body, type_ignores=[]), str(files[ACTOR]), "exec")
    exec(code, namespace)
    return namespace["Actor"], namespace


def make_actor(actor_cls: type, model: nn.Module, *, temperature: float, packing: bool) -> Any:
    """An ``Actor`` around ``model`` (OpenRLHF's path for a model instance, which sets neither
    packing nor the VLM flag: set here as its string path would)."""
    actor = actor_cls(model, temperature=temperature, packing_samples=packing)
    actor.packing_samples = packing
    actor.is_vlm = False
    return actor
