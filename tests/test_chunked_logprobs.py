"""Chunked log-probs from hidden states and the head weight (kernels/chunked_logprobs.py), on
the CPU: the same log-probs as the unfused fp32 head plus log_softmax, whatever the tiles; the
backward of lm_head_gemm in each mode; TP=2 over gloo equal to TP=1; Megatron's main_grad;
a training step on a packed batch-1 input."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from fp32patch.runtime.kernels.chunked_logprobs import chunked_logprobs
from fp32patch.runtime.kernels.lm_head_gemm import lm_head_linear
from fp32patch.runtime.modes import MEGATRON_MODES
from tests.support.rendezvous import file_store, init_gloo
from tests.support.tiny_lm import CausalLM

T, H, V = 67, 64, 1000  # tokens (odd, so tiles are ragged), hidden, vocabulary
# (rows, vocabulary) per tile: ragged both ways, one row, one vocabulary entry, one tile
TILES = [(7, 33), (16, 512), (1, 1000), (67, 1), (1000, 100000)]


def problem(seed: int = 0, t: int = T, h: int = H, v: int = V):
    """bf16 hidden states and head whose logits have the size real models have (|z| ~ 10-20),
    targets sampled from the model, and an upstream gradient of each kind."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).bfloat16()
    w = (torch.randn(v, h, generator=gen) * (3.0 / h**0.5)).bfloat16()
    probs = torch.softmax(x.double() @ w.double().t(), dim=-1)
    targets = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    grad_logp = torch.randn(t, generator=gen)
    grad_entropy = torch.randn(t, generator=gen) * 0.1
    return x, w, targets, grad_logp, grad_entropy


def float64_logprobs(x, w, targets, temperature=1.0):
    z = (x.double() @ w.double().t()) / temperature
    log_p = torch.log_softmax(z, dim=-1)
    return log_p.gather(1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


def unfused(mode, x, w, targets, temperature=1.0, fuse=False):
    """The unfused fp32 head as a trainer runs it: lm_head_gemm's logits, scaled in place,
    log_softmax in fp32, the target gathered."""
    logits = lm_head_linear(x, w, None, mode, fuse_wgrad=fuse)
    if temperature != 1.0:
        logits.div_(temperature)
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]


def relative(got, ref) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def leaves(x, w, main_grad: bool = False):
    x = x.clone().requires_grad_()
    w = torch.nn.Parameter(w.clone())
    if main_grad:
        w.main_grad = torch.zeros(w.shape, dtype=torch.float32)
    return x, w


# ---------------------------------------------------------------- forward


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(("rows", "cols"), TILES)
def test_logprobs_are_the_unfused_fp32_heads_whatever_the_tiles(rows, cols, temperature):
    x, w, targets, _, _ = problem()
    got = chunked_logprobs(x, w, targets, temperature=temperature, chunk_rows=rows, chunk_vocab=cols)
    ref = unfused("fp32out", x, w, targets, temperature)
    assert got.dtype == torch.float32 and got.shape == targets.shape
    # the same fp32 numbers, up to the order of the logsumexp's fp32 sums: a few ulps of log Z
    assert (got - ref).abs().max().item() < 16 * 2.0**-24 * 20
    # and far from what bf16 logits give
    bf16 = torch.log_softmax((x @ w.t()).float() / temperature, -1).gather(1, targets[:, None])[:, 0]
    assert (bf16 - ref).abs().mean() > 100 * (got - ref).abs().mean()


def test_temperature_divides_the_logits_not_the_logprobs():
    x, w, targets, _, _ = problem()
    ref64, _ = float64_logprobs(x, w, targets, temperature=0.6)
    got = chunked_logprobs(x, w, targets, temperature=0.6, chunk_rows=16, chunk_vocab=300)
    assert (got.double() - ref64).abs().max() < 1e-5
    # NeMo-RL's fused path at T != 1 divides the fused log-probs afterwards: another quantity
    plain = chunked_logprobs(x, w, targets, chunk_rows=16, chunk_vocab=300)
    assert (plain.double() / 0.6 - ref64).abs().mean() > 0.1


def test_error_against_float64_does_not_depend_on_the_number_of_tiles():
    x, w, targets, _, _ = problem(1, t=256, v=4096)
    ref64, _ = float64_logprobs(x, w, targets)
    errors = {}
    for rows, cols in [(256, 4096), (64, 1024), (16, 128), (5, 37)]:  # 1 to ~5600 tiles
        got = chunked_logprobs(x, w, targets, chunk_rows=rows, chunk_vocab=cols)
        errors[(rows, cols)] = (got.double() - ref64).abs().mean().item()
    one = errors[(256, 4096)]
    assert all(err < 2 * one + 1e-7 for err in errors.values()), errors
    assert max(errors.values()) < 2e-6  # fp32 rounding of log Z ~ 10-20: a few 1e-7
    bf16 = torch.log_softmax((x @ w.t()).float(), -1).gather(1, targets[:, None])[:, 0]
    assert (bf16.double() - ref64).abs().mean() > 1000 * max(errors.values())


def test_cpu_path_is_exact_to_fp32_accumulation():
    # bf16 operands are exact in fp32: the CPU tiles are the upcast product, so each log-prob
    # is within fp32 accumulation (H products) and the logsumexp's rounding of float64's
    x, w, targets, _, _ = problem(2)
    ref64, _ = float64_logprobs(x, w, targets)
    got = chunked_logprobs(x, w, targets, chunk_rows=8, chunk_vocab=128)
    bound = H * 2.0**-24 * (x.double().abs() @ w.double().abs().t()).amax(dim=1) + 8 * 2.0**-24 * 20
    assert ((got.double() - ref64).abs() <= bound).all()


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_entropy_against_float64(temperature):
    x, w, targets, _, _ = problem(3)
    ref_lp, ref_ent = float64_logprobs(x, w, targets, temperature)
    lp, ent = chunked_logprobs(x, w, targets, entropy=True, temperature=temperature, chunk_rows=9, chunk_vocab=70)
    assert ent.dtype == torch.float32 and ent.shape == targets.shape
    assert (ent.double() - ref_ent).abs().max() < 1e-5
    assert (lp.double() - ref_lp).abs().max() < 1e-5
    assert torch.equal(lp, chunked_logprobs(x, w, targets, temperature=temperature, chunk_rows=9, chunk_vocab=70))


def test_leading_dimensions_and_fp32_hidden_states():
    # verl's [B, S, H] and labels [B, S]; an fp32 hidden (FSDP2's output_dtype) is cast to the
    # weight's dtype inside the graph, and its gradient comes back in fp32
    x, w, targets, _, _ = problem(4, t=64)
    flat = chunked_logprobs(x, w, targets)
    batched = chunked_logprobs(x.view(4, 16, H), w, targets.view(4, 16))
    assert batched.shape == (4, 16) and torch.equal(batched.reshape(-1), flat)
    x32 = x.float().view(4, 16, H).requires_grad_()
    chunked_logprobs(x32, w, targets.view(4, 16)).sum().backward()
    assert x32.grad.dtype == torch.float32 and x32.grad.shape == x32.shape


def test_logprobs_may_be_scaled_in_place():
    # a trainer's in-place ops on the outputs (NeMo-RL's div_ on the fused log-probs) must not
    # break the backward: the outputs are fresh tensors, nothing of them is saved
    x, w, targets, g, _ = problem(5)
    xa, wa = leaves(x, w)
    lp = chunked_logprobs(xa, wa, targets, chunk_rows=16, chunk_vocab=256)
    lp.mul_(2.0)
    (lp * g).sum().backward()
    xb, wb = leaves(x, w)
    (2.0 * chunked_logprobs(xb, wb, targets, chunk_rows=16, chunk_vocab=256) * g).sum().backward()
    assert torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad)


# ---------------------------------------------------------------- backward


def backward(fn, x, w, targets, grad_logp, grad_entropy=None, main_grad=True, **kw):
    """One forward and backward of ``fn``; returns x.grad and the weight gradient (main_grad)."""
    xl, wl = leaves(x, w, main_grad)
    out = fn(xl, wl, targets, **kw)
    if isinstance(out, tuple):
        loss = (out[0] * grad_logp).sum() + (out[1] * grad_entropy).sum()
    else:
        loss = (out * grad_logp).sum()
    loss.backward()
    return xl.grad, (wl.main_grad if main_grad else wl.grad)


def float64_grads(x, w, targets, grad_logp, grad_entropy=None, temperature=1.0):
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    z = (x64 @ w64.t()) / temperature
    log_p = torch.log_softmax(z, -1)
    loss = (log_p.gather(1, targets[:, None])[:, 0] * grad_logp.double()).sum()
    if grad_entropy is not None:
        loss = loss - ((log_p.exp() * log_p).sum(-1) * grad_entropy.double()).sum()
    loss.backward()
    return x64.grad, w64.grad


@pytest.mark.parametrize("mode", MEGATRON_MODES)
def test_gradients_are_lm_head_gemms_backward_in_each_mode(mode):
    x, w, targets, g, _ = problem(6)
    dx64, dw64 = float64_grads(x, w, targets, g, temperature=0.8)
    ref_dx, ref_dw = backward(lambda *a, **k: unfused(mode, *a, **k), x, w, targets, g, temperature=0.8, fuse=True)
    kw = dict(mode=mode, temperature=0.8, fuse_wgrad=True, chunk_rows=13, chunk_vocab=128)
    dx, dw = backward(chunked_logprobs, x, w, targets, g, **kw)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    # the weight gradient: the mode's precision, differing from the unfused head's by far less
    # than the mode's own error (the order of fp32 sums; the fp32 dlogits' last bits)
    mode_err = relative(ref_dw, dw64)
    assert relative(dw, dw64) <= mode_err * 1.05 + 1e-7
    assert relative(dw, ref_dw) <= max(mode_err / 4, 1e-6)
    # the input gradient: bf16 as the mode returns it, equal but for the last bit of a few
    ulp = ref_dx.double().abs() * 2.0**-7
    assert ((dx.double() - ref_dx.double()).abs() <= ulp).all()
    assert (dx == ref_dx).float().mean() > 0.95
    assert relative(dx, dx64) <= relative(ref_dx, dx64) * 1.05


def test_the_modes_are_told_apart():
    # the comparison above has teeth: fp32out's weight gradient is not fp32out-bf16grad's
    x, w, targets, g, _ = problem(6)
    _, dw64 = float64_grads(x, w, targets, g)
    _, dw = backward(chunked_logprobs, x, w, targets, g, mode="fp32out", fuse_wgrad=True)
    _, bf16grad = backward(chunked_logprobs, x, w, targets, g, mode="fp32out-bf16grad", fuse_wgrad=True)
    assert relative(bf16grad, dw64) > 4 * relative(dw, dw64)
    assert relative(dw, bf16grad) > relative(dw, dw64)


def test_entropy_gradient_against_float64():
    x, w, targets, g, ge = problem(7)
    dx64, dw64 = float64_grads(x, w, targets, g, ge, temperature=0.9)

    def both(xl, wl, tl, **kw):
        return chunked_logprobs(xl, wl, tl, entropy=True, **kw)

    dx, dw = backward(both, x, w, targets, g, ge, mode="fp32", temperature=0.9, fuse_wgrad=True, chunk_rows=10)
    assert relative(dw, dw64) < 1e-6
    assert relative(dx, dx64) < 2.0**-8  # bf16 delivery


def test_weight_gradient_is_delivered_once_in_the_weights_dtype_without_main_grad():
    x, w, targets, g, _ = problem(8)
    _, dw64 = float64_grads(x, w, targets, g)
    _, fused = backward(chunked_logprobs, x, w, targets, g, fuse_wgrad=True, chunk_rows=8, chunk_vocab=64)
    _, grad = backward(chunked_logprobs, x, w, targets, g, main_grad=False, chunk_rows=8, chunk_vocab=64)
    # accumulated in fp32 over the 9 row chunks, then rounded once: the fp32 sum rounded
    assert grad.dtype == torch.bfloat16 and torch.equal(grad, fused.bfloat16())
    # a bf16 accumulator (NeMo-RL's, verl's) rounds after every chunk: with 17 of them, the
    # exact chunk products so accumulated are already 1.75x further from float64
    bf16_acc = torch.zeros_like(grad)
    p = torch.softmax(x.double() @ w.double().t(), -1)
    dlogits = g.double()[:, None] * (torch.nn.functional.one_hot(targets, V).double() - p)
    for xc, dc in zip(x.split(4), dlogits.split(4), strict=True):
        bf16_acc += (dc.t() @ xc.double()).bfloat16()
    assert relative(bf16_acc, dw64) > 1.5 * relative(grad, dw64)


def test_main_grad_accumulates_across_micro_batches():
    x, w, targets, g, _ = problem(9)
    weight = torch.nn.Parameter(w.clone())
    weight.main_grad = torch.full(weight.shape, 0.25)
    ref = torch.full(weight.shape, 0.25, dtype=torch.float64)
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        grad = torch.randn(T, generator=gen)
        (chunked_logprobs(x, weight, targets, fuse_wgrad=True, chunk_rows=20) * grad).sum().backward()
        ref += float64_grads(x, w, targets, grad)[1]
    assert weight.grad is None  # Megatron's fused path: the gradient lives in main_grad
    assert relative(weight.main_grad, ref) < 2.0**-11


def test_ddp_flag_is_set_and_a_placeholder_returned():
    x, w, targets, g, _ = problem(10)
    weight = torch.nn.Parameter(w.clone())
    weight.main_grad = torch.zeros(weight.shape)
    weight.grad_added_to_main_grad = False
    (chunked_logprobs(x, weight, targets, fuse_wgrad=True) * g).sum().backward()
    assert weight.grad_added_to_main_grad is True
    assert weight.grad is not None and weight.grad.shape == weight.shape
    assert relative(weight.main_grad, float64_grads(x, w, targets, g)[1]) < 2.0**-11


def test_frozen_weight_and_frozen_input():
    x, w, targets, g, _ = problem(11)
    xl = x.clone().requires_grad_()
    (chunked_logprobs(xl, w, targets) * g).sum().backward()  # a reference model's head: no dW
    assert xl.grad is not None
    wl = torch.nn.Parameter(w.clone())
    (chunked_logprobs(x, wl, targets) * g).sum().backward()
    assert wl.grad is not None
    with torch.no_grad():
        assert chunked_logprobs(x, wl, targets).grad_fn is None


# ---------------------------------------------------------------- a training step


@pytest.mark.parametrize("tied", [False, True])
def test_training_step_on_a_packed_batch(tied):
    # three sequences packed into one row (batch 1), GRPO-shaped loss with advantages, at a
    # sampling temperature: the fused path gives the unfused fp32 head's gradients on every
    # parameter (the tied head's too) and an optimizer step on them lowers the loss
    vocab, hidden = 512, 48
    gen = torch.Generator().manual_seed(12)
    lengths = [20, 31, 13]
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=gen)
    advantages = torch.cat([torch.full((n,), a) for n, a in zip(lengths, [1.0, -0.5, 2.0], strict=True)])
    starts = torch.tensor([0, 20, 51])
    mask = torch.ones(sum(lengths), dtype=torch.bool)
    mask[starts + torch.tensor(lengths) - 1] = False  # no next token across a boundary
    temperature = 0.7

    def loss_of(model, fused: bool) -> torch.Tensor:
        h = model.hidden(ids)[0]  # [S, H]
        nxt = ids[0].roll(-1)
        if fused:
            lp = chunked_logprobs(h, model.lm_head.weight, nxt, temperature=temperature, chunk_rows=16, chunk_vocab=100)
        else:
            lp = unfused("fp32out", h, model.lm_head.weight, nxt, temperature)
        return -(advantages * lp * mask).sum() / mask.sum()

    models = {fused: CausalLM(hidden, vocab, tied=tied, seed=3) for fused in (True, False)}
    losses = {fused: loss_of(model, fused) for fused, model in models.items()}
    assert abs(losses[True].item() - losses[False].item()) < 1e-5
    for loss in losses.values():
        loss.backward()
    for (name, p), (_, q) in zip(models[True].named_parameters(), models[False].named_parameters(), strict=True):
        assert relative(p.grad, q.grad) < 2.0**-7, name
    opt = torch.optim.SGD(models[True].parameters(), lr=0.5)
    before = losses[True].item()
    opt.step()
    with torch.no_grad():
        assert loss_of(models[True], True).item() < before


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"mode": "bf16"}, ValueError, "unknown mode 'bf16'"),
        ({"temperature": 0.0}, ValueError, "temperature must be finite and > 0"),
        ({"temperature": "0.7"}, TypeError, "temperature must be a number"),
        ({"chunk_rows": 0}, ValueError, "chunk_rows must be an int >= 1"),
        ({"chunk_vocab": 2.5}, ValueError, "chunk_vocab must be an int >= 1"),
        ({"sequence_parallel": True}, ValueError, "sequence_parallel needs the tp_group"),
        ({"vocab_start": -1}, ValueError, "vocab_start must be an int >= 0"),
        ({"reduce_input_grad": 0}, TypeError, "reduce_input_grad must be True or False"),
    ],
)
def test_bad_arguments_are_refused_naming_them(kwargs, error, says):
    x, w, targets, _, _ = problem()
    with pytest.raises(error, match=says):
        chunked_logprobs(x, w, targets, **kwargs)


def test_bad_shapes_are_refused_naming_them():
    x, w, targets, _, _ = problem()
    with pytest.raises(ValueError, match=r"targets \(66,\) must be shaped \(67,\)"):
        chunked_logprobs(x, w, targets[:-1])
    with pytest.raises(ValueError, match="must end in the weight's hidden size 64"):
        chunked_logprobs(x[:, :-1], w, targets)
    with pytest.raises(TypeError, match="targets must be integer token ids"):
        chunked_logprobs(x, w, targets.float())


# ---------------------------------------------------------------- tensor parallelism


CASES = {  # name -> keyword arguments of the call (TP cases add tp_group)
    "fp32out": dict(chunk_rows=16, chunk_vocab=96),
    "fp32out-entropy-t0.7": dict(chunk_rows=16, chunk_vocab=96, entropy=True, temperature=0.7),
    "fp32": dict(mode="fp32", chunk_rows=40, chunk_vocab=1000),
    "fp32out-kept-entropy": dict(keep_logits=True, chunk_rows=16, chunk_vocab=96, entropy=True, temperature=0.7),
}


def _run_case(x, w, targets, g, ge, kwargs, group=None, sequence_parallel=False):
    xl, wl = leaves(x, w, main_grad=True)
    out = chunked_logprobs(
        xl, wl, targets, tp_group=group, sequence_parallel=sequence_parallel, fuse_wgrad=True, **kwargs
    )
    lp, ent = out if isinstance(out, tuple) else (out, None)
    loss = (lp * g).sum() + (0 if ent is None else (ent * ge).sum())
    loss.backward()
    return {"lp": lp.detach(), "ent": None if ent is None else ent.detach(), "dx": xl.grad, "dw": wl.main_grad}


def _tp_worker(rank: int, world: int, init_method: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_gloo(rank, world, init_method)
    try:
        x, w, targets, g, ge = problem(13, t=64)
        shard = w.chunk(world)[rank]
        results = {}
        for name, kwargs in CASES.items():
            results[name] = _run_case(x, shard, targets, g, ge, kwargs, dist.group.WORLD)
            local = x.chunk(world)[rank]  # sequence parallel: this rank's tokens
            results[name + "/sp"] = _run_case(local, shard, targets, g, ge, kwargs, dist.group.WORLD, True)
            # the input gradient left to the caller's region to sum (SkyRL's fused path)
            part = _run_case(x, shard, targets, g, ge, {**kwargs, "reduce_input_grad": False}, dist.group.WORLD)
            dist.all_reduce(part["dx"])  # what Megatron's copy_to_tensor_model_parallel_region does
            results[name + "/caller-sums"] = part
        with pytest.raises(ValueError, match="reduce_input_grad=False keeps each rank's vocabulary part"):
            chunked_logprobs(x.chunk(world)[rank], shard, targets, tp_group=dist.group.WORLD,
                             sequence_parallel=True, reduce_input_grad=False)  # fmt: skip
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_tp2_over_gloo_equals_tp1():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir, file_store() as init_method:
        mp.spawn(_tp_worker, args=(2, init_method, out_dir), nprocs=2, join=True)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
    x, w, targets, g, ge = problem(13, t=64)
    for name, kwargs in CASES.items():
        one = _run_case(x, w, targets, g, ge, kwargs)
        for variant in (name, name + "/sp", name + "/caller-sums"):
            got = [r[variant] for r in ranks]
            for part in got:  # every rank has every token's log-prob (and entropy)
                assert (part["lp"] - one["lp"]).abs().max() < 4e-6, variant
                if one["ent"] is not None:
                    # entropies of ~7 nats: a few fp32 ulps apart (the order of the sums)
                    assert (part["ent"] - one["ent"]).abs().max() < 1e-5, variant
            # each rank's weight gradient is its rows of TP=1's
            dw = torch.cat([part["dw"] for part in got])
            assert relative(dw, one["dw"]) < 1e-5, variant
            # the input gradient summed over the ranks (sequence parallel: each rank its tokens)
            dx = torch.cat([part["dx"] for part in got]) if variant.endswith("/sp") else got[0]["dx"]
            assert torch.equal(got[0]["dx"], got[1]["dx"]) or variant.endswith("/sp")
            assert relative(dx, one["dx"]) < 2.0**-8, variant


# ---------------------------------------------------------------- per-token temperature, soft-cap


def float64_capped(x, w, targets, temperature, softcap):
    """log-probs and entropy of softcap * tanh(z / softcap) / temperature (a number or [T]), in float64."""
    z = x.double() @ w.double().t()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = temperature.double()[:, None] if isinstance(temperature, torch.Tensor) else temperature
    log_p = torch.log_softmax(z / t, dim=-1)
    return log_p.gather(1, targets[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


def per_token_temperatures(t: int = T) -> torch.Tensor:
    # Prime-RL's per-sample temperatures: runs of one value per packed sample
    return torch.cat([torch.full((n,), value) for n, value in ((20, 0.7), (30, 1.0), (t - 50, 1.3))])


@pytest.mark.parametrize("softcap", [None, 30.0, 5.0])
@pytest.mark.parametrize("per_token", [False, True])
def test_per_token_temperature_and_softcap_against_float64(per_token, softcap):
    # a cap of 5 bends logits of ~10-20 hard: the cap is computed on the fp32 logits, not after rounding
    x, w, targets, _, _ = problem(11)
    temperature = per_token_temperatures() if per_token else 0.8
    ref_lp, ref_ent = float64_capped(x, w, targets, temperature, softcap)
    lp, ent = chunked_logprobs(
        x, w, targets, temperature=temperature, softcap=softcap, entropy=True, chunk_rows=9, chunk_vocab=70
    )
    assert (lp.double() - ref_lp).abs().max() < 1e-5
    assert (ent.double() - ref_ent).abs().max() < 1e-5


def test_a_uniform_per_token_temperature_is_the_scalar_bit_for_bit():
    x, w, targets, _, _ = problem(12)
    scalar = chunked_logprobs(x, w, targets, temperature=0.7, entropy=True, chunk_rows=9, chunk_vocab=70)
    tensor = chunked_logprobs(
        x, w, targets, temperature=torch.full((T,), 0.7), entropy=True, chunk_rows=9, chunk_vocab=70
    )
    assert torch.equal(scalar[0], tensor[0]) and torch.equal(scalar[1], tensor[1])


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_per_token_temperature_and_softcap_gradients_against_float64(softcap):
    x, w, targets, g, ge = problem(13)
    temperature = per_token_temperatures()

    def loss64(xd, wd):
        lp, ent = float64_capped(xd, wd, targets, temperature, softcap)
        return (lp * g.double()).sum() + (ent * ge.double()).sum()

    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    loss64(xd, wd).backward()
    xl, wl = leaves(x, w)
    lp, ent = chunked_logprobs(
        xl, wl, targets, mode="fp32", temperature=temperature, softcap=softcap, entropy=True, chunk_rows=10
    )
    ((lp * g).sum() + (ent * ge).sum()).backward()
    assert relative(wl.grad, wd.grad) < 2.0**-8  # bf16 delivery
    assert relative(xl.grad, xd.grad) < 2.0**-8


def test_softcap_changes_the_log_probs_as_the_cap_does():
    # a user would notice: a cap of 5 flattens the distribution (higher entropy than without it)
    x, w, targets, _, _ = problem(14)
    _, plain = chunked_logprobs(x, w, targets, entropy=True)
    _, capped = chunked_logprobs(x, w, targets, entropy=True, softcap=5.0)
    assert (capped > plain).float().mean() > 0.9


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"softcap": 0.0}, ValueError, "softcap must be None or a finite number > 0"),
        ({"softcap": True}, ValueError, "softcap must be None or a finite number > 0"),
        ({"temperature": torch.ones(T - 1)}, ValueError, r"per-token temperature \(66,\) must be shaped"),
        ({"temperature": torch.ones(T, dtype=torch.int64)}, TypeError, "must be floating point"),
    ],
)
def test_bad_softcap_and_per_token_temperatures_are_refused(kwargs, error, says):
    x, w, targets, _, _ = problem()
    with pytest.raises(error, match=says):
        chunked_logprobs(x, w, targets, **kwargs)


# ---------------------------------------------------------------- kept logits (short sequences)


def _all_of(fn, x, w, targets, g, ge, **kw):
    """log-probs, entropy, input and weight gradients (main_grad) of one call and its backward."""
    xl, wl = leaves(x, w, main_grad=True)
    lp, ent = fn(xl, wl, targets, entropy=True, fuse_wgrad=True, **kw)
    ((lp * g).sum() + (ent * ge).sum()).backward()
    return lp.detach(), ent.detach(), xl.grad, wl.main_grad


@pytest.mark.parametrize("mode", MEGATRON_MODES)
@pytest.mark.parametrize(("temperature", "softcap"), [(0.7, None), ("per-token", 5.0)])
def test_kept_logits_give_what_recomputing_gives(mode, temperature, softcap):
    # the same formulas from the same fp32 logits: only the order of fp32 sums may differ
    x, w, targets, g, ge = problem(21)
    temperature = per_token_temperatures() if temperature == "per-token" else temperature
    kw = dict(mode=mode, temperature=temperature, softcap=softcap, chunk_rows=16, chunk_vocab=96)
    kept = _all_of(chunked_logprobs, x, w, targets, g, ge, keep_logits=True, **kw)
    again = _all_of(chunked_logprobs, x, w, targets, g, ge, keep_logits=False, **kw)
    # (the entropy, log Z - sum(p z), cancels: a few fp32 ulps of log Z)
    assert (kept[0] - again[0]).abs().max() < 4e-6 and (kept[1] - again[1]).abs().max() < 1e-5
    # the weight gradient: 16-bit copies of gradients a few ulps apart may round apart (fp32out's
    # fp16 copy: 2**-11), far under each mode's own error against float64
    assert relative(kept[3], again[3]) < 1e-5
    assert relative(kept[2], again[2]) < 2.0**-8
    lp64, ent64 = float64_capped(x, w, targets, temperature, softcap)
    assert (kept[0].double() - lp64).abs().max() < 1e-5 and (kept[1].double() - ent64).abs().max() < 1e-5


def test_kept_logits_are_not_overwritten_by_the_backward():
    # a graph kept for a second backward reads the same logits again: the same gradients twice
    x, w, targets, g, _ = problem(22)
    xl, wl = leaves(x, w)
    lp = chunked_logprobs(xl, wl, targets, mode="fp32", keep_logits=True, chunk_rows=16, chunk_vocab=96)
    (lp * g).sum().backward(retain_graph=True)
    first = (xl.grad.clone(), wl.grad.clone())
    xl.grad = wl.grad = None
    (lp * g).sum().backward()
    assert torch.equal(xl.grad, first[0]) and torch.equal(wl.grad, first[1])


def test_kept_logits_are_freed_once_the_backward_has_run():
    x, w, targets, g, _ = problem(23)
    xl, wl = leaves(x, w)
    lp = chunked_logprobs(xl, wl, targets, keep_logits=True)
    saved = lp.grad_fn.saved_tensors
    assert saved[3].shape == (T, V) and saved[3].dtype == torch.float32
    del saved
    (lp * g).sum().backward()
    with pytest.raises(RuntimeError, match="freed|second time"):
        lp.grad_fn.saved_tensors  # noqa: B018
    recompute = chunked_logprobs(xl, wl, targets, keep_logits=False)
    assert recompute.grad_fn.saved_tensors[3] is None


def test_which_calls_keep_their_logits(monkeypatch):
    from fp32patch.runtime.kernels import chunked_logprobs as module

    def plan(t=T, v=V, backward=True, **kw):
        x = torch.zeros(t, 8).bfloat16().requires_grad_(backward)
        w = torch.zeros(v, 8).bfloat16()
        args = dict(chunk_rows=None, chunk_vocab=None, softcap=None)
        args.update(kw)
        return module._plan(
            x, w, torch.zeros(t, dtype=torch.long), "fp32out", 1.0, False, None, None, False, False, **args
        )

    monkeypatch.delenv(module.KEEP_LOGITS_ENV_VAR, raising=False)
    assert plan().keep  # a short call keeps, and reads its logits in one tile
    assert (plan().chunk_rows, plan().chunk_vocab) == (T, V)
    assert (plan(keep_logits=True).chunk_rows, plan(keep_logits=True).chunk_vocab) == (T, V)
    kept_tiles = plan(chunk_rows=16, keep_logits=True)
    assert (kept_tiles.chunk_rows, kept_tiles.chunk_vocab) == (16, module.choose_tiles(T, V, 8)[1])  # a tile asked for
    # no backward to serve: nothing kept (old and reference log-probs), unless asked
    assert not plan(backward=False).keep and plan(backward=False, keep_logits=True).keep
    with torch.no_grad():
        assert not plan().keep
    assert not plan(chunk_rows=16).keep and not plan(chunk_vocab=64).keep  # a tile asked for: recompute
    assert plan(chunk_rows=16, keep_logits=True).keep and not plan(keep_logits=False).keep
    limit = module.KEEP_LOGITS_BYTES
    assert module.keeps_logits(limit // (4 * 151936), 151936)
    assert not module.keeps_logits(limit // (4 * 151936) + 1, 151936)
    monkeypatch.setenv(module.KEEP_LOGITS_ENV_VAR, "0")
    assert not plan().keep
    monkeypatch.setenv(module.KEEP_LOGITS_ENV_VAR, str(T * V * 4))
    assert plan().keep and not plan(t=T + 1).keep
    monkeypatch.setenv(module.KEEP_LOGITS_ENV_VAR, "4GiB")
    with pytest.raises(ValueError, match="FP32PATCH_KEEP_LOGITS_BYTES must be a whole number of bytes, not '4GiB'"):
        plan()
    monkeypatch.delenv(module.KEEP_LOGITS_ENV_VAR)
    with pytest.raises(TypeError, match="keep_logits must be None, True or False, not 1"):
        plan(keep_logits=1)


@pytest.mark.parametrize("name", ["FP32PATCH_TRITON", "FP32PATCH_GEMM_LSE", "FP32PATCH_STRIPS"])
def test_the_kernels_switches_take_0_or_1_and_refuse_anything_else(monkeypatch, name):
    from fp32patch.runtime.errors import Fp32LmHeadConfigError
    from fp32patch.runtime.kernels import chunked_logprobs, fp32out

    assert name in (fp32out.TRITON_ENV_VAR, chunked_logprobs.GEMM_LSE_ENV_VAR, chunked_logprobs.STRIPS_ENV_VAR)
    monkeypatch.delenv(name, raising=False)
    assert fp32out.env_switch(name) is None  # unset: the measured default
    for value, want in (("", None), (" 1 ", True), ("0", False), ("1", True)):
        monkeypatch.setenv(name, value)
        assert fp32out.env_switch(name) is want
    for value in ("true", "off", "2", "yes"):
        monkeypatch.setenv(name, value)
        with pytest.raises(Fp32LmHeadConfigError, match=f"^{name}='{value}': expected 0 or 1, or unset"):
            fp32out.env_switch(name)


def test_a_bad_triton_switch_is_refused_where_the_kernels_would_run(monkeypatch):
    # the CPU path never reads it; on a device the Triton kernels take (the CPU stands in: the
    # switch is read before any kernel), a mistyped FP32PATCH_TRITON is refused, naming it,
    # instead of meaning the default
    from fp32patch.runtime.errors import Fp32LmHeadConfigError
    from fp32patch.runtime.kernels import fp32out

    monkeypatch.setenv(fp32out.TRITON_ENV_VAR, "false")
    assert not fp32out.triton_device(torch.zeros(1))
    monkeypatch.setattr(fp32out, "TRITON_DEVICE_TYPES", {"cuda", "cpu"})
    with pytest.raises(Fp32LmHeadConfigError, match="FP32PATCH_TRITON='false'"):
        fp32out.triton_device(torch.zeros(1))
