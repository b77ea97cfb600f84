"""apply_fp32_lm_head without Megatron: finding the output layer, refusing what it cannot
convert, re-application. Numerics against real megatron-core are in tests/heavy/megatron."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from fp32patch.runtime.megatron_lm_head import apply_fp32_lm_head, fp32_lm_head_mode


class ColumnParallelLinear(torch.nn.Module):
    """Calls its ``_forward_impl`` the way megatron-core 0.19's ColumnParallelLinear does
    at TP=1 (the real class is exercised in the heavy suite)."""

    def __init__(self, hidden: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, hidden).bfloat16())
        self.config = SimpleNamespace(defer_embedding_wgrad_compute=False)
        self.gtp_remat_size = 1

    def _forward_impl(self, input, weight, *args, **kwargs):
        return input @ weight.t()

    def forward(self, x, weight=None):
        out = self._forward_impl(
            input=x,
            weight=self.weight if weight is None else weight,
            bias=None,
            gradient_accumulation_fusion=False,
            allreduce_dgrad=False,
            sequence_parallel=False,
            grad_output_buffer=None,
            wgrad_deferral_limit=None,
            tp_group=None,
            gtp_remat_size=1,
        )
        return out, None


class Model(torch.nn.Module):
    """A language model chunk: ``post_process`` and, on the last stage, ``output_layer``."""

    def __init__(self, post_process: bool = True, head: bool | None = None) -> None:
        super().__init__()
        self.post_process = post_process
        if post_process if head is None else head:
            self.output_layer = ColumnParallelLinear()


class Nest(torch.nn.Module):
    def __init__(self, attr: str, inner: torch.nn.Module | None, **attrs: object) -> None:
        super().__init__()
        setattr(self, attr, inner)
        for name, value in attrs.items():
            setattr(self, name, value)


def gpt():
    model = Model()
    return model, model, model.output_layer


def ddp():
    model = Model()
    return Nest("module", Nest("module", model)), model, model.output_layer


def llava():
    model = Model()
    return Nest("language_model", model, post_process=True), model, model.output_layer


def nemotron_vl():
    model = Model()
    outer = Nest("module", Nest("llava_model", Nest("language_model", model, post_process=True)))
    return outer, model, model.output_layer


def omni():
    model = Model()
    return Nest("thinker", Nest("language_model", model)), model, model.output_layer


SHAPES = [gpt, ddp, llava, nemotron_vl, omni]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.__name__)
@pytest.mark.parametrize("mode", [True, "fp32", "tf32", "fp32out", "fp32out-hilo", "fp32out-bf16grad"])
def test_finds_the_output_layer_in_each_nesting_and_gives_fp32_logits(shape, mode):
    chunk, _, layer = shape()
    assert apply_fp32_lm_head(chunk, mode) == [layer]
    assert fp32_lm_head_mode(layer) == ("fp32" if mode is True else mode)
    x = torch.randn(3, 2, 8).bfloat16()
    logits, _ = layer(x)
    assert logits.dtype == torch.float32
    ref = x.double() @ layer.weight.double().t()
    assert torch.allclose(logits.double(), ref, rtol=1e-6, atol=1e-6)


def test_non_last_pipeline_stages_are_skipped():
    first, middle, last = Model(post_process=False), Model(post_process=False), Model()
    assert apply_fp32_lm_head([first, middle, last], "fp32out") == [last.output_layer]


def test_a_non_last_stage_with_an_mtp_head_is_still_skipped():
    chunk = Model(post_process=False, head=True)
    assert apply_fp32_lm_head([chunk], "fp32out") == []
    assert fp32_lm_head_mode(chunk.output_layer) is None


def test_the_inner_model_decides_the_stage():
    # A VL wrapper may say post_process=True while its language model is an earlier stage.
    inner = Model(post_process=False)
    assert apply_fp32_lm_head(Nest("language_model", inner, post_process=True), "fp32") == []


def test_an_all_skipped_model_changes_nothing():
    assert apply_fp32_lm_head([Model(post_process=False)], "tf32") == []


@pytest.mark.parametrize(
    ("chunk", "named"),
    [
        (Model(head=False), "Model is the last pipeline stage"),
        (Nest("module", Model(head=False)), "Nest.module (Model)"),
        (Nest("language_model", None, post_process=True), "Nest is the last pipeline stage"),
        (torch.nn.Linear(2, 2), "Linear is the last pipeline stage"),
    ],
)
def test_a_last_stage_without_output_layer_raises_with_its_type(chunk, named):
    with pytest.raises(ValueError, match="no output_layer") as caught:
        apply_fp32_lm_head(chunk, "fp32out")
    assert named in str(caught.value)


def test_applying_twice_is_a_no_op():
    chunk, _, layer = ddp()
    first = apply_fp32_lm_head(chunk, "fp32out")
    impl = layer.__dict__["_forward_impl"]
    assert apply_fp32_lm_head(chunk, "fp32out") == first
    assert layer.__dict__["_forward_impl"] is impl


def test_true_and_fp32_are_the_same_mode():
    chunk, _, layer = gpt()
    apply_fp32_lm_head(chunk, True)
    assert apply_fp32_lm_head(chunk, "fp32") == [layer]


def test_switching_mode_is_refused_and_leaves_every_layer_as_it_was():
    done, _, done_layer = gpt()
    fresh, _, fresh_layer = gpt()
    apply_fp32_lm_head(done, "tf32")
    with pytest.raises(ValueError, match="already runs in mode 'tf32'.*'fp32out'"):
        apply_fp32_lm_head([fresh, done], "fp32out")
    assert fp32_lm_head_mode(done_layer) == "tf32"
    assert fp32_lm_head_mode(fresh_layer) is None  # checked everything before changing any


@pytest.mark.parametrize("off", [False, None])
def test_off_does_nothing(off):
    chunk, _, layer = gpt()
    assert apply_fp32_lm_head(chunk, off) == []
    assert "_forward_impl" not in layer.__dict__


@pytest.mark.parametrize("bad", ["false", "TF32", "fp16", 1, 0, "", "copy"])
def test_unknown_modes_list_the_valid_ones(bad):
    chunk, _, _ = gpt()
    with pytest.raises(ValueError, match=r'false, true, "fp32", "tf32", "fp32out"'):
        apply_fp32_lm_head(chunk, bad)


def test_a_head_that_is_not_a_column_parallel_linear_is_refused():
    chunk = Model(head=False)
    chunk.output_layer = torch.nn.Linear(8, 16)
    with pytest.raises(TypeError, match="torch.nn.modules.linear.Linear; only Megatron-Core"):
        apply_fp32_lm_head(chunk, "fp32")


def test_a_forward_impl_replaced_by_someone_else_is_not_stacked_on():
    chunk, _, layer = gpt()
    layer._forward_impl = lambda **kwargs: None
    with pytest.raises(TypeError, match="already replaced"):
        apply_fp32_lm_head(chunk, "fp32")


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        (lambda layer: setattr(layer.config, "defer_embedding_wgrad_compute", True), "defer"),
        (lambda layer: setattr(layer, "gtp_remat_size", 2), "GTP"),
    ],
)
def test_megatron_features_it_cannot_honour_are_refused_up_front(setup, match):
    chunk, _, layer = gpt()
    setup(layer)
    with pytest.raises(NotImplementedError, match=match):
        apply_fp32_lm_head(chunk, "fp32out")
    assert fp32_lm_head_mode(layer) is None


def test_an_unknown_forward_impl_argument_is_refused():
    chunk, _, layer = gpt()
    apply_fp32_lm_head(chunk, "fp32out")
    with pytest.raises(TypeError, match=r"\['fp8_recipe'\]"):
        layer._forward_impl(input=torch.ones(1, 8), weight=layer.weight, fp8_recipe="x")


def test_the_runtime_imports_without_torch_and_without_the_patcher():
    script = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any import of torch now fails
        import fp32patch.runtime.megatron_lm_head, fp32patch.runtime.config, fp32patch.runtime.nemo_rl
        assert not any(m.startswith("fp32patch.patcher") for m in sys.modules)
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
