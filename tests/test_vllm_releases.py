"""The lifecycle of both vLLM patches on every release from 0.9.1 to 0.34.0.

Each release's real target file (``nemotron_h.py`` or ``logits_processor.py``) and
``.dist-info`` come out of its PyPI wheel; the import root holds them where pip would put
them: apply, verify, re-apply, diff, drift, revert (forced and plain), byte-exact.
"""

from __future__ import annotations

import ast
import hashlib
import json

import pytest

from tests.conftest import LOGITS_PROCESSOR, NEMOTRON, sha
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

# every release from the first with NemotronH (0.9.1) to the newest (0.34.0)
RELEASES = """
0.9.1 0.9.2 0.10.0 0.10.1 0.10.1.1 0.10.2 0.11.0 0.11.1 0.11.2 0.12.0 0.13.0 0.14.0 0.14.1
0.15.0 0.15.1 0.16.0 0.17.0 0.17.1 0.18.0 0.18.1 0.19.0 0.19.1 0.20.0 0.20.1 0.20.2 0.21.0
0.22.0 0.22.1 0.23.0 0.24.0 0.25.0 0.25.1 0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0
0.32.0 0.33.0 0.34.0
""".split()

GEMM = "logits = lm_head.quant_method.apply(lm_head, hidden_states, bias=embedding_bias)"


def _release(version: str) -> tuple[int, int]:
    return tuple(int(x) for x in version.split(".")[:2])  # type: ignore[return-value]


def _method(tree: ast.Module, cls_name: str, name: str) -> ast.FunctionDef:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


def _ours(node: ast.AST) -> bool:
    """A statement the patches insert: the gate, or a use of the runtime it returns."""
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name.startswith("_fp32patch_")
    head = node.test if isinstance(node, ast.If) else node  # an `if` is ours when its test is
    return any(isinstance(n, ast.Name) and n.id.startswith("_fp32patch_") for n in ast.walk(head))


def _without_ours(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        for name in ("body", "orelse"):
            stmts = getattr(node, name, None)
            if isinstance(stmts, list):
                setattr(node, name, [s for s in stmts if not _ours(s)])
    return tree


def _check_nemotron(version: str, patched: bytes) -> str:
    older = _release(version) < (0, 11)
    func = _method(ast.parse(patched), "NemotronHForCausalLM", "compute_logits")
    expected_args = "self, hidden_states, sampling_metadata" if older else "self, hidden_states"
    assert f"_fp32patch_runtime.compute_logits({expected_args})" in ast.unparse(func.body[1])
    assert ast.unparse(func.body[0]) == "_fp32patch_runtime = _fp32patch_lm_head_runtime()"
    assert "mark_dirty(self)" in patched.decode()
    return "with-sampling-metadata" if older else "hidden-states-only"


def _check_logits(version: str, patched: bytes) -> str:
    tree = ast.parse(patched)
    lines = lambda func: [ast.unparse(s) for s in func.body]  # noqa: E731
    gate = "_fp32patch_runtime = _fp32patch_lm_head_runtime()"
    if _release(version) < (0, 26):
        # the head is swapped just before vLLM's own GEMM, which stays where it was, once
        body = lines(_method(tree, "LogitsProcessor", "_get_logits"))
        at = body.index(GEMM)
        assert body[at - 2] == gate
        assert body[at - 1].endswith("lm_head = _fp32patch_runtime.fp32_head(self, lm_head, hidden_states)")
        assert sum(GEMM in line for line in body) == 1
        forward = ast.unparse(_method(tree, "LogitsProcessor", "forward"))
        assert "_fp32patch_runtime.note_processor(self, lm_head, hidden_states)" in forward
        if _release(version) >= (0, 17):  # the drafters' argmax keeps its own bf16 GEMM
            assert "_fp32patch" not in ast.unparse(_method(tree, "LogitsProcessor", "get_top_tokens"))
        return "head-gemm"
    init = lines(_method(tree, "LogitsProcessor", "__init__"))
    assert init[-3:-1] == ["self.head_dtype = model_config.head_dtype if model_config is not None else None", gate]
    assert init[-1].endswith("self.head_dtype = _fp32patch_runtime.native_head_dtype(self, model_config)")
    apply_head = lines(_method(tree, "LogitsProcessor", "_apply_head"))
    assert apply_head[1] == gate and "_fp32patch_runtime.apply_head(" in apply_head[2]
    assert apply_head[3].startswith("if self.head_dtype is None or self.head_dtype == hidden_states.dtype:")
    return "native-head-dtype"


PATCHES = {
    "nemotron-h-fp32-lm-head": (NEMOTRON, _check_nemotron),
    "vllm-fp32-logits": (LOGITS_PROCESSOR, _check_logits),
}


@pytest.mark.parametrize("version", RELEASES)
@pytest.mark.parametrize("patch", sorted(PATCHES))
def test_lifecycle(patch, version, tmp_path, cli):
    member, check = PATCHES[patch]

    def status(out: dict) -> str:
        return next(p["status"] for p in out["patches"] if p["id"] == patch)

    root = import_root_from_members("vllm", version, [member], tmp_path / "site-packages")
    target = root / member
    original = target.read_bytes()

    code, out = cli.json("apply", "-s", root)
    assert code == 0, out
    [entry] = [p for p in out["patches"] if p["id"] == patch]
    # the other patches' targets are not in this root, and say so
    assert {p["status"] for p in out["patches"] if p["id"] != patch} == {"not-installed"}
    assert (entry["status"], entry["version"]) == ("applied", version)
    patched = target.read_bytes()
    assert patched != original

    # the routes are where they must be, and every original statement is still there, unchanged
    assert entry["variant"] == check(version, patched)
    assert ast.dump(_without_ours(ast.parse(patched))) == ast.dump(ast.parse(original))

    code, out = cli.json("verify", "-s", root)
    assert code == 0 and out["ok"] and status(out) == "applied"

    manifest = (root / ".fp32patch" / "manifest.json").read_bytes()
    code, out = cli.json("apply", "-s", root)
    assert code == 0 and status(out) == "already-applied"
    assert target.read_bytes() == patched
    assert (root / ".fp32patch" / "manifest.json").read_bytes() == manifest

    shown = cli("diff", "-s", root)
    assert shown.exit_code == 0
    assert f"+++ b/{member}" in shown.stdout
    edits = {"nemotron-h-fp32-lm-head": "route-compute-logits", "vllm-fp32-logits": "route-head"}
    assert f"+# fp32patch: {patch} [{edits[patch]}]" in shown.stdout.replace("        ", "")

    target.write_bytes(patched + b"# a hand edit after patching\n")
    code, out = cli.json("verify", "-s", root)
    assert code == 1 and not out["ok"] and status(out) == "drifted"

    refused = cli("revert", "-s", root)
    assert refused.exit_code == 3
    assert target.read_bytes().endswith(b"# a hand edit after patching\n")

    forced = cli("revert", "-s", root, "--force")
    assert forced.exit_code == 0, forced.stdout + forced.stderr
    assert sha(target) == hashlib.sha256(original).hexdigest()
    kept = list((root / ".fp32patch" / "displaced").iterdir())
    assert [p.read_bytes() for p in kept] == [patched + b"# a hand edit after patching\n"]

    # and the plain round trip: apply, revert, byte-identical
    assert cli("apply", "-s", root).exit_code == 0
    assert cli("revert", "-s", root).exit_code == 0
    assert target.read_bytes() == original
    code, out = cli.json("verify", "-s", root)
    assert code == 1 and status(out) == "not-applied"
    assert json.loads((root / ".fp32patch" / "manifest.json").read_text())["entries"] == []


@pytest.mark.parametrize("version", ["0.25.1", "0.33.0"])
def test_both_vllm_patches_in_one_root(version, tmp_path, cli):
    """An image holds both files: both patches apply, verify and revert together."""
    root = import_root_from_members("vllm", version, [NEMOTRON, LOGITS_PROCESSOR], tmp_path / "site-packages")
    originals = {m: (root / m).read_bytes() for m in (NEMOTRON, LOGITS_PROCESSOR)}
    code, out = cli.json("apply", "-s", root)
    assert code == 0, out
    statuses = {p["id"]: p["status"] for p in out["patches"]}
    assert statuses["nemotron-h-fp32-lm-head"] == statuses["vllm-fp32-logits"] == "applied"
    code, out = cli.json("verify", "-s", root)
    assert code == 0 and out["ok"]
    assert cli("revert", "-s", root).exit_code == 0
    assert {m: (root / m).read_bytes() for m in originals} == originals


@pytest.mark.parametrize("version", ["0.25.1", "0.33.0"])
def test_a_logits_processor_reading_the_variable_itself_is_obsolete(version, tmp_path, cli):
    root = import_root_from_members("vllm", version, [LOGITS_PROCESSOR], tmp_path / "site-packages")
    target = root / LOGITS_PROCESSOR
    text = target.read_text()
    anchor = "        self.use_all_gather = current_platform.use_all_gather()\n"
    assert text.count(anchor) == 1

    def status() -> str:
        code, out = cli.json("apply", "-s", root, "--dry-run")
        assert code == 0, out
        return next(p["status"] for p in out["patches"] if p["id"] == "vllm-fp32-logits")

    target.write_text(text.replace(anchor, anchor + "        # NRL_VLLM_FP32_LM_HEAD is read by fp32patch\n"))
    assert status() == "would-apply"  # a comment is no fix
    fix = '        self.fp32 = __import__("os").environ.get("NRL_VLLM_FP32_LM_HEAD")\n'
    target.write_text(text.replace(anchor, anchor + fix))
    assert status() == "obsolete"
