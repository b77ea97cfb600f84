"""A patch that cannot be applied: exit 3, a message a user can act on, no byte changed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import NEMOTRON, tree_digest
from tests.support.pypi import import_root_from_members

pytestmark = pytest.mark.network


def _root(tmp_path: Path, version: str = "0.33.0") -> Path:
    return import_root_from_members("vllm", version, [NEMOTRON], tmp_path / "site-packages")


def _set_version(root: Path, old: str, new: str) -> None:
    """Relabel a root's release (its dist-info), as a vendor rebuild would."""
    info = root / f"vllm-{old}.dist-info"
    meta = info / "METADATA"
    meta.write_text(meta.read_text().replace(f"Version: {old}", f"Version: {new}"))
    info.rename(root / f"vllm-{new}.dist-info")


def _edit(root: Path, old: str, new: str, count: int = 1) -> None:
    target = root / NEMOTRON
    text = target.read_text()
    assert text.count(old) >= count, old
    target.write_text(text.replace(old, new, count))


def _duplicate_class(root: Path) -> None:
    target = root / NEMOTRON
    text = target.read_text()
    second = "class NemotronHForCausalLM" + text.split("\nclass NemotronHForCausalLM", 1)[1]
    target.write_text(text + "\n\n" + second)


CASES = {
    # the method the route anchors on is gone
    "anchor-missing": (
        lambda r: _edit(r, "def compute_logits(", "def compute_logits_v2("),
        "route-compute-logits",
        "NemotronHForCausalLM.compute_logits",
    ),
    # the class is defined twice (e.g. a vendor fork pasted a second copy)
    "anchor-ambiguous": (lambda r: _duplicate_class(r), "route-compute-logits", "NemotronHForCausalLM.compute_logits"),
    # a new release changed the signature
    "signature": (
        lambda r: _edit(
            r,
            "        hidden_states: torch.Tensor,\n    ) -> torch.Tensor | None:",
            "        hidden_states: torch.Tensor,\n        spec_step_idx: int = 0,\n    ) -> torch.Tensor | None:",
        ),
        "route-compute-logits",
        "params (self, hidden_states)",
    ),
    "load-weights-missing": (
        lambda r: _edit(r, "def load_weights(self, weights", "def load_checkpoint(self, weights"),
        "refit-notify",
        "NemotronHForCausalLM.load_weights",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_with_a_useful_message_and_nothing_written(case, tmp_path, cli):
    mutate, edit, anchor = CASES[case]
    root = _root(tmp_path)
    mutate(root)
    before = tree_digest(root)

    result = cli("apply", "-s", root)
    assert result.exit_code == 3, result.stdout + result.stderr
    message = " ".join(result.stderr.split())
    for needle in ("nemotron-h-fp32-lm-head", NEMOTRON, "vllm 0.33.0", f"edit {edit}", anchor, "nothing was written"):
        assert needle in message, (needle, message)
    assert re.search(r"matched \d+ times?, expected 1", message)
    assert tree_digest(root) == before  # not a byte, not even a state folder

    code, out = cli.json("apply", "-s", root)
    assert code == 3 and not out["ok"]
    assert out["patches"][0]["status"] in ("anchor-missing", "anchor-ambiguous")
    assert tree_digest(root) == before


def test_ambiguous_is_told_apart_from_missing(tmp_path, cli):
    root = _root(tmp_path)
    CASES["anchor-ambiguous"][0](root)
    code, out = cli.json("apply", "-s", root)
    assert out["patches"][0]["status"] == "anchor-ambiguous"
    assert "matched 2 times, expected 1" in out["patches"][0]["message"]


def test_old_shape_under_a_new_version_names_what_it_found(tmp_path, cli):
    root = _root(tmp_path, "0.10.2")
    _set_version(root, "0.10.2", "0.34.0")
    code, out = cli.json("apply", "-s", root)
    assert code == 3
    message = out["patches"][0]["message"]
    assert "vllm 0.34.0" in message
    assert "found instead: NemotronHForCausalLM.compute_logits(self, hidden_states, sampling_metadata)" in message


def test_unsupported_version(tmp_path, cli):
    root = _root(tmp_path, "0.9.1")
    _set_version(root, "0.9.1", "0.8.5")
    before = tree_digest(root)
    code, out = cli.json("apply", "-s", root)
    assert code == 3 and out["patches"][0]["status"] == "unsupported-version"
    assert ">=0.9.1" in out["patches"][0]["message"]
    assert tree_digest(root) == before
    code, out = cli.json("verify", "-s", root)
    assert code == 1 and out["patches"][0]["status"] == "unsupported-version"


def test_release_without_nemotron_h(tmp_path, cli):
    """vLLM 0.9.0 predates NemotronH: nothing to patch is bad input (exit 2), not a pass."""
    root = import_root_from_members("vllm", "0.9.0", [NEMOTRON], tmp_path / "sp")
    assert not (root / NEMOTRON).exists()
    code, out = cli.json("apply", "-s", root)
    assert code == 2 and out["patches"][0]["status"] == "not-installed"
    code, out = cli.json("verify", "-s", root)
    assert code == 1


def test_unparseable_target(tmp_path, cli):
    root = _root(tmp_path)
    _edit(root, "class NemotronHForCausalLM(", "class NemotronHForCausalLM((")
    before = tree_digest(root)
    code, out = cli.json("apply", "-s", root)
    assert code == 3 and out["patches"][0]["status"] == "unparseable"
    assert tree_digest(root) == before


def test_bad_usage_exits_2(tmp_path, cli):
    root = _root(tmp_path)
    result = cli("apply", "-s", root, "--patch", "no-such-patch")
    assert result.exit_code == 2 and "unknown patch id 'no-such-patch'" in result.stderr
    result = cli("verify", "-s", tmp_path / "missing")
    assert result.exit_code == 2 and "does not exist" in result.stderr
    result = cli("apply", "--frobnicate")
    assert result.exit_code == 2


def test_json_shape(tmp_path, cli):
    root = _root(tmp_path)
    code, out = cli.json("status", "-s", root)
    assert code == 0
    assert set(out) >= {"ok", "patches"} and isinstance(out["ok"], bool)
    entry = out["patches"][0]
    assert {"id", "status", "target", "version", "path"} <= set(entry)
    assert entry["target"] == f"vllm:{NEMOTRON}" and entry["path"] == str(root / NEMOTRON)
    json.dumps(out)


def test_upstream_reading_the_variable_is_obsolete_but_a_comment_is_not(tmp_path, cli):
    root = _root(tmp_path)
    _edit(
        root,
        "        logits = self.logits_processor(self.lm_head, hidden_states)\n",
        "        # NRL_VLLM_FP32_LM_HEAD is handled by fp32patch\n"
        "        logits = self.logits_processor(self.lm_head, hidden_states)\n",
    )
    code, out = cli.json("apply", "-s", root, "--dry-run")
    assert code == 0 and out["patches"][0]["status"] == "would-apply"
    _edit(
        root,
        "        # NRL_VLLM_FP32_LM_HEAD is handled by fp32patch\n",
        '        if os.environ.get("NRL_VLLM_FP32_LM_HEAD"):\n            hidden_states = hidden_states.float()\n',
    )
    code, out = cli.json("apply", "-s", root)
    assert code == 0 and out["patches"][0]["status"] == "obsolete"
