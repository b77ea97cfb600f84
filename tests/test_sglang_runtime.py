"""SGLang's own LogitsProcessor, patched by sglang-fp32-lm-head, on the CPU; the guard's hazards; the
startup probe over what SGLang's head really computed.

The real ``logits_processor.py`` of each release (from its wheel, cached under
$FP32PATCH_TEST_CACHE) is imported with stand-ins for the modules it imports that need SGLang's
runtime or CUDA (``tests/support/sglang_standins.py``: SGLang's other modules, triton,
sgl_kernel, flashinfer; the test checks which it got), then its ``_get_logits`` runs on bf16
hidden states and a bf16 head: the patched file and the stock one, the flag on and off, fp32patch
importable or not, a LoRA-wrapped and a quantized head. The probe then reads log-probs computed
from those logits as SGLang's sampler computes them.
"""

from __future__ import annotations

import ast
import logging
import shutil
import sys

import pytest

from fp32patch.runtime.errors import Fp32LmHeadConfigError, Fp32LmHeadMismatchError
from fp32patch.runtime.kit import rollout
from fp32patch.runtime.kit import sglang as kit
from tests.support.pypi import import_root_from_members, member_files
from tests.support.sglang_standins import Metadata, load_logits_processor, processor

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.network

MEMBER = "sglang/srt/layers/logits_processor.py"
RELEASES = ("0.5.3", "0.5.8", "0.5.9", "0.5.15.post1", "0.5.17")
KEY = "stack.fp32_lm_head"
HEAD_MODULE = "fp32patch.runtime.heads.sglang"
logger = logging.getLogger("test.sglang")


@pytest.fixture(scope="module", params=RELEASES)
def release(request, tmp_path_factory):
    """(version, stock module, patched module, the stand-ins each got)."""
    from typer.testing import CliRunner

    from fp32patch.cli import app

    version = request.param
    stock_root = import_root_from_members("sglang", version, [MEMBER], tmp_path_factory.mktemp("stock") / "sp")
    patched_root = tmp_path_factory.mktemp("patched") / "sp"
    shutil.copytree(stock_root, patched_root)
    applied = CliRunner().invoke(app, ["apply", "-s", str(patched_root), "--patch", "sglang-fp32-lm-head"])
    assert applied.exit_code == 0, applied.stdout
    stock, made = load_logits_processor(stock_root / MEMBER)
    patched, made_patched = load_logits_processor(patched_root / MEMBER)
    assert "_fp32patch_sglang_fp32_logits" in vars(patched) and "_fp32patch_sglang_fp32_logits" not in vars(stock)
    return version, stock, patched, made + made_patched


def _operands(tokens: int = 16, hidden: int = 256, vocab: int = 1000, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen).bfloat16()
    head = torch.nn.Module()
    head.weight = torch.nn.Parameter((torch.randn(vocab, hidden, generator=gen) * 0.3).bfloat16(), requires_grad=False)
    return h, head


def _logits(module, head, h, *, fp32: bool, rl: str | None = None):
    proc = processor(module, vocab=head.weight.shape[0], fp32=fp32, rl_on_policy_target=rl)
    return proc._get_logits(h, head, Metadata())


def _forget_head():
    sys.modules.pop(HEAD_MODULE, None)


# ---------------------------------------------------------------- the patched head on SGLang's own code


def test_the_stand_ins_are_sglangs_own_modules_and_cuda_kernels_only(release):
    version, _, _, made = release
    roots = {name.split(".")[0] for name in made}
    assert roots <= {"sglang", "triton", "sgl_kernel", "flashinfer"}, made
    assert "sglang.srt.layers.logits_processor" not in made  # the real file, never a stand-in
    assert any(n.startswith("sglang.srt.layers.vocab_parallel_embedding") for n in made), made


def test_flag_on_gives_fp32_logits_within_1e_5_of_float64_through_fp32patch(release):
    version, stock, patched, _ = release
    h, head = _operands()
    _forget_head()
    ours = _logits(patched, head, h, fp32=True)
    assert HEAD_MODULE in sys.modules  # the flag's branch ran fp32patch's product
    exact = h.double() @ head.weight.double().T
    assert ours.dtype == torch.float32
    assert (ours.double() - exact).abs().max().item() < 1e-5
    # on the CPU, fp32patch's product is the exact upcast: SGLang's own flag, bit for bit
    from fp32patch.runtime.heads.sglang import way

    assert way(h, head.weight) == "upcast"
    assert torch.equal(ours, _logits(stock, head, h, fp32=True))
    # the stock bf16 head, for scale: fp32 dtype after SGLang's .float(), bf16 values
    bf16 = _logits(stock, head, h, fp32=False)
    assert (bf16.double() - exact).abs().max().item() > 1e-3


def test_flag_off_is_stock_bit_for_bit_and_never_imports_fp32patch(release):
    version, stock, patched, _ = release
    h, head = _operands(seed=1)
    _forget_head()
    assert torch.equal(_logits(patched, head, h, fp32=False), _logits(stock, head, h, fp32=False))
    assert HEAD_MODULE not in sys.modules


def test_without_fp32patch_the_patched_file_computes_sglangs_own_upcast(release, monkeypatch):
    version, stock, patched, _ = release
    h, head = _operands(seed=2)
    monkeypatch.setitem(sys.modules, HEAD_MODULE, None)  # `from ... import` raises ImportError
    assert torch.equal(_logits(patched, head, h, fp32=True), _logits(stock, head, h, fp32=True))


class _LoraHead(torch.nn.Module):
    """A LoRA-wrapped head as SGLang's logits processor tells one (``set_lora``/``apply_lora``): its
    forward is the base layer's bf16 GEMM."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def set_lora(self, *args):
        pass

    def apply_lora(self, *args):
        pass

    def forward(self, x):
        return x @ self.weight.T


class Fp8LinearMethod:
    """A quantization method whose ``apply`` is the head's GEMM at the model's dtype."""

    def apply(self, layer, x, bias=None):
        return x @ layer.weight.T


@pytest.mark.parametrize("hazard", ["lora", "quantized"])
def test_a_lora_or_quantized_head_skips_the_flag_and_the_probe_refuses_it(release, hazard):
    version, _, patched, _ = release
    release_tuple = kit.release_tuple(version)
    if (hazard == "lora" and release_tuple < (0, 5, 7)) or (hazard == "quantized" and release_tuple < (0, 5, 15)):
        pytest.skip(f"SGLang {version} has no {hazard} branch before the flag's")
    h, plain = _operands(seed=3)
    if hazard == "lora":
        head = _LoraHead(plain.weight)
    else:
        head = plain
        head.quant_method = Fp8LinearMethod()
    logits = _logits(patched, head, h, fp32=True)
    assert torch.equal(logits, (h @ plain.weight.T).float())  # SGLang's bf16 head, flag or not
    info = {"enable_fp32_lm_head": True, "version": version}
    if hazard == "quantized":
        info["quantization"] = "fp8"
    with pytest.raises(Fp32LmHeadMismatchError) as caught:
        _probe({"http://rollout-0:30000": (info, _server_output(logits))}, "fp32out")
    text = str(caught.value)
    assert "SGLang server http://rollout-0:30000" in text and "computes bfloat16 log-probs" in text
    assert "bf16's grid" in text


# ---------------------------------------------------------------- the probe


def _server_output(logits, *, rl: str | None = None):
    """SGLang's answer to ``kit.probe_request()``: the top log-probs of each position as its
    sampler computes them (log_softmax of the fp32 logits; with ``rl_on_policy_target``, of
    ``logits.bfloat16().div(temperature).bfloat16()``)."""
    x = logits.bfloat16().div(1.0).bfloat16() if rl else logits.float()
    logprobs = torch.log_softmax(x, dim=-1).float()
    top = logprobs.topk(kit.PROBE_TOP_LOGPROBS, dim=-1)
    rows = [
        [[v, i, None] for v, i in zip(vals, ids, strict=True)]
        for vals, ids in zip(top.values.tolist(), top.indices.tolist(), strict=True)
    ]
    return {"text": "", "meta_info": {"input_top_logprobs": [None, *rows[:-1]], "output_top_logprobs": rows[-1:]}}


class _Response:
    def __init__(self, status, body):
        self.status_code, self.body = status, body

    def json(self):
        return self.body


def _probe(servers, mode):
    """``kit.probe_servers`` over fake HTTP servers: ``{url: (server_info, generate answer)}``."""

    def get(url, timeout):
        base, _, path = url.rpartition("/")
        return _Response(200, servers[base][0]) if path == "server_info" else _Response(404, None)

    def post(url, json, timeout):
        base = url.rsplit("/", 1)[0]
        assert json == kit.probe_request()
        return _Response(200, servers[base][1])

    return kit.probe_servers(list(servers), mode, get=get, post=post, where="rollout", key=KEY, logger=logger)


def test_the_probe_passes_fp32_servers_under_the_key_and_stock_ones_without(release):
    version, _, patched, _ = release
    h, head = _operands(seed=4)
    on = _server_output(_logits(patched, head, h, fp32=True))
    off = _server_output(_logits(patched, head, h, fp32=False))
    [report] = _probe({"http://a:1": ({"enable_fp32_lm_head": True, "version": version}, on)}, "fp32out")
    assert (report["dtype"], report["measured"], report["version"]) == ("float32", "float32", version)
    [report] = _probe({"http://a:1": ({"enable_fp32_lm_head": False}, off)}, None)
    assert (report["dtype"], report["measured"]) == ("bfloat16", "bfloat16")


def test_the_key_off_and_unread_fp32_logits_are_said_not_refused(release, caplog):
    """A model whose own config turns an fp32 head on reads as stock; its log-probs lie on no bf16
    grid, as a soft-capped head's do: the probe cannot tell the two apart, so it warns."""
    version, _, patched, _ = release
    h, head = _operands(seed=7)
    fp32 = _server_output(_logits(patched, head, h, fp32=True))
    with caplog.at_level(logging.WARNING, logger="test.sglang"):
        [report] = _probe({"http://a:1": ({"enable_fp32_lm_head": False}, fp32)}, None)
    assert (report["dtype"], report["measured"]) == ("bfloat16", "float32")
    assert "SGLang server http://a:1 reads as stock but" in caplog.text and f"turn {KEY} on" in caplog.text


def test_the_probe_refuses_each_one_sided_server_naming_it(release):
    version, _, patched, _ = release
    h, head = _operands(seed=5)
    fp32 = _logits(patched, head, h, fp32=True)
    bf16 = _logits(patched, head, h, fp32=False)
    good = ({"enable_fp32_lm_head": True}, _server_output(fp32))
    cases = [
        # the key on: a server without the flag, beside a good one
        ("fp32out", {"http://good:1": good, "http://bad:2": ({"enable_fp32_lm_head": False}, _server_output(bf16))}),
        # the key on: rl_on_policy_target rounds fp32 logits to bf16 before the log-probs
        (
            "fp32out",
            {
                "http://bad:2": (
                    {"enable_fp32_lm_head": True, "rl_on_policy_target": "fsdp"},
                    _server_output(fp32, rl="fsdp"),
                )
            },
        ),
        # the key off: the flag on (its log-probs are fp32's)
        (None, {"http://bad:2": good}),
        # the key off: a model switch through json_model_override_args
        (None, {"http://bad:2": ({"json_model_override_args": '{"enable_lm_head_fp32": true}'}, _server_output(fp32))}),
    ]
    for mode, servers in cases:
        with pytest.raises(Fp32LmHeadMismatchError) as caught:
            _probe(servers, mode)
        text = str(caught.value)
        assert "SGLang server http://bad:2" in text and "http://good:1" not in text.split("\n", 1)[1], text
        assert [r[1]["server"] for r in caught.value.disagreements] == ["http://bad:2"]


def test_a_server_that_cannot_answer_is_refused_naming_it():
    def get(url, timeout):
        raise ConnectionError("connection refused")

    with pytest.raises(Fp32LmHeadMismatchError, match=r"cannot probe the SGLang server at http://x:9.*ConnectionError"):
        kit.probe_servers(["http://x:9/"], "fp32out", get=get, post=get, where="w", key=KEY, logger=logger)


def test_the_in_process_engine_probe(release):
    version, _, patched, _ = release
    h, head = _operands(seed=6)
    output = _server_output(_logits(patched, head, h, fp32=True))

    class Engine:
        def get_server_info(self):
            return {"enable_fp32_lm_head": True, "version": version}

        def generate(self, **request):
            assert request == kit.probe_request()
            return output

    assert kit.probe_engine(Engine(), "fp32out", where="w", key=KEY, logger=logger)["dtype"] == "float32"
    with pytest.raises(Fp32LmHeadMismatchError, match="in-process Engine"):
        kit.probe_engine(Engine(), None, where="w", key=KEY, logger=logger)


def test_the_grade_needs_evidence():
    assert kit.logprob_grade([[[-1.0, 1], [-1.0, 2]] * 10])[0] is None  # a constant head
    assert kit.logprob_grade([None, []])[0] is None
    # a dummy-initialized model: top log-probs within a few fp32 ulps of each other, no grid could show
    tiny = [[[-6.9077 - 1e-6 * k, k] for k in range(20)]]
    assert kit.logprob_grade(tiny)[0] is None


# ---------------------------------------------------------------- the guard


class _Dataclass:
    pass


def _server_args(*names):
    """A ServerArgs shaped like SGLang's msgspec record (0.5.20+): its fields in __struct_fields__."""
    return type("ServerArgs", (), {"__struct_fields__": ("model_path", *names)})


NEW = _server_args("enable_fp32_lm_head", "rl_on_policy_target")
OLD = _server_args("rl_on_policy_target")  # before 0.5.3


@pytest.mark.parametrize(
    ("mode", "args", "environ", "fragments"),
    [
        ("fp32out", {"rl_on_policy_target": "fsdp"}, {}, ["rl_on_policy_target='fsdp'", "Unset rl_on_policy_target"]),
        ("fp32out", {"lora_target_modules": ["q_proj", "lm_head"]}, {}, ["lora_target_modules holds lm_head"]),
        (None, {"enable_fp32_lm_head": True}, {}, [f"is on in SGLang's arguments but {KEY} is off"]),
        (
            None,
            {"json_model_override_args": '{"enable_lm_head_output_fp32": true}'},
            {},
            ["json_model_override_args enable_lm_head_output_fp32=True", f"turn {KEY} on"],
        ),
        (None, {}, {"SGLANG_DSPARK_FP32_LM_HEAD": "1"}, ["SGLANG_DSPARK_FP32_LM_HEAD='1' in the environment"]),
        ("fp32out", {"json_model_override_args": "{not json"}, {}, ["json_model_override_args is not JSON"]),
    ],
)
def test_each_hazard_is_refused_before_anything_starts(mode, args, environ, fragments):
    before = dict(args)
    with pytest.raises(Fp32LmHeadConfigError) as caught:
        kit.sglang_args(args, mode, NEW, key=KEY, where="rollout server", logger=logger, environ=environ)
    text = str(caught.value)
    assert text.startswith("fp32patch (rollout server): ")
    for fragment in fragments:
        assert fragment in text, (fragment, text)
    assert args == before


def test_a_model_config_switch_is_refused_with_the_key_off():
    config = type("Config", (), {"enable_lm_head_fp32": True})()
    with pytest.raises(Fp32LmHeadConfigError, match="the model config's enable_lm_head_fp32=True"):
        kit.check_server_args({}, on=False, where="w", key=KEY, model_config=config, environ={})
    # with the key on it agrees
    assert kit.check_server_args({"enable_fp32_lm_head": True}, on=True, where="w", key=KEY, model_config=config) == []


def test_the_key_on_sets_the_flag_and_notes_what_only_the_probe_settles(caplog):
    args = {"model_path": "/m", "quantization": "fp8", "enable_lora": True}
    with caplog.at_level(logging.INFO, logger="test.sglang"):
        assert kit.sglang_args(args, "fp32out", NEW, key=KEY, where="w", logger=logger, environ={}) is args
    assert args["enable_fp32_lm_head"] is True
    assert "quantization='fp8'" in caplog.text and "LoRA adapters" in caplog.text
    with pytest.raises(Fp32LmHeadConfigError, match="SGLang 0.5.3 and later have it"):
        kit.sglang_args({}, "fp32out", OLD, key=KEY, where="w", logger=logger, environ={})
    # kit.rollout keeps the name verl's patched files use
    assert rollout.sglang_args is kit.sglang_args


# ---------------------------------------------------------------- what the guard says, on SGLang's real files


def _fields(text: str) -> set[str]:
    return {
        n.target.id
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }


def test_the_flag_and_rl_on_policy_target_are_where_the_guard_says():
    files = {
        v: member_files("sglang", v, ["sglang/srt/server_args.py", "sglang/srt/layers/sampler.py"])
        for v in ("0.5.2", "0.5.5", "0.5.17")
    }
    assert "enable_fp32_lm_head" not in _fields(files["0.5.2"]["sglang/srt/server_args.py"].read_text())
    for version in ("0.5.5", "0.5.17"):
        assert {"enable_fp32_lm_head", "rl_on_policy_target"} <= _fields(
            files[version]["sglang/srt/server_args.py"].read_text()
        )
        sampler = files[version]["sglang/srt/layers/sampler.py"].read_text()
        assert "logits.bfloat16().div(sampling_info.temperatures).bfloat16()" in sampler


def test_a_server_before_server_info_is_read_through_get_server_info():
    """SGLang 0.5.3's HTTP server has /get_server_info only."""
    gen = torch.Generator().manual_seed(8)
    h, w = torch.randn(8, 64, generator=gen).bfloat16(), torch.randn(300, 64, generator=gen).bfloat16()
    answer = _server_output(h.float() @ w.float().T)
    asked = []

    def get(url, timeout):
        asked.append(url)
        if url.endswith("/get_server_info"):
            return _Response(200, {"enable_fp32_lm_head": True, "version": "0.5.3"})
        return _Response(404, {"detail": "Not Found"})

    def post(url, json, timeout):
        return _Response(200, answer)

    [report] = kit.probe_servers(["http://old:30000"], "fp32out", get=get, post=post, where="w", key=KEY, logger=logger)
    assert asked == ["http://old:30000/server_info", "http://old:30000/get_server_info"]
    assert (report["dtype"], report["version"]) == ("float32", "0.5.3")
