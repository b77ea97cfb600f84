"""The nemotron-h-fp32-lm-head lifecycle on every vLLM release that has nemotron_h.py.

Each release's real ``nemotron_h.py`` and ``.dist-info`` come out of its PyPI wheel;
the import root holds them where pip would put them.
"""

from __future__ import annotations

import ast
import json

import pytest

from tests.conftest import NEMOTRON, sha
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

# every release from the first with NemotronH (0.9.1) to the newest (0.33.0)
RELEASES = """
0.9.1 0.9.2 0.10.0 0.10.1 0.10.1.1 0.10.2 0.11.0 0.11.1 0.11.2 0.12.0 0.13.0 0.14.0 0.14.1
0.15.0 0.15.1 0.16.0 0.17.0 0.17.1 0.18.0 0.18.1 0.19.0 0.19.1 0.20.0 0.20.1 0.20.2 0.21.0
0.22.0 0.22.1 0.23.0 0.24.0 0.25.0 0.25.1 0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0
0.32.0 0.33.0
""".split()


PATCH = "nemotron-h-fp32-lm-head"


def _status(out: dict) -> str:
    return next(p["status"] for p in out["patches"] if p["id"] == PATCH)


def _older(version: str) -> bool:
    return tuple(int(x) for x in version.split(".")[:2]) < (0, 11)


def _compute_logits(tree: ast.Module) -> ast.FunctionDef:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "NemotronHForCausalLM")
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "compute_logits")


@pytest.mark.parametrize("version", RELEASES)
def test_lifecycle(version, tmp_path, cli):
    root = import_root_from_members("vllm", version, [NEMOTRON], tmp_path / "site-packages")
    target = root / NEMOTRON
    original = target.read_bytes()

    code, out = cli.json("apply", "-s", root)
    assert code == 0, out
    [entry] = [p for p in out["patches"] if p["id"] == PATCH]
    # the other patch's target (NeMo-RL) is not in this root, and says so
    assert {p["status"] for p in out["patches"] if p["id"] != PATCH} == {"not-installed"}
    assert (entry["status"], entry["version"]) == ("applied", version)
    assert entry["variant"] == ("with-sampling-metadata" if _older(version) else "hidden-states-only")
    patched = target.read_bytes()
    assert patched != original

    # the route and the refit hook are where they must be, forwarding the right arguments
    func = _compute_logits(ast.parse(patched))
    call = ast.unparse(func.body[1])
    expected_args = "self, hidden_states, sampling_metadata" if _older(version) else "self, hidden_states"
    assert f"_fp32patch_runtime.compute_logits({expected_args})" in call
    assert ast.unparse(func.body[0]) == "_fp32patch_runtime = _fp32patch_lm_head_runtime()"
    assert "mark_dirty(self)" in patched.decode()

    code, out = cli.json("verify", "-s", root)
    assert code == 0 and out["ok"] and _status(out) == "applied"

    manifest = (root / ".fp32patch" / "manifest.json").read_bytes()
    code, out = cli.json("apply", "-s", root)
    assert code == 0 and _status(out) == "already-applied"
    assert target.read_bytes() == patched
    assert (root / ".fp32patch" / "manifest.json").read_bytes() == manifest

    shown = cli("diff", "-s", root)
    assert shown.exit_code == 0
    assert f"+++ b/{NEMOTRON}" in shown.stdout
    assert "+# fp32patch: nemotron-h-fp32-lm-head [route-compute-logits]" in shown.stdout.replace("        ", "")

    target.write_bytes(patched + b"# a hand edit after patching\n")
    code, out = cli.json("verify", "-s", root)
    assert code == 1 and not out["ok"] and _status(out) == "drifted"

    refused = cli("revert", "-s", root)
    assert refused.exit_code == 3
    assert target.read_bytes().endswith(b"# a hand edit after patching\n")

    forced = cli("revert", "-s", root, "--force")
    assert forced.exit_code == 0, forced.stdout + forced.stderr
    assert sha(target) == __import__("hashlib").sha256(original).hexdigest()
    kept = list((root / ".fp32patch" / "displaced").iterdir())
    assert [p.read_bytes() for p in kept] == [patched + b"# a hand edit after patching\n"]

    # and the plain round trip: apply, revert, byte-identical
    assert cli("apply", "-s", root).exit_code == 0
    assert cli("revert", "-s", root).exit_code == 0
    assert target.read_bytes() == original
    code, out = cli.json("verify", "-s", root)
    assert code == 1 and _status(out) == "not-applied"
    assert json.loads((root / ".fp32patch" / "manifest.json").read_text())["entries"] == []
