"""README's plain-vLLM image and docs/nemo-rl.md's NeMo-RL image, built for real.

The Dockerfile text is the recipe's own, read out of the Markdown by the recipe collector
(tests/support/recipes.py), with one line changed: FROM names the stand-in of the vendor's image
(tests/images/vllm-openai.Dockerfile: vLLM's wheel; tests/images/nemo-rl.Dockerfile: NeMo-RL's
layout of uv venvs with the checkout editable in each), for README's ``FROM
vllm/vllm-openai:v0.25.1`` and for the NeMo-RL image the recipe is added to. The build context
holds the wheel ``make dist`` writes. In the built image ``fp32patch verify`` (and ``--json``)
runs as the docs' CI step runs it (``docker run --rm $IMAGE ...``, with podman), and a later
layer that edits a patched file fails its build at ``RUN fp32patch verify``.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.images.conftest import BASE
from tests.recipes.conftest import clone, dist, uv_binary, wheel  # noqa: F401 (fixtures: the wheel make dist writes)
from tests.recipes.test_image_recipes import RAY_VENVS, VLLM_IDS, nemo_rl_checkout
from tests.support import recipes
from tests.support.pypi import wheel_file

pytestmark = pytest.mark.network

HERE = Path(__file__).parent
REPO = HERE.parents[1]


def stand_in(name: str, **values: str) -> str:
    text = (HERE / f"{name}.Dockerfile").read_text()
    text = text.replace("FROM localhost/fp32patch-test/debian-python", f"FROM {BASE}")
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    return text


def recipe_dockerfile(block: recipes.Block, image: str) -> str:
    """The block's text with its FROM naming ``image`` (prepended where the recipe has none)."""
    text = block.text
    if text.startswith("FROM "):
        return re.sub(r"\AFROM \S+", f"FROM {image}", text)
    return f"FROM {image}\n{text}"


def context(tmp_path: Path, name: str, *files: Path) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    for path in files:
        target = folder / path.name
        if path.is_dir():
            shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            try:
                target.hardlink_to(path)
            except OSError:
                shutil.copy(path, target)
    return folder


def drift_layer(image: str, patched: str, verify: str = "fp32patch verify") -> str:
    """A later layer that edits a patched file, then the recipe's check."""
    return f"FROM {image}\nRUN echo '# edited in a later layer' >> {patched}\nRUN {verify}\n"


def recipe_verify(block: recipes.Block) -> str:
    """The recipe's own check: the ``fp32patch verify`` commands of its RUN line."""
    (run,) = [step.args for step in recipes.dockerfile(block.text) if step.keyword == "RUN"]
    return " && ".join(part.strip() for part in run.split("&&") if part.strip().startswith("fp32patch verify"))


def test_plain_vllm_image(podman, wheel, tmp_path):  # noqa: F811
    dockerfile, ci, *_ = recipes.recipes("vllm-image")
    version = re.match(r"FROM vllm/vllm-openai:v(\S+)", dockerfile.text)[1]
    vendor = f"localhost/fp32patch-test/vllm-openai:v{version}"
    podman.build(vendor, context(tmp_path, "vendor", wheel_file("vllm", version)), stand_in("vllm-openai"))

    image = "localhost/fp32patch-test/recipe-vllm"
    built = podman.build(image, context(tmp_path, "recipe", wheel), recipe_dockerfile(dockerfile, vendor))
    assert re.search(r"vllm-fp32-logits\s+applied\s+" + re.escape(version), built.stdout), built.stdout

    # README's CI step, `docker run --rm $IMAGE fp32patch verify --json`, and plain verify
    report = json.loads(podman.run(image, *recipes.docker_run_command(ci.text)).stdout)
    assert report["ok"], report
    rows = {row["id"]: row for row in report["patches"]}
    assert rows["vllm-fp32-logits"]["status"] == rows["nemotron-h-fp32-lm-head"]["status"] == "applied", rows
    assert podman.run(image, "fp32patch", "verify").returncode == 0
    assert podman("image", "inspect", image, "--format", "{{json .Config.Env}}").stdout.count(
        "FP32PATCH_VLLM_LM_HEAD=1"
    ), "the recipe's ENV line"

    patched = rows["vllm-fp32-logits"]["path"]
    drift = podman.build(
        "localhost/fp32patch-test/drift", context(tmp_path, "drift"), drift_layer(image, patched), check=False
    )
    assert drift.returncode != 0, drift.stdout
    assert 'building at STEP "RUN fp32patch verify"' in drift.stderr, drift.stderr
    assert "vllm-fp32-logits (drifted)" in drift.stdout + drift.stderr, drift.stdout


def test_nemo_rl_image(podman, wheel, tmp_path):  # noqa: F811
    blocks = recipes.recipes("nemo-rl-image")
    # docs/nemo-rl.md's block is the whole step (COPY and RUN); README's is its RUN line (tests/recipes runs both)
    (dockerfile,) = [b for b in blocks if b.info == "dockerfile" and b.doc.name == "nemo-rl.md"]
    (ci,) = [b for b in blocks if b.info == "yaml"]
    uv = uv_binary()
    vllm = wheel_file("vllm", "0.25.1")
    worker_venvs = " ".join(RAY_VENVS)
    (vllm_venv,) = [name for name, has_vllm in RAY_VENVS.items() if has_vllm]
    vendor = "localhost/fp32patch-test/nemo-rl"
    files = context(tmp_path, "vendor", uv, vllm)
    nemo_rl_checkout(files / "nemo-rl")
    podman.build(vendor, files, stand_in("nemo-rl", WORKER_VENVS=worker_venvs, VLLM_VENV=vllm_venv))

    image = "localhost/fp32patch-test/recipe-nemo-rl"
    built = podman.build(image, context(tmp_path, "recipe", wheel), recipe_dockerfile(dockerfile, vendor), check=False)
    assert built.returncode == 0, (
        f"the NeMo-RL recipe failed its build:\n{built.stdout[-6000:]}\n{built.stderr[-3000:]}"
    )

    words = recipes.docker_run_command(ci.text)
    out = podman.run(image, *words).stdout
    decoder = json.JSONDecoder()
    first, end = decoder.raw_decode(out)
    second, _ = decoder.raw_decode(out[end:].lstrip())
    assert first["ok"] and second["ok"], out
    in_vllm_venv = [r["status"] for r in first["patches"] if r["id"] in VLLM_IDS and vllm_venv in (r["root"] or "")]
    assert in_vllm_venv == ["applied", "applied"], first
    # the checkout, reached through the worker venvs' editable installs, is one target, reported once
    assert [r["root"] for r in first["patches"] if r["id"] == "nemo-rl-fp32-lm-head"] == ["/opt/nemo-rl"], first
    assert {r["status"] for r in second["patches"] if r["id"] == "nemo-rl-fp32-lm-head"} == {"applied"}, second

    patched = next(r["path"] for r in second["patches"] if r["id"] == "nemo-rl-fp32-lm-head")
    check = recipe_verify(dockerfile)
    assert check == "fp32patch verify --envs /opt/ray_venvs && fp32patch verify -s /opt/nemo-rl", check
    drift = podman.build(
        "localhost/fp32patch-test/drift-nemo-rl",
        context(tmp_path, "drift"),
        drift_layer(image, patched, check),
        check=False,
    )
    assert drift.returncode != 0, drift.stdout
    assert f'building at STEP "RUN {check}"' in drift.stderr, drift.stderr
    assert "nemo-rl-fp32-lm-head (drifted) in /opt/nemo-rl" in drift.stdout + drift.stderr, drift.stdout
