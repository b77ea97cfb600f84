"""Server mode, as far as the CPU allows: TRL's weight transfer to a server is NCCL's, which needs
CUDA, so no GRPO step runs here; the server, its probe and the trainer's startup check do.

- ``trl vllm-serve --fp32_lm_head true`` (the patched TRL's command line, vLLM's own server from
  the patched root): every worker answers fp32patch's probe through ``/collective_rpc`` with
  float32 logits; a GRPO trainer with the switch on passes its startup probe of that server and
  stops only where TRL's client needs CUDA for NCCL.
- ``VLLM_SERVER_DEV_MODE=1 vllm serve``, started directly as TRL's notice suggests, without the
  flag's switch and worker extension (bf16 logits, no probe method): the trainer with the
  switch on refuses it at startup, saying how to start one that can answer.
"""

from __future__ import annotations

import pytest

from fp32patch.runtime.kit.probe import PROBE_EXTENSION, server_reports
from tests.heavy.trl.conftest import result, server, train

pytestmark = pytest.mark.xdist_group("server")

NCCL_ON_CPU = (
    "NotImplementedError: Weight synchronization runs on vLLM's NCCL weight-transfer engine, which needs a CUDA device"
)


def _serve_flags(model_dir) -> list[str]:
    return [str(model_dir), "--host", "127.0.0.1", "--max-model-len", "96", "--enforce-eager"]


@pytest.fixture(scope="module")
def fp32_server(model_dir, plugin_dir, vllm_name, tmp_path_factory):
    log = tmp_path_factory.mktemp("fp32-server") / "server.log"
    args = ["trl.cli.main", "vllm-serve", "--model", str(model_dir), "--host", "127.0.0.1", "--max_model_len", "96",
            "--enforce_eager", "true", "--fp32_lm_head", "true"]  # fmt: skip
    with server(args, plugin_dir, vllm_name, log) as url:
        yield url, log


@pytest.fixture(scope="module")
def plain_server(model_dir, plugin_dir, vllm_name, tmp_path_factory):
    log = tmp_path_factory.mktemp("plain-server") / "server.log"
    args = ["vllm.entrypoints.cli.main", "serve", *_serve_flags(model_dir)]
    with server(args, plugin_dir, vllm_name, log, VLLM_SERVER_DEV_MODE="1") as url:
        yield url


def test_trl_vllm_serve_passes_the_switch_and_the_probe(fp32_server):
    import requests

    url, log = fp32_server
    (report,) = server_reports(requests.post, url, where="test", how_to_start="")
    assert (report["dtype"], report["env"], report["patched"]) == ("float32", "1", True)
    said = log.read_text(errors="replace")
    assert f"--worker-extension-cls {PROBE_EXTENSION}" in said
    assert "fp32patch (trl vllm-serve): --fp32_lm_head fp32: fp32 logits in every vLLM worker" in said


def test_the_trainer_probes_the_server_at_startup(fp32_server, model_dir, plugin_dir, tmp_path):
    url, _ = fp32_server
    run = result(
        train(tmp_path, plugin_dir, model=str(model_dir), fp32_lm_head="fp32out", vllm_mode="server", server_url=url),
        ok=False,
    )
    assert run["error"].startswith(NCCL_ON_CPU), run["error"]
    assert run["fp32patch_lines"][-1] == (
        "INFO fp32patch (vLLM server): 1 vLLM worker(s) compute float32 logits (way: copy), as fp32_lm_head='fp32out' asks"
    )


def test_a_server_started_with_vllm_serve_directly_is_refused(plain_server, model_dir, plugin_dir, tmp_path):
    run = result(
        train(
            tmp_path,
            plugin_dir,
            model=str(model_dir),
            fp32_lm_head="fp32out",
            vllm_mode="server",
            server_url=plain_server,
        ),
        ok=False,
    )
    error = run["error"]
    assert error.startswith(
        f"Fp32LmHeadMismatchError: fp32patch (vLLM server): cannot probe the vLLM server's LM heads at {plain_server}/collective_rpc: "
        "it answered 500: "
    ), error
    assert "object has no attribute 'fp32patch_probe_lm_head'" in error
    assert "`trl vllm-serve --model ... --fp32_lm_head true`" in error
