"""The nemo-rl-context-length-400 spec through the CLI, on import roots built in tmp_path.

Every fixture under tests/fixtures/nemo_rl is ours, written in the shapes of NeMo-RL's
vllm_worker_async.py: before the fix, formatted by hand, and (as edits to the pre-fix file,
upstream_fixes.py) after each of the two upstream fixes and partly fixed. What the route then does under FastAPI is
test_context_length_contract.py's business; here: what lands on disk, the statuses and
the exit codes.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path

import pytest

from tests.nemo_rl_harness import PATCH_ID, TARGET, cli, fixture, site_packages, snapshot, source_checkout

CLAMP_MARKER = f"# fp32patch: {PATCH_ID} [clamp-message]"
ROUTE_MARKER = f"# fp32patch: {PATCH_ID} [route-overflow-400]"


def _run(command: str, root) -> tuple[int, dict]:
    """``fp32patch <command> -s root --patch <this patch>``: exit code, the patch's outcome."""
    code, data = cli(command, "-s", str(root), "--patch", PATCH_ID)
    (outcome,) = data["patches"]
    return code, outcome


@pytest.mark.parametrize(
    ("folder", "name"),
    [("nemo_rl", "nemo-rl"), ("nemo_rl", "nemo_rl")],
    ids=["dist-info-name-dashed", "dist-info-name-underscored"],
)
def test_apply_verify_revert_in_site_packages(tmp_path, folder, name):
    original = fixture("pre_fix.py")
    target = site_packages(tmp_path, original, folder=folder, name=name)

    code, out = _run("apply", tmp_path)
    assert code == 0, out
    assert out["status"] == "applied"
    assert out["version"] == "0.7.0"
    assert sorted(out["edits"]) == ["clamp-message", "route-overflow-400"]
    patched = target.read_text()
    assert CLAMP_MARKER in patched and ROUTE_MARKER in patched
    assert "maximum context length" in patched

    code, out = _run("verify", tmp_path)
    assert (code, out["status"]) == (0, "applied")

    code, out = _run("apply", tmp_path)  # a second apply is a no-op, not an error
    assert (code, out["status"]) == (0, "already-applied")
    assert target.read_text() == patched

    code, out = _run("revert", tmp_path)
    assert (code, out["status"]) == (0, "reverted")
    assert target.read_bytes() == original

    code, out = _run("verify", tmp_path)
    assert (code, out["status"]) == (1, "not-applied")


def test_apply_in_a_source_checkout(tmp_path):
    # `-s` at the checkout root; NeMo-RL's version is dynamic, so it reads as unknown
    original = fixture("pre_fix.py")
    target = source_checkout(tmp_path, original)

    code, out = _run("apply", tmp_path)
    assert code == 0, out
    assert out["status"] == "applied"
    assert out["path"] == str(target)
    assert out["version"] is None
    assert ROUTE_MARKER in target.read_text()

    code, out = _run("verify", tmp_path)
    assert (code, out["status"]) == (0, "applied")
    code, _ = _run("revert", tmp_path)
    assert code == 0 and target.read_bytes() == original


def _changed_lines(before: bytes, after: bytes) -> tuple[list[str], list[str]]:
    removed, added = [], []
    for line in difflib.unified_diff(before.decode().splitlines(), after.decode().splitlines(), lineterm="", n=0):
        if line.startswith("-") and not line.startswith("---"):
            removed.append(line[1:])
        elif line.startswith("+") and not line.startswith("+++"):
            added.append(line[1:])
    return removed, added


def test_hand_formatted_file_gets_the_same_edits_and_nothing_else(tmp_path):
    original = fixture("reformatted.py")
    target = site_packages(tmp_path, original)

    code, out = _run("apply", tmp_path)
    assert code == 0, out
    assert sorted(out["edits"]) == ["clamp-message", "route-overflow-400"]
    removed, added = _changed_lines(original, target.read_bytes())
    # only the clamp's two-line %-formatted raise goes; every other line stays as written
    assert [line.strip() for line in removed] == [
        "raise ValueError('prompt of %d tokens, max_model_len %d: no room for output'",
        "% (len(prompt_token_ids), self.model_config.max_model_len))",
    ]
    assert CLAMP_MARKER in "\n".join(added) and ROUTE_MARKER in "\n".join(added)
    # the handler lands in the route's try, after the single-line `try:` and its handler
    patched = target.read_text()
    assert patched.index("except (VLLMValidationError) as err:") < patched.index("except ValueError as e:")
    assert patched.index("except ValueError as e:") < patched.index("if isinstance(generator, ErrorResponse)")


def test_upstream_route_fix_is_obsolete(tmp_path):
    original = fixture("upstream_fix_route.py")
    target = site_packages(tmp_path, original)

    code, out = _run("apply", tmp_path)
    assert (code, out["status"]) == (0, "obsolete"), out
    assert "the route answers a ValueError overflow" in out["message"]
    assert target.read_bytes() == original

    code, out = _run("verify", tmp_path)
    assert (code, out["status"]) == (0, "obsolete")


def test_upstream_clamp_fix_keeps_its_clamp_and_gets_the_route(tmp_path):
    # the first upstream fix answers its own clamp's overflow, but the route still turns
    # vLLM's serving-layer ValueError into a 500: only the route edit is missing
    original = fixture("upstream_fix_clamp.py")
    target = site_packages(tmp_path, original)

    code, out = _run("apply", tmp_path)
    assert (code, out["status"]) == (0, "applied"), out
    assert (out["edits"], out["skipped"]) == (["route-overflow-400"], ["clamp-message"])
    patched = target.read_text()
    assert ROUTE_MARKER in patched and CLAMP_MARKER not in patched
    removed, _ = _changed_lines(original, target.read_bytes())
    assert removed == []  # upstream's clamp is untouched: the handler is only added

    code, out = _run("apply", tmp_path)
    assert (code, out["status"]) == (0, "already-applied")
    code, out = _run("verify", tmp_path)
    assert (code, out["status"]) == (0, "applied")
    code, _ = _run("revert", tmp_path)
    assert code == 0 and target.read_bytes() == original


def test_partly_fixed_file_keeps_upstream_route_and_gets_the_clamp(tmp_path):
    original = fixture("partial_route_fixed.py")
    target = site_packages(tmp_path, original)

    code, out = _run("apply", tmp_path)
    assert code == 0, out
    assert out["status"] == "applied"
    assert out["edits"] == ["clamp-message"]
    assert out["skipped"] == ["route-overflow-400"]  # fixed upstream, and the user is told
    patched = target.read_text()
    assert CLAMP_MARKER in patched and ROUTE_MARKER not in patched
    assert patched.count("except ValueError as e:") == 1  # upstream's, not a second one of ours
    removed, _ = _changed_lines(original, target.read_bytes())
    assert [line.strip() for line in removed] == [  # the old message, nothing else
        'f"The prompt has {len(prompt_token_ids)} tokens, which leaves "',
        'f"nothing for the output under max_model_len "',
        'f"({self.model_config.max_model_len})."',
    ]

    # read again, the skipped part still counts as done
    code, out = _run("apply", tmp_path)
    assert (code, out["status"]) == (0, "already-applied")
    code, out = _run("verify", tmp_path)
    assert (code, out["status"]) == (0, "applied")


def test_clamp_reworded_upstream_but_route_not_fixed_gets_both_edits(tmp_path):
    # the clamp already says "maximum context length", as a plain ValueError, and the
    # route still answers only VLLMValidationError: the overflow would still be a 500
    text = fixture("upstream_fix_route.py").decode()
    start = text.index("            except ValueError as e:")
    end = text.index("                raise\n", start) + len("                raise\n")
    target = site_packages(tmp_path, (text[:start] + text[end:]).encode())

    code, out = _run("apply", tmp_path)
    assert code == 0, out
    assert sorted(out["edits"]) == ["clamp-message", "route-overflow-400"]
    assert ROUTE_MARKER in target.read_text()


def _edit_fixture(old: str, new: str) -> bytes:
    text = fixture("pre_fix.py").decode()
    assert text.count(old) == 1, old
    return text.replace(old, new).encode()


RAISE = "                    raise ValueError(\n"
REFUSALS = [
    pytest.param(
        _edit_fixture("def _clamp_max_tokens(", "def _limit_max_tokens("),
        "anchor-missing",
        "clamp-message",
        id="clamp-renamed",
    ),
    pytest.param(
        _edit_fixture(
            "list[int]\n            ) -> None:",
            "list[int]\n            ) -> None:\n                if request_max_tokens < 0:\n"
            '                    raise ValueError("a negative budget")',
        ),
        "anchor-ambiguous",
        "clamp-message",
        id="clamp-raises-twice",
    ),
    pytest.param(
        _edit_fixture("prompt_token_ids: list[int]\n", "token_ids: list[int]\n").replace(
            b"len(prompt_token_ids)", b"len(token_ids)"
        ),
        "anchor-missing",
        "found instead",
        id="clamp-parameter-renamed",
    ),
    pytest.param(
        _edit_fixture("except VLLMValidationError as e:", "except RuntimeError as e:"),
        "anchor-missing",
        "route-overflow-400",
        id="route-without-validation-handler",
    ),
    pytest.param(
        _edit_fixture(
            "            try:\n                generator",
            "            try:\n                await openai_serving_chat.check(request)\n"
            "            except VLLMValidationError:\n                pass\n"
            "            try:\n                generator",
        ),
        "anchor-ambiguous",
        "route-overflow-400",
        id="route-with-two-validation-handlers",
    ),
]


@pytest.mark.parametrize(("source", "status", "named"), REFUSALS)
def test_unrecognised_shape_exits_3_and_writes_nothing(tmp_path, source, status, named):
    site_packages(tmp_path, source)
    before = snapshot(tmp_path)

    code, out = _run("apply", tmp_path)
    assert code == 3, out
    assert out["status"] == status
    assert named in out["message"] and TARGET in out["message"]
    assert snapshot(tmp_path) == before


@pytest.mark.skipif(
    not os.environ.get("FP32PATCH_NEMO_RL_CHECKOUT"),
    reason="set FP32PATCH_NEMO_RL_CHECKOUT to a NeMo-RL checkout to try the spec on its file",
)
def test_a_real_nemo_rl_checkout(tmp_path):
    # the real file cannot live in this repository; a copy of it is patched, never the checkout
    source = (Path(os.environ["FP32PATCH_NEMO_RL_CHECKOUT"]) / TARGET).read_bytes()
    target = source_checkout(tmp_path, source)
    code, out = _run("apply", tmp_path)
    assert code == 0, out
    assert out["status"] in ("applied", "obsolete")
    code, verified = _run("verify", tmp_path)
    assert (code, verified["status"]) == (0, out["status"])
    code, _ = _run("revert", tmp_path)
    assert code == 0 and target.read_bytes() == source
