"""Where targets are found: editable installs, source checkouts, unknown versions; and how
output looks to a terminal (colour follows the terminal, FORCE_COLOR and NO_COLOR)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import NEMOTRON
from tests.support.pypi import wheel_members

pytestmark = pytest.mark.network
PATCH = "nemotron-h-fp32-lm-head"


def _entry(out: dict) -> dict:
    return next(p for p in out["patches"] if p["id"] == PATCH)


def _checkout(where: Path, version: str) -> Path:
    """A source tree holding a release's real nemotron_h.py (as a git checkout would)."""
    src = wheel_members("vllm", version, [NEMOTRON])
    (where / NEMOTRON).parent.mkdir(parents=True)
    shutil.copyfile(src / NEMOTRON, where / NEMOTRON)
    return where


def test_editable_install_is_followed_to_its_project(tmp_path, cli):
    project = _checkout(tmp_path / "vllm-src", "0.33.0")
    site = tmp_path / "site-packages"
    info = site / "vllm-0.33.0.dist-info"
    info.mkdir(parents=True)
    shutil.copyfile(
        wheel_members("vllm", "0.33.0", [NEMOTRON]) / "vllm-0.33.0.dist-info" / "METADATA", info / "METADATA"
    )
    (info / "direct_url.json").write_text(json.dumps({"url": project.as_uri(), "dir_info": {"editable": True}}))
    original = (project / NEMOTRON).read_bytes()

    code, out = cli.json("apply", "-s", site)
    assert code == 0
    entry = _entry(out)
    # the checkout is searched as -s names it: its own release (none here: no metadata of its own), not the
    # dist-info beside the install, which is as old as the install while the checkout moves on
    assert (entry["status"], entry["version"], entry["path"]) == ("applied", None, str(project / NEMOTRON))
    assert (entry["root"], entry["reached_from"]) == (str(project), [str(site)])
    assert (project / ".fp32patch" / "manifest.json").exists()  # state lives with the files
    assert not (site / ".fp32patch").exists()
    code, out = cli.json("verify", "-s", site)
    assert code == 0 and _entry(out)["status"] == "applied"
    assert cli("revert", "-s", site).exit_code == 0
    assert (project / NEMOTRON).read_bytes() == original


def test_source_checkout_with_a_static_version(tmp_path, cli):
    root = _checkout(tmp_path / "vllm", "0.10.2")
    (root / "pyproject.toml").write_text('[project]\nname = "vllm"\nversion = "0.10.2"\n')
    code, out = cli.json("apply", "-s", root)
    assert code == 0
    entry = _entry(out)
    assert (entry["version"], entry["variant"]) == ("0.10.2", "with-sampling-metadata")


def test_unknown_version_picks_the_variant_whose_anchors_hold(tmp_path, cli):
    for version, variant in (("0.10.2", "with-sampling-metadata"), ("0.33.0", "hidden-states-only")):
        root = _checkout(tmp_path / version, version)  # no metadata at all
        code, out = cli.json("apply", "-s", root)
        assert code == 0
        entry = _entry(out)
        assert (entry["version"], entry["variant"]) == (None, variant)


def _run(root: Path, **env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "FORCE_COLOR", "TERM")}
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "fp32patch", "status", "-s", str(root)], capture_output=True, text=True, env=environ
    ).stdout


def test_colour_follows_the_terminal_force_color_and_no_color(tmp_path):
    root = _checkout(tmp_path / "vllm", "0.33.0")
    assert "\x1b[" not in _run(root)  # piped: plain text
    coloured = _run(root, FORCE_COLOR="1", TERM="xterm-256color")
    assert "\x1b[33m" in coloured or "\x1b[38;" in coloured  # the yellow "not-applied"
    plain = _run(root, FORCE_COLOR="1", NO_COLOR="1", TERM="xterm-256color")
    assert "not-applied" in plain and "\x1b[33m" not in plain and "\x1b[38;" not in plain
