"""Shared fixtures for the main suite (runs in .venv)."""

from __future__ import annotations

# tests/heavy/<env>/ run under their own interpreters (see Makefile, tests/envs/build.py).
collect_ignore = ["heavy"]
