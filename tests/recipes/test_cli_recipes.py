"""README's "Try it without Docker" and docs/commands.md's ``check --against``, word for word.

The blocks of layout ``"cli"`` run in order in one shell (the first block's ``export PATH``
reaches the next ones, as in a user's terminal), from a copy of this working tree, ``/tmp/``
substituted with a folder of the test's own. ``pip download`` finds vLLM's wheel already in its
folder (the test cache's copy, linked there first): pip still asks the index, and skips only
the 250 MB transfer. docs/commands.md's block reads the release to check from ``$NEXT``.
"""

from __future__ import annotations

import os
import re
import zipfile
from pathlib import Path

import pytest

from tests.recipes.conftest import clean_env, copy_tree, sh, sha256
from tests.support import recipes
from tests.support.pypi import wheel_file

pytestmark = pytest.mark.network

VLLM = "0.25.1"
PATCHED = ("vllm/model_executor/layers/logits_processor.py", "vllm/model_executor/models/nemotron_h.py")


def _seed(folder: Path, wheel: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    os.link(wheel, folder / wheel.name)


def test_try_it_without_docker_word_for_word(dist, tmp_path):
    blocks = recipes.recipes("cli")
    assert [b.where.split(":")[0] for b in blocks] == ["README.md", "README.md", "docs/commands.md"]
    clone = copy_tree(tmp_path / "clone")  # a clone of its own: the recipe's make dist runs there
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    stock = wheel_file("vllm", VLLM)
    _seed(tmp / "stock", stock)
    _seed(tmp / "next", stock)
    script = "\n".join(recipes.substitute(b.text, {"/tmp/": f"{tmp}/"}) for b in blocks)
    result = sh("set -ex\n" + script, clean_env([], NEXT=VLLM), clone)

    # make dist in the recipe wrote the bytes the suite's make dist wrote in another copy: the same tree, the same bytes
    assert {p.name: sha256(p) for p in (clone / "dist").iterdir()} == dist
    out = result.stdout
    # apply patched both vLLM files; the listed rows are README's comment, "vllm-fp32-logits and nemotron-h...: applied"
    for patch in ("vllm-fp32-logits", "nemotron-h-fp32-lm-head"):
        assert re.search(rf"{patch}\s+applied\s+{re.escape(VLLM)}", out), out
    assert "+++ " in out and "fp32patch" in out  # diff printed the change as a patch
    # revert gave vLLM's bytes back, in the --target root and in the venv
    with zipfile.ZipFile(stock) as whl:
        for root in (tmp / "vllm-root", next((tmp / "vllm-venv").glob("lib/python3.*/site-packages"))):
            for member in PATCHED:
                assert (root / member).read_bytes() == whl.read(member), (root, member)
    # docs/commands.md's check against the release: each vLLM patch would apply
    assert re.search(r"would-apply", out), out
