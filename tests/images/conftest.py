"""Real OCI images, built with rootful podman (buildah inside, runc, chroot isolation) on a base
made from Debian's packages: ``make test-images`` (FP32PATCH_IMAGES=1 python -m pytest tests/images).

No registry is reachable here, so the base is made locally (``mmdebstrap``: Debian trixie's
minbase with Python 3.13, cached as a tarball under ``$FP32PATCH_TEST_CACHE/images``) and a
vendor's image is stood in for by a Dockerfile FROM that base that installs the vendor's real
wheels (tests/images/*.Dockerfile say which). Storage lives in a folder of this session's own
(``--root``/``--runroot``) and is removed afterwards, with every image in it; builds use the
host's network (``--network host``: no bridge, no iptables chains) with the host's CA bundle
mounted read-only (not saved in any layer), runs use none. podman's default runtime, crun,
fails on these machines (cgroups in hybrid mode); runc works. Where podman cannot run (not
installed, not root), the suite skips and says why; ``make test-images`` installs it first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.pypi import _locked, cache_root

BASE = "localhost/fp32patch-test/debian-python"
CA = "/etc/ssl/certs/ca-certificates.crt"
# --format=tar: mmdebstrap reads the format from the target's name otherwise, and the partial file's
# name (".partial") made it write a directory, which `podman import` then refused
MMDEBSTRAP = [
    "mmdebstrap", "--variant=minbase", "--format=tar", "--include=python3,python3-venv,python3-pip,ca-certificates",
    "trixie",
]  # fmt: skip


def why_not() -> str | None:
    """Why podman cannot build images here, or None."""
    missing = [tool for tool in ("podman", "runc", "mmdebstrap") if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not installed (make test-images installs podman buildah runc mmdebstrap with apt-get)"
    if os.geteuid() != 0:
        return "rootful podman needs root (the suite builds with --isolation chroot, as root)"
    return None


class Podman:
    def __init__(self, storage: Path):
        self.storage = storage
        self.prefix = [
            "podman",
            "--root",
            str(storage / "root"),
            "--runroot",
            str(storage / "run"),
            "--storage-driver",
            "overlay",
            "--runtime",
            "runc",
        ]

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([*self.prefix, *args], capture_output=True, text=True)
        if check and result.returncode:
            raise AssertionError(
                f"exit {result.returncode}: podman {' '.join(args)}\n{result.stdout[-8000:]}\n{result.stderr[-8000:]}"
            )
        return result

    def build(self, tag: str, context: Path, dockerfile: str, check: bool = True) -> subprocess.CompletedProcess:
        (context / "Dockerfile").write_text(dockerfile)
        args = ["build", "--isolation", "chroot", "--network", "host", "-t", tag]
        if Path(CA).exists():
            args += ["-v", f"{CA}:{CA}:ro"]
        return self(*args, str(context), check=check)

    def run(self, image: str, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        limits = ["--ulimit", "nofile=20000:20000", "--ulimit", "nproc=32768:32768"]
        return self("run", "--rm", "--network", "none", *limits, image, *command, check=check)


def base_tarball() -> Path:
    """Debian trixie's minbase with Python, made once by mmdebstrap and kept in the test cache."""
    tarball = cache_root() / "images" / "debian-trixie-python.tar"
    if tarball.is_file():
        return tarball
    if tarball.is_dir():  # what an earlier run without --format=tar left: made again
        shutil.rmtree(tarball)
    tarball.parent.mkdir(parents=True, exist_ok=True)
    with _locked("images-base"):
        if not tarball.is_file():
            partial = tarball.with_name(f".{tarball.name}.partial")
            subprocess.run([*MMDEBSTRAP, str(partial)], check=True, capture_output=True)
            os.replace(partial, tarball)
    return tarball


@pytest.fixture(scope="session")
def podman(tmp_path_factory):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    storage = tmp_path_factory.mktemp("podman")
    engine = Podman(storage)
    # what podman writes outside --root/--runroot (its blob-info cache, its network folder): removed
    # afterwards where this session made it
    made_here = [Path(p) for p in ("/var/lib/containers", "/run/containers") if not Path(p).exists()]
    try:
        engine("import", str(base_tarball()), BASE)
        yield engine
    finally:
        engine("rmi", "--all", "--force", check=False)
        engine("system", "reset", "--force", check=False)
        shutil.rmtree(storage, ignore_errors=True)
        for path in made_here:
            shutil.rmtree(path, ignore_errors=True)
