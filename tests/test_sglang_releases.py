"""The lifecycle of sglang-fp32-lm-head on every SGLang release from 0.5.2 to 0.5.23.

Each release's real ``logits_processor.py`` and ``.dist-info`` come out of its PyPI wheel (range
reads, cached under $FP32PATCH_TEST_CACHE) and lie where pip puts them. 0.5.3-0.5.17 (the flag's
head an fp32 upcast and GEMM): apply, verify and an exact revert on each, and on the first and last
of each variant and slime's pin the whole lifecycle (re-apply, diff, drift, forced revert); 0.5.18-0.5.23 (SGLang's own torch.mm with out_dtype): obsolete, nothing written;
0.5.2 (no flag): unsupported, nothing written.
"""

from __future__ import annotations

import ast
import hashlib

import pytest

from tests.conftest import sha
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network

SPEC = "sglang-fp32-lm-head"
MEMBER = "sglang/srt/layers/logits_processor.py"
# every release (slime's image pins 0.5.15.post1; the other .postN releases carry the same file shapes)
PATCHED = (
    "0.5.3 0.5.4 0.5.5 0.5.6 0.5.7 0.5.8 0.5.9 0.5.10 0.5.11 0.5.12 0.5.13 0.5.14 0.5.15 0.5.15.post1 0.5.16 0.5.17"
)
# the whole lifecycle on the first and last release of each variant and on slime's pin; apply, verify and
# an exact revert on the others (each lifecycle parses the file ten times: the main suite's time)
LIFECYCLE = ("0.5.3", "0.5.8", "0.5.9", "0.5.15.post1", "0.5.17")
OBSOLETE = "0.5.18 0.5.19 0.5.20 0.5.21 0.5.22 0.5.23"
STOCK = "torch.matmul(hidden_states.to(torch.float32), lm_head.weight.to(torch.float32).T)"
OURS = "_fp32patch_sglang_fp32_logits(hidden_states, lm_head.weight)"


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".")[:3])


def _method(tree: ast.Module, name: str) -> ast.FunctionDef:
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LogitsProcessor")
    return next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)


class _Unpatch(ast.NodeTransformer):
    """The patched tree with the gate's def dropped and our call put back as SGLang's expression."""

    def visit_Module(self, node: ast.Module) -> ast.Module:
        node.body = [s for s in node.body if not (isinstance(s, ast.FunctionDef) and s.name.startswith("_fp32patch_"))]
        return self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> ast.AST:
        if ast.unparse(node) == OURS:
            return ast.parse(STOCK, mode="eval").body
        return self.generic_visit(node)


def _root(version: str, tmp_path):
    return import_root_from_members("sglang", version, [MEMBER], tmp_path / "site-packages")


def _status(out: dict) -> str:
    return next(p["status"] for p in out["patches"] if p["id"] == SPEC)


@pytest.mark.parametrize("version", PATCHED.split())
def test_lifecycle(version, tmp_path, cli):
    root = _root(version, tmp_path)
    target = root / MEMBER
    original = target.read_bytes()
    scope = "_compute_lm_head" if _release(version) >= (0, 5, 9) else "_get_logits"
    assert STOCK in ast.unparse(_method(ast.parse(original), scope))

    code, out = cli.json("apply", "-s", root)
    assert code == 0, out
    [entry] = [p for p in out["patches"] if p["id"] == SPEC]
    assert (entry["status"], entry["version"]) == ("applied", version)
    assert entry["variant"] == ("compute-lm-head" if scope == "_compute_lm_head" else "get-logits")
    patched = target.read_bytes()

    # the flag's GEMM is ours, once, in the flag's branch; nothing else changed
    tree = ast.parse(patched)
    method = ast.unparse(_method(tree, scope))
    assert method.count(OURS) == 1 and STOCK not in method
    branch = next(
        n
        for n in ast.walk(_method(tree, scope))
        if isinstance(n, ast.If) and ast.unparse(n.test) == "self.use_fp32_lm_head"
    )
    assert OURS in ast.unparse(branch.body[0])
    assert ast.dump(_Unpatch().visit(ast.parse(patched))) == ast.dump(ast.parse(original))
    # the helper imports fp32patch only when called, and falls back to SGLang's own upcast
    helper = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_fp32patch_sglang_fp32_logits")
    assert "from fp32patch.runtime.heads.sglang import fp32_logits" in ast.unparse(helper)
    assert "torch.matmul(hidden_states.to(torch.float32), weight.to(torch.float32).T)" in ast.unparse(helper)

    code, out = cli.json("verify", "-s", root)
    assert code == 0 and out["ok"] and _status(out) == "applied"
    if version not in LIFECYCLE:
        assert cli("revert", "-s", root).exit_code == 0
        assert target.read_bytes() == original
        return

    manifest = (root / ".fp32patch" / "manifest.json").read_bytes()
    code, out = cli.json("apply", "-s", root)
    assert code == 0 and _status(out) == "already-applied"
    assert target.read_bytes() == patched
    assert (root / ".fp32patch" / "manifest.json").read_bytes() == manifest

    shown = cli("diff", "-s", root)
    assert shown.exit_code == 0 and f"+++ b/{MEMBER}" in shown.stdout
    assert f"# fp32patch: {SPEC} [fp32out-head]" in shown.stdout

    target.write_bytes(patched + b"# a hand edit after patching\n")
    code, out = cli.json("verify", "-s", root)
    assert code == 1 and not out["ok"] and _status(out) == "drifted"
    assert cli("revert", "-s", root).exit_code == 3
    assert target.read_bytes().endswith(b"# a hand edit after patching\n")
    forced = cli("revert", "-s", root, "--force")
    assert forced.exit_code == 0, forced.stdout + forced.stderr
    assert sha(target) == hashlib.sha256(original).hexdigest()

    assert cli("apply", "-s", root).exit_code == 0
    assert cli("revert", "-s", root).exit_code == 0
    assert target.read_bytes() == original
    code, out = cli.json("verify", "-s", root)
    assert code == 1 and _status(out) == "not-applied"


@pytest.mark.parametrize("version", OBSOLETE.split())
def test_sglangs_own_fp32out_head_is_obsolete(version, tmp_path, cli):
    root = _root(version, tmp_path)
    target = root / MEMBER
    original = target.read_bytes()
    assert "out_dtype=torch.float32" in ast.unparse(_method(ast.parse(original), "_compute_lm_head"))
    code, out = cli.json("apply", "-s", root)
    assert code == 0, out
    [entry] = [p for p in out["patches"] if p["id"] == SPEC]
    assert (entry["status"], entry["version"]) == ("obsolete", version)
    assert "torch.mm(..., out_dtype=torch.float32) itself" in entry["message"]
    assert target.read_bytes() == original and not (root / ".fp32patch" / "manifest.json").exists()
    code, out = cli.json("verify", "-s", root)
    assert _status(out) == "obsolete"


def test_a_release_without_the_flag_is_refused(tmp_path, cli):
    root = _root("0.5.2", tmp_path)
    original = (root / MEMBER).read_bytes()
    assert b"use_fp32_lm_head" not in original
    code, out = cli.json("apply", "-s", root)
    assert code == 3 and _status(out) == "unsupported-version"
    assert "sglang >=0.5.3" in out["patches"][0]["message"]
    assert (root / MEMBER).read_bytes() == original


def test_an_edited_head_gemm_is_refused_naming_the_anchor(tmp_path, cli):
    """A release whose flag branch computes something else: anchor-missing, nothing written."""
    root = _root("0.5.15.post1", tmp_path)
    target = root / MEMBER
    text = target.read_text()
    edited = text.replace("lm_head.weight.to(torch.float32).T", "lm_head.weight.float().T", 1)
    assert edited != text
    target.write_text(edited)
    code, out = cli.json("apply", "-s", root)
    assert code == 3 and _status(out) == "anchor-missing", out
    assert "fp32out-head" in out["patches"][0]["message"] and "_compute_lm_head" in out["patches"][0]["message"]
    assert target.read_text() == edited
