"""Spying on a call a test wants to see made: what it was given, and the real call after."""

from __future__ import annotations

from typing import Any


def keyword_arguments(monkeypatch: Any, owner: Any, name: str) -> dict:
    """Replace ``owner.name`` (for the test) with a wrapper that records the keyword arguments of
    its calls into the returned dict (the last call's win) and calls the real one."""
    seen: dict = {}
    real = getattr(owner, name)

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return seen
