"""What trainers do to logits in place, each beside the out-of-place computation it must equal.

NeMo-RL's trainers (Megatron and both DTensor workers) and verl's scale the logits by the
training temperature in place, ``logits.div_(temperature)``, whenever it is not 1; vocabulary
masks fill in place. Under autograd that needs logits that are not views made inside a custom
``autograd.Function``, and the gradient must then be that of the same computation done out of
place, bit for bit (autograd turns the in-place op into the same per-element arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

TEMPERATURE = 0.7


def _padded_vocab(logits: torch.Tensor) -> torch.Tensor:
    """The last three vocabulary entries, as a padded vocabulary's tail."""
    v = logits.shape[-1]
    return torch.arange(v, device=logits.device) >= v - 3


# name -> (in place, out of place)
CHANGES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]] = {
    "div_": (lambda t: t.div_(TEMPERATURE), lambda t: t / TEMPERATURE),
    "mul_": (lambda t: t.mul_(1.5), lambda t: t * 1.5),
    "masked_fill_": (
        lambda t: t.masked_fill_(_padded_vocab(t), float("-inf")),
        lambda t: t.masked_fill(_padded_vocab(t), float("-inf")),
    ),
}


def change(name: str, logits: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``logits`` changed by ``name``, in place (the same tensor back) or out of place."""
    return CHANGES[name][0 if in_place else 1](logits)


def assert_same_bits(got: tuple, expected: tuple) -> None:
    """Each tensor of ``got`` equals its partner in ``expected`` exactly (None matches None)."""
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, f"item {i}: {a is None=} {b is None=}"
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"item {i}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a, b), f"item {i} differs: max |diff| {(a.double() - b.double()).abs().nan_to_num().max()}"
