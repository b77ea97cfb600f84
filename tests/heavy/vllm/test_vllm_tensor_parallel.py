"""TP=2 on the CPU (two gloo ranks) with the real vLLM: the fp32 ways keep vLLM's own
vocabulary-parallel gather and padding trim, and give what one rank gives."""

from __future__ import annotations

import os

import pytest
import torch

from tests.heavy.vllm import tiny
from tests.heavy.vllm.conftest import PATCHED_ROOT
from tests.support.rendezvous import file_store


def _full_weight() -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(tiny.VOCAB, tiny.HIDDEN, generator=gen) * 0.5).to(torch.bfloat16)


def _hidden() -> torch.Tensor:
    gen = torch.Generator().manual_seed(8)
    return (torch.randn(6, tiny.HIDDEN, generator=gen) * 3).to(torch.bfloat16)


def _rank(rank: int, world: int, init_method: str, way: str, results) -> None:
    import sys

    sys.path.insert(0, str(PATCHED_ROOT))
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    if way == "off":
        os.environ.pop("NRL_VLLM_FP32_LM_HEAD", None)
    else:
        os.environ["NRL_VLLM_FP32_LM_HEAD"] = way
    with tiny.session(init_method, world=world, rank=rank) as builder:
        model = builder.model()
        # the checkpoint's weight, loaded the way vLLM shards it across ranks
        model.load_weights([("lm_head.weight", _full_weight())])
        logits = model.compute_logits(_hidden())
        results[rank] = None if logits is None else logits.float()


@pytest.mark.parametrize("way", ["off", "fp32out", "copy"])
def test_tp2_gives_the_logits_of_one_rank(way):
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    with file_store() as init_method:
        mp.spawn(_rank, args=(2, init_method, way, results), nprocs=2, join=True)
    logits = results[0]  # vLLM gathers the vocabulary shards on rank 0
    assert logits.shape == (6, tiny.VOCAB)  # padding trimmed after the gather
    ref = _hidden().double() @ _full_weight().double().t()
    err = ((logits.double() - ref).abs().max() / ref.abs().max()).item()
    if way == "off":
        assert err > 1e-4  # bf16 logits, as stock
    else:
        assert err < 1e-5, err
