"""The install route (issue 30): the wheel into a bare environment pulls no torch and works;
``make install`` takes torch's CPU build, and an index it cannot reach costs seconds, not minutes."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest

from tests.conftest import LOGITS_PROCESSOR, NEMOTRON
from tests.support.pypi import import_root_from_members

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "cpu_torch.py"


@pytest.mark.network
def test_the_wheel_in_a_bare_venv_pulls_no_torch_and_patches(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(REPO)], check=True
    )
    [wheel] = (tmp_path / "dist").glob("fp32patch-*-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    assert "fp32patch/patches/vllm-fp32-logits.toml" in names and "fp32patch/patches/snippets/vllm_gate.py" in names
    assert not any(n.startswith("tests/") for n in names)

    venv = tmp_path / "venv"
    bare = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # nothing of this checkout
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=bare)
    py = venv / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", str(wheel)], check=True, env=bare)
    listed = subprocess.run(
        [py, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True, env=bare
    )
    names = {line.split("==")[0].lower() for line in listed.stdout.splitlines()}
    assert "fp32patch" in names and "libcst" in names
    assert "torch" not in names and not any(n.startswith("nvidia") for n in names), names

    root = import_root_from_members("vllm", "0.25.1", [NEMOTRON, LOGITS_PROCESSOR], tmp_path / "sp")
    original = (root / NEMOTRON).read_bytes()
    exe = str(venv / "bin" / "fp32patch")
    for command in ("apply", "verify", "revert"):
        result = subprocess.run([exe, command, "-s", str(root)], capture_output=True, text=True, cwd=tmp_path, env=bare)
        assert result.returncode == 0, (command, result.stdout, result.stderr)
    assert (root / NEMOTRON).read_bytes() == original


def _tool(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)
    return result, time.monotonic() - started


@pytest.mark.parametrize("index", ["http://192.0.2.1/whl/cpu", "http://127.0.0.1:9/whl/cpu"])
def test_an_unreachable_cpu_index_is_left_out_at_once(index):
    """TEST-NET-1 never answers and port 9 refuses: either way the index is dropped after one short
    probe (not pip's retries at a 180 s timeout), and the line says so."""
    result, seconds = _tool("torch==2.13.0", "--index", index, "--dry-run")
    assert result.returncode == 0
    first, command = result.stdout.splitlines()[:2]
    assert f"{index} did not answer" in first and "left out" in first
    assert "--extra-index-url" not in command and "torch==2.13.0" in command
    assert seconds < 60  # one probe of at most 5 s, not minutes


def test_a_reachable_cpu_index_is_used_and_named(tmp_path):
    (tmp_path / "whl" / "cpu").mkdir(parents=True)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        index = f"http://127.0.0.1:{server.server_address[1]}/whl/cpu/"
        result, _ = _tool("torch==2.13.0", "--index", index, "--dry-run")
    finally:
        server.shutdown()
    assert result.returncode == 0
    first, command = result.stdout.splitlines()[:2]
    assert f"CPU build, from {index}" in first
    assert command.endswith(f"install -q torch==2.13.0 --extra-index-url {index}")


def test_the_makefile_installs_torch_through_the_tool():
    makefile = (REPO / "Makefile").read_text()
    install = makefile[makefile.index("$(VENV)/.installed:") :].split("\n\n")[0]
    assert "tools/cpu_torch.py '$(TORCH)' --index '$(TORCH_INDEX)'" in install
    assert "pip install -q torch" not in install
    assert shutil.which("make") is None or "dist:" in makefile
