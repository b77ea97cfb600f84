"""Each stack's image recipe (README.md, docs/<stack>.md), word for word, in the layout of that
stack's real image, built with the tools the image is built with:

* ``"vllm-image"``: vLLM's image (``vllm/vllm-openai:v0.25.1``): a venv holding vLLM's real
  wheel (installed by uv, as vLLM's own image installs it); README's CI step (``docker run --rm
  $IMAGE fp32patch verify --json``) runs what it runs in the image; docs/commands.md's ``revert
  --against`` brings back vLLM's bytes after a multi-stage build lost the state folder.
* ``"nemo-rl-image"``: NeMo-RL's image: the checkout at ``/opt/nemo-rl`` (the stand-in
  tests/fixtures/nemo_rl_src at its newest shape), the driver venv ``/opt/nemo_rl_venv`` and a
  venv per kind of worker under ``/opt/ray_venvs``, each made by ``uv venv`` and holding the
  checkout as an editable install (``uv pip install -e``, the editable wheel ``uv sync``
  installs), vLLM's real wheel in the vLLM worker's venv. README's lines and docs/nemo-rl.md's,
  and its CI step.
* ``"verl-image"``, ``"trl-image"``, ``"openrlhf-image"``: one environment holding the stack's
  real wheel and the real wheel of the vLLM its ``vllm`` extra pins, installed ``--no-deps``
  (torch and the rest of vLLM's dependencies are not needed to patch). TRL's and OpenRLHF's
  recipes install the stack themselves (``pip install "trl[vllm]==1.16.0" ...``): they run with
  ``PIP_NO_DEPS=1`` in the environment, pip's configuration and not the recipe's text, so pip
  takes the stack's wheel from the index and leaves the vLLM in place; fp32patch's own
  requirements are in the environment first.
* ``"sglang-image"``, ``"slime-image"``: SGLang's source tree installed editable (``pip install -e``,
  as SGLang's and slime's images install it; SGLang 0.5.9's sdist is that tree, the newest SGLang
  with one), and for slime its checkout beside it (the stand-in tests/fixtures/slime_src,
  ``pip install -e . --no-deps`` as slime's Dockerfile does).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib
import zipfile
from pathlib import Path

import pytest

from tests.conftest import tree_digest
from tests.fixtures import prime_rl_shapes
from tests.fixtures.nemo_rl_shapes import NEWEST, checkout
from tests.recipes.conftest import REPO, Layout, clean_env, sh, site_packages, uv_binary, venv
from tests.support import recipes
from tests.support.pypi import sdist_file, wheel_file

pytestmark = pytest.mark.network

NEMO_RL_SRC = REPO / "tests" / "fixtures" / "nemo_rl_src"
SLIME_SRC = REPO / "tests" / "fixtures" / "slime_src"
VLLM_IDS = ("vllm-fp32-logits", "nemotron-h-fp32-lm-head")
VLLM_PATCHED = ("vllm/model_executor/layers/logits_processor.py", "vllm/model_executor/models/nemotron_h.py")
# NeMo-RL's worker venvs are named by the worker class they serve (nemo_rl/utils/venvs.py)
RAY_VENVS = {
    "nemo_rl.models.generation.vllm.vllm_worker.VllmGenerationWorker": True,  # holds vLLM
    "nemo_rl.models.policy.workers.megatron_policy_worker.MegatronPolicyWorker": False,
    "nemo_rl.models.policy.workers.dtensor_policy_worker_v2.DTensorPolicyWorkerV2": False,
}


def pip(env: Path, *args: str) -> None:
    """``pip install`` into the layout's venv, as the image's build did before the recipe."""
    command = [str(env / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", *args]
    result = subprocess.run(command, env=clean_env([]), capture_output=True, text=True)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def uv_install(env: Path, *args: str) -> None:
    """``uv pip install --no-deps`` into the layout's venv (vLLM's own image installs with uv): a wheel
    is unpacked once into the test cache's uv cache and linked from there on later runs."""
    command = [str(uv_binary()), "pip", "install", "-q", "--no-deps", "--python", str(env / "bin" / "python"), *args]
    result = subprocess.run(command, env=clean_env([]), capture_output=True, text=True)
    assert result.returncode == 0, f"{command}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def requirements() -> list[str]:
    """fp32patch's own requirements, from pyproject.toml."""
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]


def verify(layout: Layout, *args: str) -> list[dict]:
    """``fp32patch verify --json`` in the layout: its patch rows (verify must exit 0)."""
    out = layout.run(" ".join(["fp32patch", "verify", *args, "--json"]))
    report = json.loads(out.stdout)
    assert report["ok"], report
    return report["patches"]


def applied(rows: list[dict]) -> set[str]:
    return {row["id"] for row in rows if row["status"] == "applied"}


def env_layout(tmp_path: Path, wheel: Path, *, image: str | None = None, extra: dict | None = None) -> Layout:
    """A layout whose Python is one venv at ``<root>/env`` (the image's Python), on PATH."""
    root = tmp_path / "root"
    env = venv(root / "env")
    context = tmp_path / "context"
    context.mkdir()
    shutil.copy(wheel, context)
    paths = {"/tmp/": f"{root}/tmp/"}
    return Layout(root, context, paths, clean_env([env / "bin"], **(extra or {})), image)


def wheel_bytes(project: str, version: str, members) -> dict[str, bytes]:
    with zipfile.ZipFile(wheel_file(project, version)) as whl:
        return {m: whl.read(m) for m in members}


def test_vllm_image(tmp_path, wheel):
    dockerfile, ci, revert = recipes.recipes("vllm-image")
    version = re.fullmatch(r"FROM vllm/vllm-openai:v([\d.]+)", dockerfile.text.splitlines()[0])[1]
    layout = env_layout(tmp_path, wheel, image=f"vllm/vllm-openai:v{version}")
    env = layout.root / "env"
    uv_install(env, str(wheel_file("vllm", version)))
    site = site_packages(env)

    layout.dockerfile(dockerfile)
    assert layout.env["FP32PATCH_VLLM_LM_HEAD"] == "1"
    # README's CI step: what `docker run --rm $IMAGE ...` runs, in the image
    out = layout.run(" ".join(recipes.docker_run_command(ci.text)))
    report = json.loads(out.stdout)
    assert report["ok"] and applied(report["patches"]) == {"vllm-fp32-logits", "nemotron-h-fp32-lm-head"}, report

    # docs/commands.md: a multi-stage build copied vLLM's files without the state folder; revert --against
    shutil.rmtree(site / ".fp32patch")
    assert layout.run("fp32patch verify", check=False).returncode == 1
    stock = layout.root / "tmp" / "stock"
    stock.mkdir(parents=True)
    (stock / wheel_file("vllm", version).name).hardlink_to(wheel_file("vllm", version))
    layout.paths["/usr/local/lib/python3.12/site-packages"] = str(site)
    layout.run(layout.subst(revert.text))
    for member, data in wheel_bytes("vllm", version, VLLM_PATCHED).items():
        assert (site / member).read_bytes() == data, member


def test_nemo_rl_image(tmp_path, wheel):
    """README's and docs/nemo-rl.md's NeMo-RL recipe, each in a fresh NeMo-RL layout."""
    blocks = recipes.recipes("nemo-rl-image")
    (ci,) = [b for b in blocks if b.info == "yaml"]
    for n, block in enumerate(b for b in blocks if b.info == "dockerfile"):
        layout = nemo_rl_layout(tmp_path / f"recipe{n}", wheel)
        checkout = layout.root / "opt" / "nemo-rl"
        before = tree_digest(checkout)
        layout.dockerfile(block)
        # the CI step of docs/nemo-rl.md, what `docker run --rm $IMAGE sh -c '...'` runs in the image
        words = recipes.docker_run_command(ci.text)
        assert words[:2] == ["sh", "-c"], words
        out = layout.run(layout.subst(words[2]))
        reports = list(_json_objects(out.stdout))
        assert len(reports) == 2 and all(r["ok"] for r in reports), reports
        vllm_venv = next(name for name, has_vllm in RAY_VENVS.items() if has_vllm)
        rows = reports[0]["patches"]
        in_vllm_venv = [r for r in rows if r["id"] in VLLM_IDS and vllm_venv in (r["root"] or "")]
        assert sorted(r["status"] for r in in_vllm_venv) == ["applied", "applied"], rows
        # the checkout, reached through the three worker venvs' editable installs, is one target, reported once
        reached = [Path(r["root"]).resolve() for r in rows if r["id"] == "nemo-rl-fp32-lm-head"]
        assert reached == [checkout.resolve()], rows
        assert applied(reports[1]["patches"]) >= {"nemo-rl-fp32-lm-head"}, reports[1]
        assert vllm_venv in out.stdout
        # and revert gives every byte of the checkout back
        layout.run(layout.subst("fp32patch revert --envs /opt/ray_venvs && fp32patch revert -s /opt/nemo-rl"))
        assert tree_digest(checkout) == before


def _json_objects(text: str):
    decoder, at = json.JSONDecoder(), 0
    while (at := _skip_space(text, at)) < len(text):
        obj, at = decoder.raw_decode(text, at)
        yield obj


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def nemo_rl_checkout(dest: Path) -> Path:
    """The stand-in NeMo-RL checkout at its newest supported shape (tests/fixtures/nemo_rl_shapes.py:
    ``nemo_rl_src`` with the files each shape adds), with its pyproject (setuptools, as NeMo-RL's)."""
    checkout(NEWEST.name, dest)
    shutil.copyfile(NEMO_RL_SRC / "pyproject.toml", dest / "pyproject.toml")
    return dest


def nemo_rl_layout(tmp_path: Path, wheel: Path) -> Layout:
    """NeMo-RL's image after its venv prefetch step, made as NeMo-RL makes it: with uv."""
    root = tmp_path / "root"
    checkout = nemo_rl_checkout(root / "opt" / "nemo-rl")
    tools = tmp_path / "tools"  # the image's /usr/local/bin: uv
    tools.mkdir()
    (tools / "uv").symlink_to(uv_binary())
    base = clean_env([tools])
    venvs = [root / "opt" / "nemo_rl_venv", *(root / "opt" / "ray_venvs" / name for name in RAY_VENVS)]
    for where in venvs:
        sh(f"uv venv -q {where} && uv pip install -q --python {where}/bin/python --no-deps -e {checkout}", base, root)
    vllm = wheel_file("vllm", "0.25.1")
    for name, has_vllm in RAY_VENVS.items():
        if has_vllm:
            sh(f"uv pip install -q --python {root}/opt/ray_venvs/{name}/bin/python --no-deps {vllm}", base, root)
    context = tmp_path / "context"
    context.mkdir()
    shutil.copy(wheel, context)
    paths = {"/opt/": f"{root}/opt/", "/tmp/": f"{root}/tmp/"}
    return Layout(root, context, paths, clean_env([root / "opt" / "nemo_rl_venv" / "bin", tools]))


# (layout, the stack's distribution and release, the vLLM release its vllm extra pins, the stack's patch)
STACKS = [
    ("verl-image", "verl", "0.9.1", "0.24.0", "verl-fp32-lm-head"),
    ("trl-image", "trl", "1.16.0", "0.31.0", "trl-fp32-lm-head"),
    ("openrlhf-image", "openrlhf", "0.11.2", "0.29.0", "openrlhf-fp32-lm-head"),
]


@pytest.mark.parametrize("layout_name, project, version, vllm, patch", STACKS, ids=[s[0] for s in STACKS])
def test_stack_in_one_environment(tmp_path, wheel, layout_name, project, version, vllm, patch):
    (block,) = recipes.recipes(layout_name)
    installs_stack = f"{project}[vllm]=={version}" in block.text
    layout = env_layout(tmp_path, wheel, extra={"PIP_NO_DEPS": "1"} if installs_stack else None)
    env = layout.root / "env"
    uv_install(env, str(wheel_file("vllm", vllm)))
    if installs_stack:
        pip(env, *requirements())
    else:
        uv_install(env, str(wheel_file(project, version)))
    layout.dockerfile(block)
    rows = verify(layout)
    assert {patch, "vllm-fp32-logits", "nemotron-h-fp32-lm-head"} <= applied(rows), rows
    assert {row["version"] for row in rows if row["id"] == patch} == {version}, rows


def sglang_tree(tmp_path: Path) -> Path:
    """SGLang's source tree (its python/ folder, which the sdist is), unpacked."""
    with tarfile.open(sdist_file("sglang", "0.5.9")) as sdist:
        sdist.extractall(tmp_path, filter="data")
    return tmp_path / "sglang-0.5.9"


@pytest.mark.parametrize("layout_name", ["sglang-image", "slime-image"])
def test_sglang_and_slime(tmp_path, wheel, layout_name):
    (block,) = recipes.recipes(layout_name)
    layout = env_layout(tmp_path, wheel)
    env = layout.root / "env"
    tree = sglang_tree(layout.root / "sgl-workspace")
    pip(env, "--no-deps", "-e", str(tree))
    expected = {"sglang-fp32-lm-head": tree}
    if layout_name == "slime-image":
        checkout = layout.root / "root" / "slime"
        shutil.copytree(SLIME_SRC, checkout, ignore=shutil.ignore_patterns("__pycache__"))
        pip(env, "--no-deps", "-e", str(checkout))
        expected["slime-fp32-lm-head"] = checkout

    layout.dockerfile(block)
    rows = verify(layout)
    assert set(expected) <= applied(rows), rows
    # apply followed each editable install to its tree: the patched files are there, not in site-packages
    for row in rows:
        if row["id"] in expected:
            assert Path(row["path"]).is_relative_to(expected[row["id"]]), row


def test_areal_image(tmp_path, wheel):
    # AReaL's image: AReaL 1.0.4 and the SGLang its sglang extra pins (0.5.10.post1) in one environment
    (block,) = recipes.recipes("areal-image")
    layout = env_layout(tmp_path, wheel)
    env = layout.root / "env"
    uv_install(env, str(wheel_file("sglang", "0.5.10.post1")), str(wheel_file("areal", "1.0.4")))
    site = site_packages(env)
    before = {name: tree_digest(site / name) for name in ("areal", "sglang")}
    layout.dockerfile(block)
    rows = verify(layout)
    assert {"areal-fp32-lm-head", "sglang-fp32-lm-head"} <= applied(rows), rows
    assert {row["version"] for row in rows if row["id"] == "areal-fp32-lm-head"} == {"1.0.4"}, rows
    assert {name: tree_digest(site / name) for name in before} != before
    layout.run("fp32patch revert")
    assert {name: tree_digest(site / name) for name in before} == before


def test_skyrl_image(tmp_path, wheel):
    # SkyRL's image: SkyRL 0.4.0 and the vLLM it pins (0.30.0) in one environment. SkyRL asks
    # Python >= 3.12; its files are installed here with --ignore-requires-python (the recipe's
    # commands never import it)
    (block,) = recipes.recipes("skyrl-image")
    layout = env_layout(tmp_path, wheel)
    env = layout.root / "env"
    uv_install(env, str(wheel_file("vllm", "0.30.0")))
    pip(env, "--no-deps", "--ignore-requires-python", str(wheel_file("skyrl", "0.4.0")))
    layout.dockerfile(block)
    rows = verify(layout)
    assert {"skyrl-fp32-lm-head", "vllm-fp32-logits", "nemotron-h-fp32-lm-head"} <= applied(rows), rows
    assert {row["version"] for row in rows if row["id"] == "skyrl-fp32-lm-head"} == {"0.4.0"}, rows


def prime_rl_layout(tmp_path: Path, wheel: Path) -> Layout:
    """Prime-RL's image (Dockerfile.cuda): the checkout at /app, its environment /app/.venv made by
    uv, holding prime-rl and its workspace member prime-rl-configs editable, and vLLM. The checkout
    is fp32patch's stand-in (tests/fixtures/prime_rl_src: Prime-RL is not on PyPI). Prime-RL asks
    Python 3.12; the editable installs are made with pip --ignore-requires-python (the recipe never
    imports it), where the image's ``uv sync`` makes the same editable wheels."""
    root = tmp_path / "root"
    root.mkdir()
    app = root / "app"
    shutil.copytree(prime_rl_shapes.SRC, app, ignore=shutil.ignore_patterns("__pycache__"))
    tools = tmp_path / "tools"  # the image's /usr/local/bin: uv
    tools.mkdir()
    (tools / "uv").symlink_to(uv_binary())
    sh(f"uv venv -q --seed {app}/.venv", clean_env([tools]), root)
    env = app / ".venv"
    pip(env, "--no-deps", "--ignore-requires-python", "-e", str(app), "-e", str(app / "packages" / "prime-rl-configs"))
    uv_install(env, str(wheel_file("vllm", "0.29.0")))
    context = tmp_path / "context"
    context.mkdir()
    shutil.copy(wheel, context)
    paths = {"/app": f"{root}/app", "/tmp/": f"{root}/tmp/"}
    return Layout(root, context, paths, clean_env([tools]))


def test_prime_rl_image(tmp_path, wheel):
    (block,) = recipes.recipes("prime-rl-image")
    layout = prime_rl_layout(tmp_path, wheel)
    app = layout.root / "app"
    before = tree_digest(app / "src")
    layout.dockerfile(block)
    cli = f"{app}/.venv/bin/fp32patch"
    for where in (f"-s {app}", ""):  # without -s, the environment's editable installs lead to the checkout
        report = json.loads(layout.run(f"{cli} verify {where} --patch prime-rl-fp32-lm-head --json").stdout)
        assert report["ok"], report
        (row,) = report["patches"]
        assert row["status"] == "applied" and row["version"] == "0.8.0", row
        assert Path(row["root"]).resolve() == app.resolve(), row
    layout.run(f"{app}/.venv/bin/fp32patch revert -s {app}")
    assert tree_digest(app / "src") == before
