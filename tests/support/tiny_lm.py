"""A Hugging Face-shaped causal LM small enough for the main suite (torch only): what the HF
head meets in a transformers model (an embedding, a body, ``lm_head`` as an ``nn.Linear``
returned by ``get_output_embeddings()``, optionally tied)."""

from __future__ import annotations

import torch


class CausalLM(torch.nn.Module):
    def __init__(
        self, hidden: int, vocab: int, tied: bool = False, seed: int = 0, dtype: torch.dtype = torch.bfloat16
    ) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = torch.nn.Embedding(vocab, hidden, dtype=dtype)
        self.body = torch.nn.Linear(hidden, hidden, dtype=dtype)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight

    def get_output_embeddings(self):
        return self.lm_head

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.body(self.embed_tokens(ids)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(ids))
