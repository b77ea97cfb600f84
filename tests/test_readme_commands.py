"""README's front page names the two commands a new user runs, and both are the Makefile's; every
code block of README.md and docs/*.md is a recipe that a test runs or says why it is not one."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import fp32patch
from tests.support import recipes

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
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "make test" in ci and "make test-images" in ci, ci


def test_every_block_is_a_recipe_or_says_why_not():
    """A block without a marker would be a command no test runs; a marker before no block, a typo."""
    unmarked, strays = [], []
    for doc in recipes.documents():
        blocks, stray = recipes.parse(doc)
        unmarked += [b.where for b in blocks if not (b.layout or b.reason)]
        strays += [f"{s.doc.relative_to(REPO)}:{s.line} {s.text}" for s in stray]
    assert not unmarked, f"code blocks without <!-- recipe: LAYOUT --> or <!-- not-a-recipe: REASON -->: {unmarked}"
    assert not strays, f"markers that stand before no code block: {strays}"


def test_every_recipe_names_a_layout_that_a_test_runs():
    for block in recipes.all_blocks():
        if block.layout:
            assert block.layout in recipes.LAYOUTS, f"{block.where}: no test runs layout {block.layout!r}"
            runner = REPO / recipes.LAYOUTS[block.layout]
            assert runner.is_file() and f'"{block.layout}"' in runner.read_text(), (block.where, runner)
        else:
            assert len(block.reason.split()) >= 2, f"{block.where}: say why the block is not run: {block.reason!r}"


def test_what_is_not_run_and_why(capsys):
    """The list of blocks no test runs, with the reason of each (shown with ``-s`` or ``-rA``)."""
    skipped = [f"{b.where}: {b.reason}" for b in recipes.all_blocks() if b.reason]
    with capsys.disabled():
        print("\nblocks of README.md and docs/*.md that are not run:\n  " + "\n  ".join(skipped))
    assert skipped


def test_image_recipes_install_this_release_of_the_wheel():
    """Every Dockerfile recipe installs the wheel ``make dist`` writes for this version, and uses
    only instructions the recipe tests interpret (FROM, COPY, RUN, ENV)."""
    wheel = f"fp32patch-{fp32patch.__version__}-py3-none-any.whl"
    for block in recipes.all_blocks():
        if block.info != "dockerfile":
            continue
        steps = recipes.dockerfile(block.text)
        assert {s.keyword for s in steps} <= {"FROM", "COPY", "RUN", "ENV"}, block.where
        assert any(wheel in s.args for s in steps if s.keyword == "RUN"), (block.where, wheel)
        for step in steps:
            if step.keyword == "COPY":
                assert step.args.split()[0] == wheel, (block.where, step.args)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("RUN a \\\n && b\n", [("RUN", "a  && b")]),
        ("# a comment\nFROM x:1\n\nENV A=1\n# or b\n", [("FROM", "x:1"), ("ENV", "A=1")]),
        ("COPY w.whl /tmp/\nrun echo 'a # b'\n", [("COPY", "w.whl /tmp/"), ("RUN", "echo 'a # b'")]),
    ],
)
def test_dockerfile_instructions(text, expected):
    assert [(s.keyword, s.args) for s in recipes.dockerfile(text)] == expected


def test_dockerfile_that_ends_inside_a_continued_line_is_an_error():
    with pytest.raises(ValueError, match="continued line"):
        recipes.dockerfile("RUN a \\\n")


def test_substitute_changes_named_prefixes_only_in_one_pass():
    text = "fp32patch apply -s /opt/nemo-rl && cp /tmp/w.whl /opt/x"
    out = recipes.substitute(text, {"/opt/": "/tmp/t1/opt/", "/tmp/": "/tmp/t1/tmp/"})
    assert out == "fp32patch apply -s /tmp/t1/opt/nemo-rl && cp /tmp/t1/tmp/w.whl /tmp/t1/opt/x"
    with pytest.raises(ValueError, match="no longer names '/usr/'"):
        recipes.substitute(text, {"/usr/": "/x/"})


def test_docker_run_command_is_what_runs_in_the_image():
    step = "  run: docker run --rm $IMAGE sh -c 'fp32patch verify --json && fp32patch verify -s /x --json'\n"
    assert recipes.docker_run_command(step) == ["sh", "-c", "fp32patch verify --json && fp32patch verify -s /x --json"]


def test_a_marker_before_prose_is_named_as_stray(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("<!-- recipe: cli -->\nsome prose\n\n<!-- not-a-recipe: output -->\n```\nx\n```\n")
    blocks, strays = recipes.parse(doc)
    assert [(s.line, s.text) for s in strays] == [(1, "recipe: cli")]
    assert [(b.line, b.reason) for b in blocks] == [(5, "output")]
