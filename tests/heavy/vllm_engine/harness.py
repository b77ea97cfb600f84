"""What every engine of the real-engine suite shares: the tiny model on disk, the plugin that
keeps vLLM's CPU build on torch's plain GEMM, and the functions the tests send to the workers.

The model is an untied Qwen2 made here (random weights, a byte-level BPE tokenizer trained on
a few standard-library files): nothing comes from a hub. Its vocabulary (500) pads to 512 in
vLLM's head, so the padding trim is on the path; its head is scaled so that logits reach ~10,
where bf16's rounding of them is coarse.

Functions named ``on_worker_*`` run inside an engine's worker, sent there by
``collective_rpc`` (they are pickled by reference: the worker imports this module, from the
repository on its ``PYTHONPATH``).
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

# head_dim 64: vLLM's CPU attention takes 32, 64, 80, ... (not 16)
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 500, 128, 2, 2, 1
MAX_MODEL_LEN = 96
# Token-id prompts (no tokenizer in the path that is compared); lengths 5, 9, 13
PROMPTS = [[(7 * i + 3 * k + 11) % 480 + 10 for k in range(5 + 4 * i)] for i in range(3)]
NEW_TOKENS = 8
TOP_LOGPROBS = 5


# ---------------------------------------------------------------- the model on disk


def _tokenizer(folder: Path):
    from transformers import PreTrainedTokenizerFast

    from bench.agreement import EOS, read_texts, train_tokenizer

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = read_texts([stdlib / name for name in ("textwrap.py", "string.py", "shlex.py")])
    tokenizer = train_tokenizer(texts, VOCAB)
    assert tokenizer.get_vocab_size() == VOCAB, tokenizer.get_vocab_size()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS).save_pretrained(folder)


def qwen2_weights(seed: int) -> dict:
    """A full set of the tiny Qwen2's weights (bf16), by checkpoint name."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(_config())
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # logits of ~10: bf16 rounds them by ~0.03
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.8, 1.2)
    return {name: tensor.to(torch.bfloat16).contiguous() for name, tensor in model.state_dict().items()}


def _config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=0,
        torch_dtype="bfloat16",
        architectures=["Qwen2ForCausalLM"],
    )


def save_model(folder: Path, seed: int = 0) -> Path:
    """The tiny Qwen2 with the weights of ``seed`` in ``folder`` (config, safetensors, tokenizer)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    _config().save_pretrained(folder)
    save_file(qwen2_weights(seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    _tokenizer(folder)
    return folder


CAP = 5.0  # save_capped_model's final_logit_softcapping


def save_capped_model(folder: Path) -> Path:
    """A tiny Gemma 2 (bf16 on disk, untied head of ``VOCAB`` x ``HIDDEN``, logits of ~10) whose
    final logits it soft-caps at ``CAP`` (``final_logit_softcapping``): for the stacks' trainer
    paths that load a soft-capped model. No tokenizer: the runs feed token ids."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
        max_position_embeddings=256, tie_word_embeddings=False, final_logit_softcapping=CAP,
        attn_logit_softcapping=None, eos_token_id=0, bos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(1)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


# ---------------------------------------------------------------- engines and their generations

ENGINE_ARGS = dict(
    dtype="bfloat16",
    enforce_eager=True,
    # vLLM's CPU worker sizes the KV cache as a fraction of the RAM less what the process holds
    # (0.25 refuses 0.05 of 18 GiB once torch is loaded); a fixed size holds the tiny model's
    # ~0.5 KiB per token many times over, whatever else runs on the machine
    kv_cache_memory_bytes=64 << 20,
    max_model_len=MAX_MODEL_LEN,
    enable_prefix_caching=False,  # a refit must not meet KV blocks of the weights before it
    seed=0,
)


def generate(llm) -> list[dict]:
    """Greedy generations of the suite's prompts, one request at a time (the same batch shapes
    in every engine and in the server), as token ids and the logprobs vLLM reports."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=TOP_LOGPROBS)
    results = []
    for prompt in PROMPTS:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        completion = out.outputs[0]
        results.append(
            {
                "tokens": list(completion.token_ids),
                "logprobs": [
                    {str(token): entry.logprob for token, entry in step.items()} for step in completion.logprobs
                ],
            }
        )
    return results


def server_flags() -> list[str]:
    """ENGINE_ARGS as the OpenAI server's command line spells them."""
    flags = []
    for key, value in ENGINE_ARGS.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            flags.append("--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


def completion(url: str, prompt: list[int], **overrides):
    """One greedy completion from the server, as ``generate`` records one: token ids and, per
    step, the logprobs by token id (the server names tokens "token_id:N" when asked)."""
    import httpx

    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "logprobs": TOP_LOGPROBS,
        "return_tokens_as_token_ids": True,
        **overrides,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def as_generation(response) -> dict:
    logprobs = response.json()["choices"][0]["logprobs"]

    def token_id(name: str) -> str:
        return name.removeprefix("token_id:")

    return {
        "tokens": [int(token_id(t)) for t in logprobs["tokens"]],
        "logprobs": [{token_id(t): lp for t, lp in step.items()} for step in logprobs["top_logprobs"]],
        "token_logprobs": logprobs["token_logprobs"],
    }


# ---------------------------------------------------------------- the plugin in every engine process


def force_plain_gemm() -> None:
    """vLLM general plugin: keep every linear layer on torch's plain GEMM over its own weight.

    vLLM's CPU build repacks each linear layer's weight for oneDNN/AMX when it is processed
    after loading (``dispatch_cpu_unquantized_gemm``) and drops ``layer.weight``, so no refit
    through ``load_weights`` could find it again. The plugin runs in every engine and worker
    process before a model is built, and replaces that choice, in those processes only, with
    the one a CPU without those kernels makes. No file changes, patched or not.
    """
    import vllm.model_executor.layers.linear  # noqa: F401  (modules that hold the dispatch by name)
    import vllm.model_executor.layers.vocab_parallel_embedding  # noqa: F401

    from tests.heavy.vllm import tiny

    tiny.force_plain_cpu_gemm()


PLUGIN = "fp32patch_test_plain_gemm"


def plugin_root(folder: Path, *, cpu_mm_out_dtype: bool = False) -> Path:
    """A folder that, on ``PYTHONPATH``, registers ``force_plain_gemm`` as a vLLM general plugin
    (a distribution's metadata with the entry point, as an installed plugin has); with
    ``cpu_mm_out_dtype``, ``cpu_mm_out_dtype`` too."""
    info = folder / "fp32patch_test_plain_gemm-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fp32patch-test-plain-gemm\nVersion: 0\n")
    lines = [f"{PLUGIN} = tests.heavy.vllm_engine.harness:force_plain_gemm"]
    if cpu_mm_out_dtype:
        lines.append(f"{PLUGIN}_mm_out_dtype = tests.heavy.vllm_engine.harness:cpu_mm_out_dtype")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\n" + "\n".join(lines) + "\n")
    return folder


_LIBRARIES: list = []  # torch.library registrations, kept alive for the process


def cpu_mm_out_dtype() -> None:
    """vLLM general plugin, a stand-in for a CUDA kernel: ``torch.mm(a, b, out_dtype=float32)``
    (``aten::mm.dtype``) exists for CUDA only, and code that calls it on the CPU (Prime-RL's own
    vLLM patch) fails there. Where it is missing, the CPU gets the exact upcast: bf16 and fp16
    operands are exact in fp32, so the product is the one the CUDA kernel's fp32 accumulator
    computes, but for the order of the sums (fp32out's own CPU path computes the same)."""
    import torch

    one = torch.ones(1, 1, dtype=torch.bfloat16)
    try:
        torch.mm(one, one, out_dtype=torch.float32)
        return
    except (NotImplementedError, RuntimeError, TypeError):
        pass

    def mm_dtype(a, b, out_dtype):
        return torch.mm(a.to(out_dtype), b.to(out_dtype))

    library = torch.library.Library("aten", "IMPL")
    library.impl("mm.dtype", mm_dtype, "CPU")
    _LIBRARIES.append(library)


# ---------------------------------------------------------------- sent to the workers


def _model(worker):
    return worker.model_runner.model


def on_worker_gemms(worker) -> list[str]:
    """Every linear layer whose CPU GEMM is not torch's linear on its own (kept) weight."""
    import torch

    wrong = []
    for name, module in _model(worker).named_modules():
        chosen = getattr(module, "cpu_linear", None)
        if chosen is None:
            continue
        weight = getattr(module, "weight", None)
        if chosen is not torch.nn.functional.linear or weight is None or weight.numel() == 0:
            wrong.append(f"{name}: {chosen!r} on {None if weight is None else tuple(weight.shape)}")
    return wrong


def on_worker_load_weights(worker, path: str, skip: tuple[str, ...] = (), only: tuple[str, ...] = ()) -> int:
    """A refit through the model's ``load_weights``, from a safetensors file; returns the count."""
    from safetensors.torch import load_file

    weights = [(n, t) for n, t in load_file(path).items() if n not in skip and (not only or n in only)]
    _model(worker).load_weights(iter(weights))
    return len(weights)


def on_worker_copy_in_place(worker, path: str, names: tuple[str, ...]) -> list[str]:
    """A refit that writes straight into the parameters ``names`` (``param.data.copy_``), as some
    trainers' weight syncs do, without ``load_weights``; a head padded past the vocabulary takes
    the file's rows at its top. Returns the names written."""
    import torch
    from safetensors.torch import load_file

    weights = load_file(path)
    params = dict(_model(worker).named_parameters())
    with torch.no_grad():
        for name in names:
            params[name].data[: weights[name].shape[0]].copy_(weights[name])
    return list(names)


def on_worker_capture(worker) -> None:
    """Record the hidden states and logits of every logits-processor call from now on."""
    model = _model(worker)
    on_worker_release(worker)
    calls: list = []

    def record(module, args, output):
        if output is not None:  # None: a rank that vLLM's gather leaves without logits
            calls.append((args[1].detach().clone(), output.detach().clone()))

    worker._fp32patch_test_capture = (calls, model.logits_processor.register_forward_hook(record))


def on_worker_release(worker) -> None:
    held = getattr(worker, "_fp32patch_test_capture", None)
    if held is not None:
        held[1].remove()
        worker._fp32patch_test_capture = None


def on_worker_captured_logits(worker, head_from: str | None = None) -> dict:
    """The recorded logits against float64 logits of the same hidden states and the live head
    weight (trimmed to the vocabulary; under tensor parallelism, where a worker holds a shard,
    the whole head of the safetensors file ``head_from``): their dtypes, the largest relative
    error, the rows."""
    from safetensors.torch import load_file

    calls = worker._fp32patch_test_capture[0]
    on_worker_release(worker)
    if head_from is None:
        weight = _model(worker).lm_head.weight.detach().double()[:VOCAB]
    else:
        weight = load_file(head_from)["lm_head.weight"].double()
    worst, dtypes, rows = 0.0, set(), 0
    for hidden, logits in calls:
        want = hidden.double() @ weight.T
        got = logits[..., :VOCAB].double()
        worst = max(worst, ((got - want).abs().max() / want.abs().max()).item())
        dtypes.add(str(logits.dtype).removeprefix("torch."))
        rows += hidden.shape[0]
    return {"dtypes": sorted(dtypes), "rel_err": worst, "rows": rows, "calls": len(calls), "pid": os.getpid()}


def on_worker_environ(worker, name: str) -> str | None:
    return os.environ.get(name)


# ---------------------------------------------------------------- the stacks' worker extensions


class StackWorkerExtension:
    """The methods NeMo-RL's and verl's patched worker extensions add to every vLLM worker, as
    fp32patch's specs write them (``fp32patch_probe_lm_head``), and a weight update called by
    name whose weights travel in the RPC itself, as the stacks' refits call theirs. The weights
    go as one safetensors blob: tensors as RPC arguments reach a worker as memoryviews, which
    vLLM's executor cannot pickle on to the workers ("cannot pickle memoryview objects", 0.32)."""

    def fp32patch_probe_lm_head(self) -> dict:
        from fp32patch.runtime.nemo_rl import probe_vllm_model

        return probe_vllm_model(self.model_runner.model)

    def fp32patch_test_update_weights(self, blob: bytes) -> int:
        from safetensors.torch import load

        weights = load(blob)
        self.model_runner.model.load_weights(weights=list(weights.items()))
        return len(weights)


EXTENSION = f"{__name__}.StackWorkerExtension"
