"""Packing helpers with flash-attn's names and return values, on torch's indexing (CPU)."""

from __future__ import annotations

import torch
from einops import rearrange

__all__ = ["index_first_axis", "pad_input", "rearrange", "unpad_input"]


def index_first_axis(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The rows ``indices`` of ``tensor`` (first axis); differentiable."""
    return tensor[indices]


def unpad_input(hidden: torch.Tensor, attention_mask: torch.Tensor, unused_mask: torch.Tensor | None = None):
    """``hidden`` [batch, seqlen, ...] without the positions ``attention_mask`` leaves out, as
    (rows [total, ...], their flat indices, cumulative lengths (int32, from 0), the longest
    length, the lengths)."""
    mask = attention_mask if unused_mask is None else attention_mask + unused_mask
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cumulative = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    rows = hidden.reshape(-1, *hidden.shape[2:])[indices]
    return rows, indices, cumulative, int(lengths.max().item()), attention_mask.sum(dim=-1, dtype=torch.int32)


def pad_input(rows: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """The inverse of ``unpad_input``: ``rows`` [total, ...] back at ``indices`` of a zero
    [batch, seqlen, ...]; differentiable."""
    out = rows.new_zeros((batch * seqlen, *rows.shape[1:]))
    out = out.index_put((indices,), rows)
    return out.reshape(batch, seqlen, *rows.shape[1:])
