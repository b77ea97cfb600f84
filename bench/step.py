"""A whole RL training step, stock against fp32patch: what a user pays, not a kernel ratio.

One step of a Qwen2-shaped causal LM (random weights, bf16, sdpa attention, gradient
checkpointing, fused AdamW) on one packed batch-1 sequence of T tokens: the forward, per-token
log-probs of the next tokens at temperature ``TEMPERATURE``, a policy-gradient loss
(``-mean(advantage * log p)``, with entropy on ``- ENTROPY_COEF * mean(entropy)`` too, so the
entropy's gradient runs), the backward and the optimizer step. Ways (``WAYS``):

* ``stock``: the stock Hugging Face way (OpenRLHF's actor, TRL's and verl's unfused paths): the
  bf16 head's logits, ``.float()``, divided by the temperature in place, ``log_softmax``, the
  target gathered; the entropy from the same fp32 logits (``logsumexp - sum(softmax * z)``);
* ``fp32patch``: ``kernels.chunked_logprobs(hidden, lm_head.weight, targets, mode="fp32out")``
  as the library chooses (the logits kept for the backward where they fit: what OpenRLHF's
  actor gets under fp32patch), ``fp32patch-recompute``: never kept, the tile ``choose_tiles``
  chooses (what verl's and NeMo-RL's fused paths get: their own hold no [T, V] tensor),
  ``fp32patch-trl``: with the tile TRL's path passes (``trl.fused.tile``), and
  ``fp32patch-trl-bf16grad`` the same in mode ``fp32out-bf16grad``;
* the stacks' own bf16 fused paths, re-implemented in bench/fused_logprobs.py from their
  sources: ``verl-fused`` (``use_fused_kernels``, torch backend, 512-token chunks; it always
  computes the entropy), ``trl-chunked`` (TRL's chunked log-probs, bf16 tiles of 4096 x 32768;
  log-probs only), ``nemo-fused`` (NeMo-RL's fused linear log-probs, 256-token chunks; log-probs
  only, no temperature: it divides the log-probs' logits elsewhere), ``prime-rl-fused``
  (Prime-RL's ``FusedOutputLinear``: 8192-token chunks of 8192-entry bf16 tiles, a temperature per
  token; bench/prime_rl_head.py), against ``fp32patch-prime-rl``, the head fp32patch wires for
  it, and ``skyrl-fused`` (SkyRL's ``fused_lm_head_logprob``, torch backend: 1,024-token chunks
  of the whole vocabulary, the temperature folded into the bf16 weight; log-probs only), whose
  replacement is ``fp32patch-skyrl`` (the logits kept where the call is within SkyRL's chunk,
  ``skyrl.megatron.keep_logits``; recomputed beyond). Each is compared with the fp32patch path that replaces
  it (``PAIRS``).
* ``fp32patch@R,V``: chunked_logprobs with the tile R tokens x V vocabulary entries (sweeps);
  ``fp32patch-tiledfwd``, ``fp32patch-eager``: diagnostics (the forward without the fused GEMM +
  logsumexp kernel; no Triton at all).

Timing: every way of a (model, tokens, entropy) cell is warmed up (``plan``'s warm-up steps;
the first compiles its kernels), then timed in ``--rounds`` interleaved rounds (round r starts r
ways later) of one step each by default (``--per-round``: more steps a way in a round); a step is
timed with CUDA events around the whole step (forward to ``optimizer.zero_grad``); a way's time
is the median over all its timed steps, and the table's ratio the median over rounds of the two
ways' ratio within a round (``paired_ratio``: a host-bound step's speed drifts between rounds).
The device's busy time per step (``device_ms``): the sum of the kernels' and copies' times over a
round's steps (two at least) under torch.profiler; at short context a small model's step is set by the host
(launches), and wall time then holds the host's gaps that busy time does not: the table gives
both ratios. Beside each step's wall time, the host thread's CPU time (``host_ms``: work on the
host, Python, launches and collections, against waiting) and the time Python's cyclic collector
ran inside it (``gc_ms``, a mean: collections are rare and long); ``--gc-freeze`` moves what the
model and the optimizer hold out of the collector's scans first. Peak memory:
``torch.cuda.max_memory_allocated`` over the way's timed steps (the model, its gradients and
AdamW's state included). A way that runs out of memory is recorded as ``oom``.

``--head``: the log-prob head alone (hidden states to loss, forward and backward; no model), the
stock head against chunked_logprobs at each tile in ``HEAD_TILES``: the measured basis of
``chunked_logprobs.choose_tiles``. ``--profile``: torch.profiler tables of a step of each way.

    python bench/step.py --out bench/step-h200.json                     # the grid
    python bench/step.py --head --out bench/step-head-h200.json         # the head alone, per tile
    python bench/step.py --models 0.5B-tied --tokens 4096 --profile    # where the time goes
    python bench/step.py --cpu                                          # a smoke run (tiny model, CPU)

Without transformers (the project's test environment) the model is this file's own Qwen2-shaped
decoder (``TorchQwen2``: RMSNorm, grouped-query sdpa attention with rotary positions, SwiGLU).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.fused_logprobs import NemoRlBf16, SkyrlBf16, TrlBf16Tiles, VerlTorchBf16, skyrl_bf16  # noqa: E402
from bench.lm_head import env_set  # noqa: E402
from bench.prime_rl_head import patched as prime_rl_patched  # noqa: E402
from bench.prime_rl_head import prime_bf16  # noqa: E402
from fp32patch.runtime.kernels.chunked_logprobs import choose_tiles, chunked_logprobs  # noqa: E402
from fp32patch.runtime.kernels.lm_head_gemm import lm_head_linear  # noqa: E402
from fp32patch.runtime.skyrl.megatron import keep_logits as skyrl_keep  # noqa: E402
from fp32patch.runtime.trl.fused import TILE_LOGITS as TRL_TILE_LOGITS  # noqa: E402
from fp32patch.runtime.trl.fused import tile as trl_tile  # noqa: E402

DEVICE = "cuda"
TEMPERATURE = 0.7
ENTROPY_COEF = 1e-3
MODE = "fp32out"

# Qwen2 / Qwen2.5 shapes (their config.json): hidden, MLP, layers, heads, KV heads, vocabulary
MODELS: dict[str, dict] = {
    "0.5B-tied": dict(hidden=896, mlp=4864, layers=24, heads=14, kv=2, vocab=151936, tied=True),
    "0.5B-untied": dict(hidden=896, mlp=4864, layers=24, heads=14, kv=2, vocab=151936, tied=False),
    "1.5B-tied": dict(hidden=1536, mlp=8960, layers=28, heads=12, kv=2, vocab=151936, tied=True),
    "1.5B-untied": dict(hidden=1536, mlp=8960, layers=28, heads=12, kv=2, vocab=151936, tied=False),
    "3B-tied": dict(hidden=2048, mlp=11008, layers=36, heads=16, kv=2, vocab=151936, tied=True),
    "7B-untied": dict(hidden=3584, mlp=18944, layers=28, heads=28, kv=4, vocab=152064, tied=False),
    "tiny-tied": dict(hidden=32, mlp=64, layers=1, heads=2, kv=1, vocab=512, tied=True),
    "tiny-untied": dict(hidden=32, mlp=64, layers=1, heads=2, kv=1, vocab=512, tied=False),
}
DEFAULT_MODELS = ["0.5B-tied", "1.5B-untied", "3B-tied"]
TOKENS = [1024, 2048, 4096, 8192, 16384, 32768, 65536]
CPU = {"models": ["tiny-tied", "tiny-untied"], "tokens": [40]}
# (stack, its own path, fp32patch's path under that stack)
PAIRS = [
    ("HF / OpenRLHF actor (unfused)", "stock", "fp32patch"),
    ("verl use_fused_kernels", "verl-fused", "fp32patch-recompute"),
    ("TRL chunked log-probs", "trl-chunked", "fp32patch-trl"),
    ("NeMo-RL fused linear log-probs", "nemo-fused", "fp32patch-recompute"),
    ("Prime-RL FusedOutputLinear", "prime-rl-fused", "fp32patch-prime-rl"),
    ("SkyRL fused_lm_head_logprob", "skyrl-fused", "fp32patch-skyrl"),
    ("TRL chunked log-probs, fp32out-bf16grad", "trl-chunked", "fp32patch-trl-bf16grad"),
    ("TRL chunked log-probs, 4,096-row tiles", "trl-chunked", "fp32patch-trl-rows4k"),
    ("TRL chunked log-probs, strips", "trl-chunked", "fp32patch-trl-strips"),
    ("TRL chunked log-probs, two passes", "trl-chunked", "fp32patch-trl-passes"),
    ("TRL chunked log-probs, fp32out-bf16grad, 4,096-row tiles", "trl-chunked", "fp32patch-trl-bf16grad-rows4k"),
]
# chunked_logprobs' tiles the --head sweep measures: (rows, vocabulary); 0 = every token / entry
HEAD_TILES = [None, (8192, 16384), (8192, 32768), (4096, 0), (8192, 0), (16384, 0), (0, 0)]


# ---------------------------------------------------------------- the model


class _Rms(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class _Block(torch.nn.Module):
    def __init__(self, c: dict) -> None:
        super().__init__()
        h, self.heads, self.kv = c["hidden"], c["heads"], c["kv"]
        self.dim = h // self.heads
        self.norm1, self.norm2 = _Rms(h), _Rms(h)
        self.q = torch.nn.Linear(h, h)
        self.k = torch.nn.Linear(h, self.kv * self.dim)
        self.v = torch.nn.Linear(h, self.kv * self.dim)
        self.o = torch.nn.Linear(h, h, bias=False)
        self.gate = torch.nn.Linear(h, c["mlp"], bias=False)
        self.up = torch.nn.Linear(h, c["mlp"], bias=False)
        self.down = torch.nn.Linear(c["mlp"], h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        y = self.norm1(x)
        q = _rotate(self.q(y).view(b, t, self.heads, self.dim).transpose(1, 2), cos, sin)
        k = _rotate(self.k(y).view(b, t, self.kv, self.dim).transpose(1, 2), cos, sin)
        v = self.v(y).view(b, t, self.kv, self.dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        y = self.norm2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))


class TorchQwen2(torch.nn.Module):
    """A Qwen2-shaped decoder in plain torch, for where transformers is not installed: what the
    step needs of a transformers model (``model(ids).logits``, ``model.model(ids)
    .last_hidden_state``, ``lm_head``, gradient checkpointing)."""

    def __init__(self, c: dict) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(c["vocab"], c["hidden"])
        self.layers = torch.nn.ModuleList(_Block(c) for _ in range(c["layers"]))
        self.norm = _Rms(c["hidden"])
        self.lm_head = torch.nn.Linear(c["hidden"], c["vocab"], bias=False)
        if c["tied"]:
            self.lm_head.weight = self.embed_tokens.weight
        for module in self.modules():  # transformers' Qwen2 initialisation: N(0, 0.02), zero biases
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.zeros_(module.bias)

    @property
    def model(self) -> TorchQwen2:  # model.model(ids).last_hidden_state, as transformers nests it
        return self

    def __call__(self, ids: torch.Tensor, **_: object):  # the transformers call convention
        return super().__call__(ids)

    def forward(self, ids: torch.Tensor):
        t = ids.shape[1]
        dim = self.layers[0].dim
        inv = 1.0 / (1e6 ** (torch.arange(0, dim, 2, device=ids.device).float() / dim))
        ang = torch.arange(t, device=ids.device).float()[:, None] * inv[None, :]
        ang = torch.cat((ang, ang), dim=-1)
        dtype = self.embed_tokens.weight.dtype
        cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, use_reentrant=False)
        return _Out(self.norm(x), self.lm_head)


class _Out:
    def __init__(self, hidden: torch.Tensor, head: torch.nn.Module) -> None:
        self.last_hidden_state = hidden
        self._head = head

    @property
    def logits(self) -> torch.Tensor:
        return self._head(self.last_hidden_state)


def build_model(name: str, impl: str) -> torch.nn.Module:
    """The model on DEVICE in bf16 with random weights, in training mode, gradient checkpointing on."""
    c = MODELS[name]
    torch.manual_seed(0)
    with torch.device(DEVICE):
        if impl == "hf":
            from transformers import Qwen2Config, Qwen2ForCausalLM

            config = Qwen2Config(
                hidden_size=c["hidden"], intermediate_size=c["mlp"], num_hidden_layers=c["layers"],
                num_attention_heads=c["heads"], num_key_value_heads=c["kv"], vocab_size=c["vocab"],
                tie_word_embeddings=c["tied"], max_position_embeddings=131072, use_cache=False,
            )  # fmt: skip
            config._attn_implementation = "sdpa"  # transformers' default where torch has it; said outright
            model = _bf16(Qwen2ForCausalLM(config))
            if model.config._attn_implementation != "sdpa":
                raise SystemExit(
                    f"bench/step.py: the model's attention is {model.config._attn_implementation!r}, not sdpa"
                )
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model = _bf16(TorchQwen2(c))
    model.train()
    return model


def _bf16(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` in bf16; built in bf16 already (bench/step_counts.py builds it so, from fake
    tensors, which a conversion would have to swap), as it is."""
    if all(p.dtype == torch.bfloat16 for p in model.parameters()):
        return model
    return model.to(torch.bfloat16)


def _impl() -> str:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "torch"
    return "hf"


# ---------------------------------------------------------------- the ways


def _stock(model, ids, targets, entropy):
    logits = model(ids, use_cache=False).logits  # [1, T, V] bf16, the stock head
    z = logits.float()
    z.div_(TEMPERATURE)
    logp = torch.log_softmax(z, dim=-1).gather(-1, targets[..., None])[..., 0]
    ent = (torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)) if entropy else None
    return logp, ent


def _hidden(model, ids):
    return model.model(ids, use_cache=False).last_hidden_state


def _ours(tile=None, always_entropy=False, keep=None, mode=None):
    """chunked_logprobs as a way: the tile (or a function of the model and ids giving it), the
    logits kept or not, and the mode (``MODE`` unless given)."""

    def fn(model, ids, targets, entropy):
        rows, vocab = (tile(model, ids) if callable(tile) else tile) or (None, None)
        want = entropy or always_entropy
        kept = keep(ids.numel()) if callable(keep) else keep
        out = chunked_logprobs(
            _hidden(model, ids), model.lm_head.weight, targets, mode=mode or MODE, temperature=TEMPERATURE,
            entropy=want, chunk_rows=rows, chunk_vocab=vocab, keep_logits=kept,
        )  # fmt: skip
        logp, ent = out if want else (out, None)
        return logp, (ent if entropy else None)

    return fn


def _trl_tile(model, ids) -> tuple[int, int]:
    return trl_tile(ids.numel(), *model.lm_head.weight.shape)


def _trl_rows4k_tile(model, ids) -> tuple[int, int]:
    """TRL's budget of logits (``trl.fused.TILE_LOGITS``) in tiles of 4,096 rows, TRL's own: the
    tile TRL's path took before its taller tiles (the same below 4,096 tokens)."""
    return choose_tiles(ids.numel(), *model.lm_head.weight.shape, rows=4096, logits=TRL_TILE_LOGITS)


def _unfused(model, ids, targets, entropy):
    """The HF head's fp32out GEMM (fp32 logits, no copy), then the stock code from the fp32 logits on:
    the path a trainer gets from the HF head patch alone, without the chunked log-probs."""
    h = _hidden(model, ids)
    z = lm_head_linear(h.reshape(-1, h.shape[-1]), model.lm_head.weight, None, MODE)
    z.div_(TEMPERATURE)
    logp = torch.log_softmax(z, dim=-1).gather(-1, targets.reshape(-1, 1))[:, 0]
    ent = (torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)) if entropy else None
    return logp[None], (ent[None] if entropy else None)


def _verl(model, ids, targets, entropy):
    h = _hidden(model, ids)
    logp, ent = VerlTorchBf16.apply(h[0], model.lm_head.weight, targets[0], TEMPERATURE)
    return logp[None], (ent[None] if entropy else None)


def _trl(model, ids, targets, entropy):
    h = _hidden(model, ids)
    return TrlBf16Tiles.apply(h[0], model.lm_head.weight, targets[0], TEMPERATURE)[None], None


def _nemo(model, ids, targets, entropy):
    h = _hidden(model, ids)
    return NemoRlBf16.apply(h[0], model.lm_head.weight, targets[0])[None], None


def _skyrl(model, ids, targets, entropy):
    h = _hidden(model, ids)
    return skyrl_bf16(h[0], model.lm_head.weight, targets[0], TEMPERATURE)[None], None


def _prime_rl(head: Callable) -> Callable:
    """Prime-RL's head (its bf16 chunks, bench/prime_rl_head.py, or the head fp32patch wires for
    it), which takes a temperature per token: every token the step's."""

    def fn(model, ids, targets, entropy):
        h = _hidden(model, ids)[0]
        temps = torch.full((h.shape[0],), TEMPERATURE, device=h.device)
        logp, ent = head(h, model.lm_head.weight, targets[0], temps, None)
        return logp[None], (ent[None] if entropy else None)

    return fn


def _with_env(fn: Callable, **env: str) -> Callable:
    """``fn`` run with these environment variables set for the whole step (``Cell.step``): the
    backward reads them too."""

    def wrapped(*args):
        return fn(*args)

    wrapped.env = env
    return wrapped


# name -> (fn(model, ids, targets, entropy) -> (log p [1, T], entropy [1, T] or None), takes entropy)
WAYS: dict[str, tuple[Callable, bool]] = {
    "stock": (_stock, True),
    "fp32patch": (_ours(), True),
    "fp32patch-trl": (_ours(_trl_tile), False),
    # the same in the mode whose weight gradient takes the bf16 gradient TRL's own kernel takes
    # (fp32 logits and log-probs; no column-maxima pass over each tile in the backward)
    "fp32patch-trl-bf16grad": (_ours(_trl_tile, mode="fp32out-bf16grad"), False),
    # diagnostics: TRL's path as it was, in tiles of 4,096 rows (round 5's JSON: the "-tall" ways
    # are today's fp32patch-trl and fp32patch-trl-bf16grad, its plain ones these)
    "fp32patch-trl-rows4k": (_ours(_trl_rows4k_tile), False),
    "fp32patch-trl-bf16grad-rows4k": (_ours(_trl_rows4k_tile, mode="fp32out-bf16grad"), False),
    # TRL's path and the recomputing call with fp32out's backward tiles all through the strip
    # kernel (FP32PATCH_STRIPS=1: one launch and no atomics where the two passes take three),
    # or none (0: the two passes); the plain ways take the runtime's choice (the strips for a
    # recomputed tile they hold in one block)
    "fp32patch-trl-strips": (_with_env(_ours(_trl_tile), FP32PATCH_STRIPS="1"), False),
    "fp32patch-recompute-strips": (_with_env(_ours(keep=False), FP32PATCH_STRIPS="1"), True),
    "fp32patch-trl-passes": (_with_env(_ours(_trl_tile), FP32PATCH_STRIPS="0"), False),
    "fp32patch-recompute-passes": (_with_env(_ours(keep=False), FP32PATCH_STRIPS="0"), True),
    "fp32out-unfused": (_unfused, True),
    # the default tile, the logits kept from the forward / computed again in the backward
    "fp32patch-keep": (_ours(keep=True), True),
    "fp32patch-recompute": (_ours(keep=False), True),
    # diagnostics: the forward's tiles written and folded (no fused GEMM + logsumexp kernel);
    # every per-tile step as torch operations (no Triton)
    "fp32patch-tiledfwd": (_with_env(_ours(), FP32PATCH_GEMM_LSE="0"), True),
    "fp32patch-eager": (_with_env(_ours(), FP32PATCH_TRITON="0"), True),
    "verl-fused": (_verl, True),
    "trl-chunked": (_trl, False),
    "nemo-fused": (_nemo, False),
    "prime-rl-fused": (_prime_rl(prime_bf16), True),
    "fp32patch-prime-rl": (_prime_rl(prime_rl_patched), True),
    "skyrl-fused": (_skyrl, False),
    # what SkyRL's fused path gets: the logits kept where the call is within SkyRL's chunk
    "fp32patch-skyrl": (_ours(keep=lambda tokens: skyrl_keep(tokens, SkyrlBf16.CHUNK)), True),
}


def way(name: str) -> tuple[Callable, bool]:
    if name.startswith("fp32patch@"):
        rows, vocab = (int(v) for v in name.removeprefix("fp32patch@").split(","))
        return _ours((rows or 1 << 30, vocab or 1 << 30)), True
    if name not in WAYS:
        raise SystemExit(f"bench/step.py: unknown way {name!r}; known: {', '.join(WAYS)}, fp32patch@ROWS,VOCAB")
    return WAYS[name]


# ---------------------------------------------------------------- one step


class Cell:
    """One model's step at one length: the batch and the optimizer, shared by every way."""

    def __init__(self, model: torch.nn.Module, tokens: int, vocab: int, seed: int = 0) -> None:
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.model = model
        self.ids = torch.randint(0, vocab, (1, tokens), device=DEVICE, generator=gen)
        self.targets = torch.roll(self.ids, -1, dims=1)
        self.adv = torch.randn(1, tokens, device=DEVICE, generator=gen)

    def step(self, fn: Callable, entropy: bool, opt: torch.optim.Optimizer) -> None:
        with contextlib.ExitStack() as stack:
            for name, value in getattr(fn, "env", {}).items():
                stack.enter_context(env_set(name, value))
            logp, ent = fn(self.model, self.ids, self.targets, entropy)
            loss = -(self.adv * logp).mean()
            if ent is not None:
                loss = loss - ENTROPY_COEF * ent.mean()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-7, fused=DEVICE == "cuda")


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


class _GcClock:
    """The milliseconds Python's cyclic garbage collector ran, summed over its collections
    (``gc.callbacks``): a pause the host spends inside a step that no aten operation shows."""

    def __init__(self) -> None:
        self.ms = 0.0
        self._start: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.ms += (time.perf_counter() - self._start) * 1e3
            self._start = None


def _timed(fn: Callable[[], object]) -> tuple[float, float, float]:
    """One step's (wall ms, the host thread's CPU ms, the collector's ms). The wall time from
    device events on CUDA; the host's CPU time says whether a wall difference is work on the host
    (Python, launches, collections) or waiting (a sync, the device)."""
    clock = _GcClock()
    gc.callbacks.append(clock)
    try:
        cpu0 = time.thread_time()
        if DEVICE == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            host = (time.thread_time() - cpu0) * 1e3
            end.synchronize()
            return start.elapsed_time(end), host, clock.ms
        t0 = time.perf_counter()
        fn()
        wall = (time.perf_counter() - t0) * 1e3
        return wall, (time.thread_time() - cpu0) * 1e3, clock.ms
    finally:
        gc.callbacks.remove(clock)


def _clean() -> None:
    if DEVICE == "cuda":  # (on the CPU there is no device memory to give back, and a collection costs)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err)


def plan(tokens: int) -> tuple[int, int, int]:
    """(warm-up steps, rounds, steps per round): fewer at long context, where a step takes seconds."""
    if DEVICE == "cpu":  # the smoke run checks the logic, not the speed
        return 1, 1, 1
    # one step a way per round: the table's ratio is paired within rounds (``paired_ratio``), which
    # a host-paced step's drift between rounds needs (bench/RESULTS.md, 2026-12-05 afternoon)
    if tokens <= 8192:
        return 2, 24, 1
    if tokens <= 16384:
        return 2, 6, 1
    return 1, 3, 1


def measure_cell(
    cell: Cell,
    opt,
    ways: list[str],
    entropy: bool,
    tokens: int,
    rounds: int | None = None,
    per_round: int | None = None,
) -> dict:
    """Each way's step times (and device time, peak) at one cell; ``rounds``: more interleaved
    rounds than ``plan`` gives, for a host-bound step whose ratios need a narrower interval;
    ``per_round``: steps of a way in a round (1: the ways alternate step by step, and a drift of
    the host's speed falls on both sides of every pair of rounds)."""
    warmup, planned, planned_per_round = plan(tokens)
    rounds = planned if rounds is None else rounds
    per_round = planned_per_round if per_round is None else per_round
    out: dict[str, dict] = {}
    live = []
    for name in ways:
        fn, takes_entropy = way(name)
        if entropy and not takes_entropy:
            continue
        try:
            for _ in range(warmup):
                cell.step(fn, entropy, opt)
            _sync()
        except RuntimeError as err:
            if not _oom(err):
                raise
            out[name] = {"oom": True, "error": str(err).splitlines()[0][:200]}
        else:
            out[name] = {"ms_steps": [], "host_ms_steps": [], "gc_ms_steps": [], "peak_gib": 0.0}
            out[name].update(rounds=rounds, per_round=per_round)  # ms_steps[r * per_round:][:per_round]: round r
            live.append((name, fn))
        opt.zero_grad(set_to_none=True)
        _clean()
    for r in range(rounds):
        order = live[r % len(live) :] + live[: r % len(live)] if live else []
        for name, fn in order:
            if out[name].get("oom"):
                continue
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                for _ in range(per_round):
                    wall, host, collecting = _timed(lambda fn=fn: cell.step(fn, entropy, opt))
                    out[name]["ms_steps"].append(wall)
                    out[name]["host_ms_steps"].append(host)
                    out[name]["gc_ms_steps"].append(collecting)
            except RuntimeError as err:  # past its warm-up: the allocator's fragmentation, say
                if not _oom(err):
                    raise
                out[name] = {"oom": True, "error": str(err).splitlines()[0][:200], "after_warmup": True}
                opt.zero_grad(set_to_none=True)
                _clean()
                continue
            if DEVICE == "cuda":
                out[name]["peak_gib"] = max(out[name]["peak_gib"], torch.cuda.max_memory_allocated() / 2**30)
    for name, fn in live:
        if not out[name].get("oom"):
            out[name]["ms"] = statistics.median(out[name]["ms_steps"])
            out[name]["host_ms"] = statistics.median(out[name]["host_ms_steps"])
            out[name]["gc_ms"] = statistics.fmean(out[name]["gc_ms_steps"])  # (rare, long: the mean)
            if DEVICE == "cuda":
                out[name]["device_ms"] = _busy_ms(lambda fn=fn: cell.step(fn, entropy, opt), max(per_round, 2))
    return out


def _busy_ms(step_once: Callable[[], object], steps: int) -> float:
    """The device's busy time per step: the sum of its kernels' and copies' times over ``steps``
    steps under torch.profiler, divided by ``steps``. Where the host sets the pace (a small model's
    short step), the wall time holds the host's gaps between kernels and this does not; the two
    together say what a way adds on the device and what it adds on the host."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    _sync()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step_once()
        _sync()
    return _busy(prof.key_averages(), steps)


def _busy(events, steps: int) -> float:
    """The device's busy milliseconds per step in a profile of ``steps`` steps (its key averages)."""
    return sum(e.self_device_time_total for e in events) / steps / 1e3


def run_grid(args) -> dict:
    results = {"machine": _machine(), "date": _now(), "command": " ".join(sys.argv), "impl": args.impl}
    results.update(temperature=TEMPERATURE, entropy_coef=ENTROPY_COEF, mode=MODE, gc_freeze=args.gc_freeze, cells=[])
    for model_name in args.models:
        c = MODELS[model_name]
        model = build_model(model_name, args.impl)
        opt = _optimizer(model)
        if args.gc_freeze:  # the model's and the optimizer's objects out of the collector's scans
            gc.collect()
            gc.freeze()
        params = sum(p.numel() for p in model.parameters())
        print(f"{model_name}: {params / 1e9:.2f}B parameters, {args.impl} model", flush=True)
        for tokens in args.tokens:
            tiles = choose_tiles(tokens, c["vocab"], c["hidden"])
            for entropy in args.entropy:
                t0 = time.perf_counter()
                cell = Cell(model, tokens, c["vocab"])
                ways = measure_cell(cell, opt, args.ways, entropy, tokens, args.rounds, args.per_round)
                del cell
                _clean()
                row = {"model": model_name, "params": params, "tokens": tokens, "entropy": entropy, "tiles": tiles}
                row["ways"] = ways
                results["cells"].append(row)
                print(_cell_line(row, time.perf_counter() - t0), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
        del model, opt
        _clean()
    return results


def _cell_line(row: dict, seconds: float) -> str:
    parts = []
    base = row["ways"].get("stock", {}).get("ms")
    for name, r in row["ways"].items():
        if r.get("oom"):
            parts.append(f"{name} OOM")
            continue
        ratio = f" {r['ms'] / base:.3f}x" if base and name != "stock" else ""
        busy = f" (device {r['device_ms']:.1f}ms)" if r.get("device_ms") is not None else ""
        host = f" [host {r['host_ms']:.1f}ms, gc {r['gc_ms']:.1f}ms]" if r.get("host_ms") is not None else ""
        parts.append(f"{name} {r['ms']:.1f}ms{ratio}{busy}{host} {r['peak_gib']:.1f}GiB")
    ent = "ent" if row["entropy"] else "   "
    return f"{row['model']:>12} T={row['tokens']:>6} {ent} | " + " | ".join(parts) + f"  ({seconds:.0f}s)"


# ---------------------------------------------------------------- the head alone


def measure_head(args) -> dict:
    """The log-prob head alone at each (hidden, tokens, entropy): stock and each tile."""
    results = {"machine": _machine(), "date": _now(), "command": " ".join(sys.argv), "cells": []}
    hiddens = sorted({MODELS[m]["hidden"] for m in args.models})
    vocab = MODELS[args.models[0]]["vocab"]
    for hdim in hiddens:
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        w = torch.nn.Parameter((torch.randn(vocab, hdim, device=DEVICE, generator=gen) / hdim**0.5).bfloat16())
        for tokens in args.tokens:
            x = torch.randn(tokens, hdim, device=DEVICE, generator=gen).bfloat16().requires_grad_()
            targets = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=gen)
            adv = torch.randn(tokens, device=DEVICE, generator=gen)
            for entropy in args.entropy:
                row = {"hidden": hdim, "vocab": vocab, "tokens": tokens, "entropy": entropy, "ways": {}}
                row["chosen"] = choose_tiles(tokens, vocab, hdim)
                for tile in [*HEAD_TILES, "keep", "recompute", "unfused", "stock"]:
                    name = tile if isinstance(tile, str) else "chosen" if tile is None else f"{tile[0]}x{tile[1]}"
                    row["ways"][name] = _head_way(x, w, targets, adv, entropy, tile, args)
                    _clean()
                results["cells"].append(row)
                base = row["ways"]["stock"].get("ms")
                print(
                    f"H={hdim} T={tokens} ent={int(entropy)} chosen={row['chosen']} | "
                    + " | ".join(
                        f"{k} " + ("OOM" if v.get("oom") else f"{v['ms']:.2f}ms {v['ms'] / base if base else 0:.2f}x "
                                   f"{v['peak_gib']:.2f}G")
                        for k, v in row["ways"].items()
                    ),
                    flush=True,
                )  # fmt: skip
                if args.out:
                    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
            del x
        del w
        _clean()
    return results


def _head_way(x, w, targets, adv, entropy, tile, args) -> dict:
    def run():
        if tile == "stock":
            z = F.linear(x, w).float()
            z.div_(TEMPERATURE)
            logp = torch.log_softmax(z, dim=-1).gather(-1, targets[:, None])[:, 0]
            ent = (torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)) if entropy else None
        elif tile == "unfused":
            z = lm_head_linear(x, w, None, MODE)
            z.div_(TEMPERATURE)
            logp = torch.log_softmax(z, dim=-1).gather(-1, targets[:, None])[:, 0]
            ent = (torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)) if entropy else None
        else:
            keep = {"keep": True, "recompute": False}.get(tile) if isinstance(tile, str) else None
            asked = None if keep is not None else tile
            rows, vocab = (None, None) if asked is None else (asked[0] or 1 << 30, asked[1] or 1 << 30)
            out = chunked_logprobs(
                x, w, targets, mode=MODE, temperature=TEMPERATURE, entropy=entropy, chunk_rows=rows,
                chunk_vocab=vocab, keep_logits=keep,
            )  # fmt: skip
            logp, ent = out if entropy else (out, None)
        loss = -(adv * logp).mean() - (ENTROPY_COEF * ent.mean() if ent is not None else 0.0)
        loss.backward()
        x.grad = None
        w.grad = None

    try:
        for _ in range(2):
            run()
        _sync()
        base = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = [_timed(run)[0] for _ in range(args.head_iters)]
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if DEVICE == "cuda" else 0.0
    except RuntimeError as err:
        if not _oom(err):
            raise
        x.grad = w.grad = None
        return {"oom": True}
    return {"ms": statistics.median(times), "peak_gib": peak}


def rule_from_head(results: dict) -> dict[tuple[int, int], tuple[int, int]]:
    """From a ``--head`` run: for each (hidden, tokens), the tile to use, the one whose slower
    time of entropy off and on is the least among the tiles whose peak stays at or under the
    stock head's in both (any tile when the stock head ran out of memory). A rows or vocabulary
    of 0 means all of them. This is the time's side of ``chunked_logprobs.choose_tiles``, not
    its table: the head's own peak is all the rule bounds, and a whole step replacing a stack's
    chunked path has far less room (the H100 sweep of 2026-12-05 picked whole-vocabulary tiles of
    9-19 GiB where ``choose_tiles`` keeps tiles of ~1 GiB within 1-4% of their time)."""
    by_shape: dict[tuple[int, int], dict[str, list[dict]]] = {}
    for cell in results["cells"]:
        shape = (cell["hidden"], cell["tokens"])
        for name, r in cell["ways"].items():
            by_shape.setdefault(shape, {}).setdefault(name, []).append(r)
    rule = {}
    for shape, ways in sorted(by_shape.items()):
        stock = ways.get("stock", [])
        best = None
        for name, runs in ways.items():
            if name in ("stock", "chosen", "unfused", "keep", "recompute") or any(r.get("oom") for r in runs):
                continue
            fits = all(s.get("oom") or r["peak_gib"] <= s["peak_gib"] for r, s in zip(runs, stock, strict=True))
            worst = max(r["ms"] for r in runs)
            if fits and (best is None or worst < best[0]):
                best = (worst, name)
        if best is not None:
            rows, vocab = (int(v) for v in best[1].split("x"))
            rule[shape] = (rows, vocab)
    return rule


def keep_limit_from_head(results: dict) -> int:
    """From a ``--head`` run: the ``KEEP_LOGITS_BYTES`` the measurements ask for, the largest
    logits size (tokens x vocabulary x 4 bytes) up to which keeping the logits (the ``keep`` way)
    is at least as fast as recomputing them (``recompute``) and stays at or under the stock head's
    peak, in every cell of that size and every smaller one (any hidden size, entropy off and on);
    0 where it loses at the smallest size measured."""
    by_size: dict[int, list[dict]] = {}
    for cell in results["cells"]:
        by_size.setdefault(cell["tokens"] * cell["vocab"] * 4, []).append(cell["ways"])
    limit = 0
    for size in sorted(by_size):
        for ways in by_size[size]:
            keep, again, stock = ways.get("keep", {}), ways.get("recompute", {}), ways.get("stock", {})
            if keep.get("oom") or "ms" not in keep or again.get("oom") or "ms" not in again:
                return limit
            if keep["ms"] > again["ms"] or (not stock.get("oom") and keep["peak_gib"] > stock.get("peak_gib", 0.0)):
                return limit
        limit = size
    return limit


# ---------------------------------------------------------------- profile


def profile(args) -> None:
    """torch.profiler over steps of each way: the kernels by device time, and the step's wall
    time against the device's busy time (a gap means the host, not the GPU, sets the pace)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for model_name in args.models:
        c = MODELS[model_name]
        model = build_model(model_name, args.impl)
        opt = _optimizer(model)
        for tokens in args.tokens:
            cell = Cell(model, tokens, c["vocab"])
            for entropy in args.entropy:
                for name in args.ways:
                    fn, takes = way(name)
                    if entropy and not takes:
                        continue
                    for _ in range(3):
                        cell.step(fn, entropy, opt)
                    _sync()
                    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        t0 = time.perf_counter()
                        for _ in range(3):
                            cell.step(fn, entropy, opt)
                        _sync()
                        wall = (time.perf_counter() - t0) / 3 * 1e3
                    events = prof.key_averages()
                    busy = _busy(events, 3)
                    table = events.table(
                        sort_by="self_device_time_total", row_limit=args.profile_rows, max_name_column_width=60
                    )
                    title = f"== {model_name} T={tokens} entropy={entropy} {name}: wall {wall:.1f} ms/step, device busy {busy:.1f} ms/step"
                    print(title)
                    print("\n".join(table.splitlines()[: args.profile_rows + 4]), flush=True)
                    if args.profile_dir:
                        path = (
                            Path(args.profile_dir)
                            / f"profile-{model_name}-{tokens}-{int(entropy)}-{name.replace('@', '_').replace(',', '_')}.txt"
                        )
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_text(
                            title + "\n" + events.table(sort_by="self_device_time_total", row_limit=80) + "\n"
                        )
            del cell
            _clean()
        del model, opt
        _clean()


# ---------------------------------------------------------------- report


def _machine() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, memory_mib=props.total_memory // 2**20)
    else:
        info["gpu"] = f"none (CPU: {platform.processor() or platform.machine()})"
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    return info


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def pair_tables(results: dict, columns: list[str], row: Callable[[dict, dict], list[str]]) -> str:
    """Markdown, a table per stack pair (``PAIRS``) with cells holding both its ways: the model,
    tokens and entropy, then ``columns`` (right-aligned), whose entries ``row(theirs, ours)``
    gives from the two ways' records."""
    lines = []
    for stack, theirs, ours in PAIRS:
        rows = [c for c in results["cells"] if theirs in c["ways"] and ours in c["ways"]]
        if not rows:
            continue
        lines += [f"### {stack}: `{theirs}` against `{ours}`", ""]
        lines += ["| model | tokens | entropy | " + " | ".join(columns) + " |"]
        lines += ["| --- | ---: | --- | " + " | ".join("---:" for _ in columns) + " |"]
        for c in rows:
            entries = row(c["ways"][theirs], c["ways"][ours])
            lines.append(
                f"| {c['model']} | {c['tokens']:,} | {'on' if c['entropy'] else 'off'} | {' | '.join(entries)} |"
            )
        lines.append("")
    return "\n".join(lines)


def table(results: dict) -> str:
    """Markdown: per stack pair, model, tokens and entropy, the two step times and their ratio, the
    device's busy time per step and its ratio (CUDA; "—" on the CPU), and the peaks."""

    def row(a: dict, b: dict) -> list[str]:
        ta = "out of memory" if a.get("oom") else _ms(a["ms"])
        tb = "out of memory" if b.get("oom") else _ms(b["ms"])
        ratio = "—"
        if not (a.get("oom") or b.get("oom")):
            paired = paired_ratio(a, b)
            if paired is not None:  # rounds recorded (runs from 2026-12-05 16:50 UTC on): ratios of the same round
                ratio = f"{paired[0]:.3f} ({paired[1]:.2f}-{paired[2]:.2f}) p"
            else:
                ratio = f"{b['ms'] / a['ms']:.3f}"
                if len(a.get("ms_steps", [])) > 1 and len(b.get("ms_steps", [])) > 1:
                    low, high = ratio_interval(a["ms_steps"], b["ms_steps"])
                    ratio += f" ({low:.2f}-{high:.2f})"
        busy, busy_ratio = "—", "—"
        if a.get("device_ms") is not None and b.get("device_ms") is not None:
            busy = f"{_ms(a['device_ms'])} → {_ms(b['device_ms'])}"
            busy_ratio = f"{b['device_ms'] / a['device_ms']:.3f}"
        pa = "OOM" if a.get("oom") else f"{a['peak_gib']:.1f}"
        pb = "OOM" if b.get("oom") else f"{b['peak_gib']:.1f}"
        return [ta, tb, ratio, busy, busy_ratio, f"{pa} → {pb}"]

    columns = ["stock step", "fp32patch step", "ratio (90%)", "device busy: stock → fp32patch", "ratio"]
    return pair_tables(results, [*columns, "peak GiB stock → fp32patch"], row)


def host_table(results: dict) -> str:
    """Markdown, for the cells whose steps recorded them: per stack pair, the host thread's CPU
    time per step (median) and the collector's (mean), each way's, beside the wall time; "" when
    no cell has them (runs before they were recorded)."""
    if not any("host_ms" in w for c in results["cells"] for w in c["ways"].values()):
        return ""

    def row(a: dict, b: dict) -> list[str]:
        if any(w.get("oom") or "host_ms" not in w for w in (a, b)):
            return ["—"] * 3
        return [
            f"{_ms(a['ms'])} → {_ms(b['ms'])}",
            f"{_ms(a['host_ms'])} → {_ms(b['host_ms'])}",
            f"{a['gc_ms']:.2f} → {b['gc_ms']:.2f} ms",
        ]

    return "#### Host time per step (wall; the host thread's CPU; the collector)\n\n" + pair_tables(
        results, ["wall", "host CPU", "collector"], row
    )


def _bootstrap_90(resampled: Callable[[random.Random], float], draws: int, seed: int) -> tuple[float, float]:
    """The 5th and 95th percentiles of ``draws`` values of ``resampled(rng)``, each computed on a
    resample drawn with ``rng`` (seeded: the same table every time)."""
    rng = random.Random(seed)
    values = sorted(resampled(rng) for _ in range(draws))
    return values[int(0.05 * draws)], values[int(0.95 * draws) - 1]


def ratio_interval(a: list[float], b: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 90% bootstrap interval of median(b) / median(a) from two ways' timed steps: what the
    spread of a host-bound step lets a ratio claim (the table's ratio column holds it in
    parentheses)."""

    def ratio(rng: random.Random) -> float:
        return statistics.median(rng.choices(b, k=len(b))) / statistics.median(rng.choices(a, k=len(a)))

    return _bootstrap_90(ratio, draws, seed)


def round_means(way: dict) -> list[float] | None:
    """A way's mean step time in each round, from a run that recorded its rounds; None otherwise
    (or when a way ran out of memory part way)."""
    rounds, per_round, steps = way.get("rounds"), way.get("per_round"), way.get("ms_steps", [])
    if not rounds or not per_round or len(steps) != rounds * per_round:
        return None
    return [statistics.fmean(steps[r * per_round : (r + 1) * per_round]) for r in range(rounds)]


def paired_ratio(a: dict, b: dict, draws: int = 2000, seed: int = 0) -> tuple[float, float, float] | None:
    """The median over rounds of b's round mean over a's in the same round, and a 90% bootstrap
    interval of that median (rounds drawn with their pairs): the steps of one round ran within
    seconds of each other, so a drift of a host-bound step's speed over a cell (the H100's
    1.5B/1k steps went from 157 to 222 ms between rounds of one way) leaves the ratio alone, where
    the ratio of two ways' overall medians takes it in. The table marks these ratios ``p``.
    None: either way's rounds not recorded, or fewer than three."""
    ma, mb = round_means(a), round_means(b)
    if ma is None or mb is None or len(ma) != len(mb) or len(ma) < 3:
        return None
    ratios = [y / x for x, y in zip(ma, mb, strict=True)]
    low, high = _bootstrap_90(lambda rng: statistics.median(rng.choices(ratios, k=len(ratios))), draws, seed)
    return statistics.median(ratios), low, high


def merged(paths: list[str]) -> dict:
    """The cells of several grid runs' JSON files, in the order given (``--table``)."""
    return {"cells": [cell for path in paths for cell in json.loads(Path(path).read_text())["cells"]]}


def _ms(ms: float) -> str:
    return f"{ms / 1e3:.2f} s" if ms >= 1000 else f"{ms:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=None, choices=list(MODELS))
    ap.add_argument("--tokens", nargs="+", type=int, default=None)
    ap.add_argument("--entropy", nargs="+", choices=["off", "on"], default=["off", "on"])
    ap.add_argument("--ways", nargs="+", default=["stock", "fp32patch"])
    ap.add_argument("--impl", choices=["hf", "torch"], default=None, help="the model: transformers' or this file's")
    ap.add_argument("--out", help="write the results here (JSON), after every cell")
    ap.add_argument("--cpu", action="store_true", help="a smoke run on the CPU: tiny models, short sequences")
    ap.add_argument("--head", action="store_true", help="the log-prob head alone, per tile (choose_tiles' basis)")
    ap.add_argument("--head-iters", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds per cell (default: by length)")
    ap.add_argument(
        "--per-round", type=int, default=None, help="steps of a way in a round (default: by length; 1: alternate steps)"
    )
    ap.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() after building each model: the collector's pauses, which a step's host time holds, "
        "then scan only what the steps make",
    )
    ap.add_argument("--table", nargs="+", metavar="GRID_JSON", help="print the tables of grid runs' JSON; no run")
    ap.add_argument(
        "--rule",
        metavar="HEAD_JSON",
        help="the fastest tiles within the stock head's peak, and KEEP_LOGITS_BYTES, from a --head run's JSON; no run",
    )
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of each way's step")
    ap.add_argument("--profile-rows", type=int, default=25)
    ap.add_argument("--profile-dir", help="write each profile table here too")
    args = ap.parse_args(argv)
    if args.table:
        grids = merged(args.table)
        print(table(grids))
        print(host_table(grids))
        return 0
    if args.rule:
        measured = json.loads(Path(args.rule).read_text())
        for (hdim, tokens), tile in rule_from_head(measured).items():
            print(f"    ({hdim}, {tokens}): {tile},")
        limit = keep_limit_from_head(measured)
        print(f"KEEP_LOGITS_BYTES = {limit}  # {limit / 2**30:.2f} GiB: kept logits win up to this size")
        return 0
    if args.cpu:
        DEVICE = "cpu"
        args.models = args.models or CPU["models"]
        args.tokens = args.tokens or CPU["tokens"]
    elif not torch.cuda.is_available():
        raise SystemExit("bench/step.py: no CUDA device; --cpu runs the smoke run")
    args.models = args.models or DEFAULT_MODELS
    args.tokens = args.tokens or TOKENS
    args.entropy = [e == "on" for e in args.entropy]
    args.impl = args.impl or _impl()
    for name in args.ways:
        way(name)
    # the smoke run's tiny products: one thread (two threads spin against each other on a busy CPU)
    threads = torch.get_num_threads()
    if args.cpu:
        torch.set_num_threads(1)
    try:
        if args.profile:
            profile(args)
        elif args.head:
            measure_head(args)
        else:
            results = run_grid(args)
            print()
            print(table(results))
            print(host_table(results))
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
