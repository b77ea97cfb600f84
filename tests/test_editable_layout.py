"""NeMo-RL's image as it is laid out: one checkout, reached through editable installs from many venvs.

NeMo-RL's worker venvs (``NEMO_RL_VENV_DIR``, ``/opt/ray_venvs``) are made by ``uv venv`` and ``uv sync
--directory <checkout>``, which installs nemo-rl editable into every one of them: each holds
``nemo_rl-0.6.0.dist-info`` with ``direct_url.json`` naming the checkout and setuptools' PEP 660 finder
(or, in setuptools' compat mode, a ``.pth`` line), all pointing at ``/opt/nemo-rl``. The layout here is
made by the same tools: ``uv venv --seed``, then ``uv pip install -e`` (the editable wheel setuptools
builds for ``uv sync``), ``pip install -e`` (pip's form) and setuptools' compat mode (a ``.pth`` line) into
three venvs, of the stand-in checkout (``tests/fixtures/nemo_rl_src``, built by setuptools as NeMo-RL is);
vLLM 0.25.1's own files (read out of its wheel) in the vLLM venv. Then docs/nemo-rl.md's recipe, its
command lines as the page has them (paths substituted), with the real CLI in subprocesses.

What a user would notice: the recipe exits 0 and the checkout gets what ``-s <checkout>`` gives (the same
variant, the same bytes, one state folder in the checkout); ``verify --envs`` reports the checkout once;
``revert`` gives every byte back; a checkout spelled several ways (a symlink, a trailing slash, a relative
``.pth`` line, a relative ``-s``) is still one target, with one lock (before, the run waited on itself);
a refusal names its cause and the command, however many venvs reach the checkout.

Opt-in, over a real NeMo-RL checkout (``FP32PATCH_NEMO_RL_CHECKOUT=/path/to/RL``): the same recipe with
the checkout's own files copied in.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import LOGITS_PROCESSOR, NEMOTRON, default_sigint
from tests.fixtures.nemo_rl_shapes import NEWEST, NEWEST_WITH_V1, SRC, files_at

pytestmark = pytest.mark.network  # uv venv --seed and vLLM's files come from the package index

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "nemo-rl.md"
FP32 = "nemo-rl-fp32-lm-head"
CONTEXT = "nemo-rl-context-length-400"
VLLM = "0.25.1"  # what NeMo-RL pins at 7ea279abf and a704801f1

# docs/nemo-rl.md's recipe, as the page has it (the test checks each line is there, word for word)
RECIPE = [
    "fp32patch apply --envs /opt/ray_venvs",
    "fp32patch apply -s /opt/nemo-rl",
    "fp32patch verify --envs /opt/ray_venvs",
    "fp32patch verify -s /opt/nemo-rl",
]


def _uv() -> str:
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.is_file() else shutil.which("uv")
    if found is None:
        pytest.skip("uv is not installed (make install puts it in .venv)")
    return found


def _run(*argv, cwd: Path | None = None) -> None:
    from tests.support.pypi import cache_root

    env = {**os.environ, "UV_CACHE_DIR": str(cache_root() / "uv")}
    env.pop("PYTHONPATH", None)  # the venv's own Python must not see this repository's
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    assert done.returncode == 0, f"{argv}: {done.stdout}{done.stderr}"


def _site(venv: Path) -> Path:
    (site,) = sorted(venv.glob("lib/python3*/site-packages"))
    return site


def fp32patch(*args, cwd: Path | str = "/", timeout: int = 300) -> subprocess.CompletedProcess:
    """``fp32patch ARGS`` in a fresh process, as a Dockerfile's RUN line runs it (a timeout: a run that
    waits on itself fails the test instead of hanging it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "NO_COLOR": "1", "COLUMNS": "200"}
    argv = [sys.executable, "-m", "fp32patch", *map(str, args)]
    try:
        return subprocess.run(
            argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout, preexec_fn=default_sigint
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"`fp32patch {' '.join(map(str, args))}` did not finish in {timeout} s (waiting on its own lock?)")


def line(command: str, opt: Path) -> list[str]:
    """A recipe line's arguments, /opt replaced by the test's folder."""
    words = command.replace("/opt/", f"{opt}/").split()
    assert words[0] == "fp32patch"
    return words[1:]


def _json(done: subprocess.CompletedProcess) -> dict:
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    return json.loads(done.stdout)


def sources(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` but bytecode (the engine refreshes .pyc files)."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


def _package(root: Path) -> dict[str, str]:
    return sources(root / "nemo_rl")


def write_checkout(root: Path, shape: str, files: dict[str, str] | None = None) -> None:
    """The checkout's nemo_rl/ at ``shape`` (replacing what is there), as a git checkout of that commit."""
    shutil.rmtree(root / "nemo_rl", ignore_errors=True)
    for path, text in (files or files_at(shape)).items():
        if path.startswith("nemo_rl/"):
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Path:
    """``opt/``: the checkout at ``opt/nemo-rl`` and three worker venvs under ``opt/ray_venvs``, made as
    NeMo-RL's image makes them; vLLM 0.25.1's target files in the vllm venv."""
    from tests.support.pypi import import_root_from_members

    uv = _uv()
    opt = tmp_path_factory.mktemp("image") / "opt"
    checkout = opt / "nemo-rl"
    checkout.mkdir(parents=True)
    shutil.copyfile(SRC / "pyproject.toml", checkout / "pyproject.toml")
    write_checkout(checkout, NEWEST.name)
    python = f"--python={sys.executable}"
    venvs = opt / "ray_venvs"
    for name in ("vllm", "mcore", "fsdp"):
        _run(uv, "venv", "-q", "--seed", python, venvs / name)
    # uv's form (what `uv sync` writes: the dist-info, direct_url.json, setuptools' PEP 660 finder)
    _run(uv, "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", checkout, "--python", venvs / "vllm")
    # pip's form (setuptools' editable wheel, installed by pip)
    pip = [venvs / "mcore" / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    _run(*pip, "--no-index", "-e", checkout)
    # setuptools' compat mode: a .pth line naming the checkout
    compat = ["--config-settings", "editable_mode=compat", "--python", venvs / "fsdp"]
    _run(uv, "pip", "install", "-q", "--no-deps", "--no-build-isolation", *compat, "-e", checkout)
    import_root_from_members("vllm", VLLM, [NEMOTRON, LOGITS_PROCESSOR], _site(venvs / "vllm"))
    return opt


@pytest.fixture
def opt(image) -> Path:
    """The image, its checkout back at the newest shape and nothing of ours in it when the test ends."""
    checkout = image / "nemo-rl"
    yield image
    if any(image.rglob(".fp32patch")):  # a test that failed half-way
        done = fp32patch("revert", "--envs", image / "ray_venvs", "-s", checkout)
        assert done.returncode == 0, done.stderr
    assert not any(image.rglob(".fp32patch"))
    write_checkout(checkout, NEWEST.name)


def test_the_layout_is_the_one_uv_and_pip_make(image):
    """Each venv reaches the checkout as its installer wrote it (the forms the rest of the module relies on)."""
    sites = {name: _site(image / "ray_venvs" / name) for name in ("vllm", "mcore", "fsdp")}
    for name, site in sites.items():
        info = json.loads((site / "nemo_rl-0.6.0.dist-info" / "direct_url.json").read_text())
        assert info["dir_info"] == {"editable": True} and info["url"] == (image / "nemo-rl").as_uri(), name
        assert not (site / "nemo_rl").exists()  # the files are the checkout's alone
    for name in ("vllm", "mcore"):
        assert list(sites[name].glob("__editable___nemo_rl_0_6_0_finder.py")), name
    (pth,) = sites["fsdp"].glob("__editable__.nemo_rl-0.6.0.pth")
    assert pth.read_text().strip() == str(image / "nemo-rl")
    assert (sites["mcore"] / "nemo_rl-0.6.0.dist-info" / "INSTALLER").read_text().strip() == "pip"
    assert (sites["vllm"] / "nemo_rl-0.6.0.dist-info" / "INSTALLER").read_text().strip() == "uv"


def test_the_recipe_word_for_word_applies_verifies_and_reverts(opt, tmp_path):
    """docs/nemo-rl.md's four lines on NeMo-RL's reworked shape (DTensor v1 still there): exit 0 each, the
    checkout patched once with -s's variant and bytes, one state folder (the checkout's), verify --envs lists
    it once, revert gives back every byte. (Before: each venv's route planned the checkout again in one chain,
    the second saw the first's markers, and the run refused with a not-applied row per venv, no cause and no
    command. The newest shape, refused as anchor-missing through the installs before, is the next test's.)"""
    doc = DOC.read_text()
    for command in RECIPE:
        assert command in doc, f"docs/nemo-rl.md no longer says `{command}`"
    checkout, venvs = opt / "nemo-rl", opt / "ray_venvs"
    write_checkout(checkout, NEWEST_WITH_V1.name)
    before = {"checkout": sources(checkout), **{v.name: sources(v) for v in venvs.iterdir()}}
    # what -s gives, in a copy of the checkout as it is
    alone = shutil.copytree(checkout, tmp_path / "nemo-rl")
    want = _json(fp32patch("apply", "-s", alone, "--json"))
    assert want["ok"], want

    for command in RECIPE:
        done = fp32patch(*line(command, opt))
        assert done.returncode == 0, f"{command}:\n{done.stdout}{done.stderr}"
        assert "Traceback" not in done.stderr

    patched = _json(fp32patch("verify", "--envs", venvs, "--json"))
    rows = [p for p in patched["patches"] if p["id"] in (FP32, CONTEXT)]
    assert sorted(p["id"] for p in rows) == [CONTEXT, FP32]  # the checkout once, not once per venv
    for p in rows:
        assert (p["status"], p["root"]) == ("applied", str(checkout)), p
        assert sorted(p["reached_from"]) == sorted(str(_site(v)) for v in venvs.iterdir()), p
        (planned,) = [w for w in want["patches"] if w["id"] == p["id"]]
        assert (planned["status"], p["variant"]) == ("applied", planned["variant"]), (planned, p)
    assert [p["variant"] for p in rows if p["id"] == FP32] == [NEWEST_WITH_V1.variant]
    vllm = {p["id"]: p for p in patched["patches"] if p["id"].startswith(("vllm", "nemotron"))}
    assert {p["status"] for p in vllm.values()} == {"applied"} and len(vllm) == 2
    # the bytes -s wrote, and one state folder: the checkout's
    assert _package(checkout) == _package(alone)
    states = sorted(p.parent for p in opt.rglob(".fp32patch"))
    assert states == sorted([checkout, _site(venvs / "vllm")])
    manifest = json.loads((checkout / ".fp32patch" / "manifest.json").read_text())
    assert sorted({e["patch"] for e in manifest["entries"]}) == [CONTEXT, FP32]

    table = fp32patch("verify", "--envs", venvs).stdout
    assert table.count(FP32) == 1 and table.count(CONTEXT) == 1, table

    done = fp32patch("revert", "--envs", venvs)
    assert done.returncode == 0, done.stderr
    assert {"checkout": sources(checkout), **{v.name: sources(v) for v in venvs.iterdir()}} == before
    assert not any(opt.rglob(".fp32patch"))


def test_a_checkout_spelled_many_ways_is_one_target_with_one_lock(opt, tmp_path):
    """A symlink, a trailing slash, a relative .pth line and a relative -s, all in one run: no hang, one
    target, one state folder, the same bytes as -s with its real path."""
    uv = _uv()
    checkout, venvs = opt / "nemo-rl", opt / "ray_venvs"
    link = opt / "nemo-rl-link"
    link.symlink_to(checkout)
    spelled = tmp_path / "more_venvs"
    try:
        # uv writes the spelling it was given into direct_url.json (the finder has the real path)
        _run(uv, "venv", "-q", "--seed", f"--python={sys.executable}", spelled / "linked")
        _run(uv, "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", "nemo-rl-link/",
             "--python", spelled / "linked", cwd=opt)  # fmt: skip
        url = json.loads((_site(spelled / "linked") / "nemo_rl-0.6.0.dist-info" / "direct_url.json").read_text())
        assert url["url"] == link.as_uri()
        # a .pth line relative to its site-packages, through the symlink, with a trailing slash
        _run(uv, "venv", "-q", f"--python={sys.executable}", spelled / "relative")
        site = _site(spelled / "relative")
        (site / "nemo_rl.pth").write_text(os.path.relpath(link, site) + "/\n")

        args = ["--envs", venvs, "--envs", spelled, "-s", f"{link}/", "-s", "opt/nemo-rl-link/../nemo-rl"]
        done = fp32patch("apply", *args, "--json", cwd=opt.parent, timeout=180)
        out = _json(done)
        assert done.returncode == 0, out
        rows = [p for p in out["patches"] if p["id"] in (FP32, CONTEXT)]
        assert len(rows) == 2 and {p["root"] for p in rows} == {str(checkout)}, rows
        assert {p["status"] for p in rows} == {"applied"}
        assert [p["variant"] for p in rows if p["id"] == FP32] == [NEWEST.variant]
        states = sorted(p.parent for p in opt.rglob(".fp32patch"))
        assert states == [checkout, _site(venvs / "vllm")]
        assert not any(spelled.rglob(".fp32patch"))
        verified = _json(fp32patch("verify", *args, "--json", cwd=opt.parent, timeout=180))
        assert verified["ok"] and [p["root"] for p in verified["patches"] if p["id"] == FP32] == [str(checkout)]
        done = fp32patch("revert", *args, cwd=opt.parent, timeout=180)
        assert done.returncode == 0, done.stderr
        assert not (checkout / ".fp32patch").exists()
    finally:
        link.unlink()


def test_a_refusal_through_many_venvs_names_its_cause_and_the_command(opt):
    """The checkout's anchor moved: exit 3 and nothing written, and the refusal says which anchor, in which
    file, and what to run, once, not a not-applied row per venv with no cause."""
    checkout, venvs = opt / "nemo-rl", opt / "ray_venvs"
    utils = checkout / "nemo_rl/models/policy/utils.py"
    utils.write_text(utils.read_text().replace("def validate_fp32_lm_head_config(", "def check_fp32_head_config("))
    before = {"checkout": sources(checkout), **{v.name: sources(v) for v in venvs.iterdir()}}
    alone = _json(fp32patch("apply", "-s", checkout, "--json"))
    args = ["--envs", venvs]
    done = fp32patch("apply", *args)
    assert done.returncode == 3, done.stdout + done.stderr
    (cause,) = [ln for ln in done.stderr.splitlines() if ln.startswith(f"{FP32} (anchor-missing)")]
    assert "validate_fp32_lm_head_config" in cause and "nemo_rl/models/policy/utils.py" in cause, cause
    assert "fp32patch check --against" in cause, cause
    out = _json(fp32patch("apply", *args, "--json"))
    (row,) = [p for p in out["patches"] if p["id"] == FP32]
    (same,) = [p for p in alone["patches"] if p["id"] == FP32]
    assert (row["status"], row["message"]) == (same["status"], same["message"])
    assert not [p for p in out["patches"] if p["status"] == "not-applied" and not p.get("message")]
    assert {"checkout": sources(checkout), **{v.name: sources(v) for v in venvs.iterdir()}} == before


@pytest.fixture
def pinned_vllm(opt) -> str:
    """The vLLM release the real checkout pins, its files in the vllm venv instead of 0.25.1's (put back after)."""
    import re

    from tests.support.pypi import import_root_from_members

    real = Path(os.environ["FP32PATCH_NEMO_RL_CHECKOUT"])
    pins = re.findall(r"vllm==(\d+\.\d+\.\d+)", (real / "pyproject.toml").read_text())
    version = pins[0] if pins else VLLM
    site = _site(opt / "ray_venvs" / "vllm")
    kept = opt.parent / "kept-vllm"
    kept.mkdir()
    for path in [site / "vllm", *site.glob("vllm-*.dist-info")]:
        shutil.move(path, kept / path.name)
    import_root_from_members("vllm", version, [NEMOTRON, LOGITS_PROCESSOR], site)
    yield version
    for path in [site / "vllm", *site.glob("vllm-*.dist-info")]:
        shutil.rmtree(path)
    for path in kept.iterdir():
        shutil.move(path, site / path.name)
    kept.rmdir()


@pytest.mark.skipif(
    not os.environ.get("FP32PATCH_NEMO_RL_CHECKOUT"),
    reason="set FP32PATCH_NEMO_RL_CHECKOUT to a NeMo-RL checkout to run the recipe over its own files",
)
def test_the_recipe_over_a_real_checkout(opt, pinned_vllm):
    """The recipe over a real NeMo-RL checkout's files (nemo_rl/), reached through the three editable installs,
    with the vLLM release it pins in the vllm venv: exit 0 each, -s's variants, verify once, every byte back."""
    real = Path(os.environ["FP32PATCH_NEMO_RL_CHECKOUT"])
    files = {
        p.relative_to(real).as_posix(): p.read_text()
        for p in sorted((real / "nemo_rl").rglob("*.py"))
        if "__pycache__" not in p.parts
    }
    checkout, venvs = opt / "nemo-rl", opt / "ray_venvs"
    write_checkout(checkout, "", files)
    before = {"checkout": sources(checkout), **{v.name: sources(v) for v in venvs.iterdir()}}
    want = _json(fp32patch("apply", "-s", checkout, "--dry-run", "--json", timeout=900))
    for command in RECIPE:
        done = fp32patch(*line(command, opt), timeout=900)
        assert done.returncode == 0, f"{command}:\n{done.stdout}{done.stderr}"
    out = _json(fp32patch("verify", "--envs", venvs, "--json", timeout=900))
    rows = {p["id"]: p for p in out["patches"] if p["status"] != "not-installed"}
    for planned in want["patches"]:
        if planned["status"] == "would-apply":
            assert (rows[planned["id"]]["status"], rows[planned["id"]]["variant"]) == ("applied", planned["variant"])
    print(f"vLLM {pinned_vllm}:", {i: (p["status"], p.get("variant"), p["root"]) for i, p in rows.items()})
    assert fp32patch("revert", "--envs", venvs, timeout=900).returncode == 0
    assert {"checkout": sources(checkout), **{v.name: sources(v) for v in venvs.iterdir()}} == before
