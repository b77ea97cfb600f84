"""README's front page names the two commands a new user runs, and both are the Makefile's."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_readme_names_make_demo_and_make_test_before_the_image_recipe_ends():
    text = (REPO / "README.md").read_text()
    first_screen = text[: text.index("## Try it without Docker")]
    for command in ("make demo", "make test"):
        assert re.search(rf"^{command}\b", first_screen, re.M), command


def test_both_are_targets_that_make_can_run():
    """``make -n`` resolves each target without running it: a renamed target or a missing script fails here."""
    for target, needs in (("demo", "tools/demo.sh"), ("test", "pytest")):
        out = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, check=True).stdout
        assert needs in out, out
    assert (REPO / "tools" / "demo.sh").stat().st_mode & 0o444
    assert (REPO / ".ci" / "run").read_text().rstrip().endswith("make test")
