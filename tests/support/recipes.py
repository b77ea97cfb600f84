"""The recipes of README.md and docs/*.md, read out of the Markdown for the tests that run them.

Every fenced block in those files carries a marker, an HTML comment on the line before it
(invisible on GitHub and in any renderer):

    <!-- recipe: LAYOUT -->          the block runs, word for word, in LAYOUT (tests/recipes, tests/images)
    <!-- not-a-recipe: REASON -->    the block is not run, and REASON says why (an output, a config, ...)

so a doc and its test cannot drift: the tests take the command lines from here, substitute
paths (``substitute``), and change nothing else. ``tests/test_readme_commands.py`` holds every
block to a marker and every recipe to a layout the tests know.

Sybil and pytest-markdown-docs collect Python examples and run them in one namespace; these
blocks are shell and Dockerfile lines that need a prepared layout each, so this is a small
parser over markdown-it-py (rich's own Markdown parser) and the layouts live in the tests.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

from markdown_it import MarkdownIt

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*(recipe|not-a-recipe):\s*(.*?)\s*-->", re.S)


def documents() -> list[Path]:
    """README.md and docs/*.md, the files whose blocks are recipes or say why not."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclasses.dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    info: str  # the fence's language ("" for none)
    text: str
    layout: str | None  # "recipe: LAYOUT"
    reason: str | None  # "not-a-recipe: REASON"

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


@dataclasses.dataclass(frozen=True)
class StrayMarker:
    doc: Path
    line: int
    text: str


def parse(doc: Path) -> tuple[list[Block], list[StrayMarker]]:
    """The fenced and indented code blocks of ``doc``, each with the marker just before it, and
    the markers that stand before no block (a typo's symptom: the test names them)."""
    blocks, strays = [], []
    pending: tuple[str, str, int] | None = None
    for token in MarkdownIt("commonmark").parse(doc.read_text()):
        if token.type == "html_block" and (m := MARKER.fullmatch(token.content.strip())):
            if pending:
                strays.append(StrayMarker(doc, pending[2], f"{pending[0]}: {pending[1]}"))
            pending = (m[1], m[2], token.map[0] + 1)
            continue
        if token.type in ("fence", "code_block"):
            kind, value = pending[:2] if pending else (None, None)
            blocks.append(
                Block(
                    doc,
                    token.map[0] + 1,
                    token.info.strip(),
                    token.content,
                    value if kind == "recipe" else None,
                    value if kind == "not-a-recipe" else None,
                )
            )
            pending = None
        elif pending and token.type not in ("paragraph_close", "list_item_close", "bullet_list_close"):
            strays.append(StrayMarker(doc, pending[2], f"{pending[0]}: {pending[1]}"))
            pending = None
    if pending:
        strays.append(StrayMarker(doc, pending[2], f"{pending[0]}: {pending[1]}"))
    return blocks, strays


def all_blocks() -> list[Block]:
    return [block for doc in documents() for block in parse(doc)[0]]


def recipes(layout: str) -> list[Block]:
    """Every block marked ``recipe: layout``, in the documents' order."""
    found = [block for block in all_blocks() if block.layout == layout]
    if not found:
        raise LookupError(f"no block in README.md or docs/*.md is marked <!-- recipe: {layout} -->")
    return found


@dataclasses.dataclass(frozen=True)
class Instruction:
    keyword: str  # FROM, COPY, RUN, ENV, ...
    args: str  # as written, continuation lines joined as Docker joins them


def dockerfile(text: str) -> list[Instruction]:
    """A Dockerfile's instructions: comment lines dropped, a line ending in a backslash joined
    with the next (the backslash and the newline removed, as Docker's parser does)."""
    out, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1]
            continue
        current += line
        keyword, _, args = current.strip().partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
        current = ""
    if current:
        raise ValueError(f"Dockerfile ends inside a continued line: {current!r}")
    return out


def docker_run_command(text: str) -> list[str]:
    """What ``docker run [OPTIONS] $IMAGE COMMAND...`` in a CI step (a YAML ``run:``) runs in the image:
    the words after ``$IMAGE``."""
    line = next(line for line in text.splitlines() if "docker run" in line)
    words = shlex.split(line.split("run:", 1)[1] if "run:" in line else line)
    return words[words.index("$IMAGE") + 1 :]


def substitute(text: str, paths: dict[str, str]) -> str:
    """``text`` with each path prefix in ``paths`` replaced (longest first); nothing else changes.
    A prefix that the text does not hold is an error: a doc that moved on must move its test."""
    for old in paths:
        if old not in text:
            raise ValueError(f"the recipe no longer names {old!r}:\n{text}")
    # one pass, so that a replacement holding another prefix (/tmp/pytest-.../opt/) is left alone
    pattern = "|".join(re.escape(old) for old in sorted(paths, key=len, reverse=True))
    return re.sub(pattern, lambda m: paths[m[0]], text)


# Where each layout's recipes run (each test reads them with ``recipes(layout)``). The podman
# image test builds the README's two image recipes for real besides (tests/images).
LAYOUTS = {
    "cli": "tests/recipes/test_cli_recipes.py",
    "vllm-image": "tests/recipes/test_image_recipes.py",
    "nemo-rl-image": "tests/recipes/test_image_recipes.py",
    "verl-image": "tests/recipes/test_image_recipes.py",
    "trl-image": "tests/recipes/test_image_recipes.py",
    "openrlhf-image": "tests/recipes/test_image_recipes.py",
    "sglang-image": "tests/recipes/test_image_recipes.py",
    "slime-image": "tests/recipes/test_image_recipes.py",
    "areal-image": "tests/recipes/test_image_recipes.py",
    "skyrl-image": "tests/recipes/test_image_recipes.py",
    "prime-rl-image": "tests/recipes/test_image_recipes.py",
}
