"""SkyRL 0.4.0 on Python 3.11 (it declares 3.12; every file of it compiles on 3.11): its Tinker
types (``skyrl.tinker.types``, imported by ``skyrl.backends``) are pydantic models over
``typing.TypedDict``, which pydantic refuses below 3.12. ``typing_extensions.TypedDict`` is the
same class on 3.12; the runs put it in ``typing`` before they import SkyRL (``site/sitecustomize.py``
in every process of a server, whose engine core and workers import SkyRL's worker extension). Nothing else of
SkyRL needs 3.12 on the paths the suite runs."""

from __future__ import annotations


def allow_skyrl() -> None:
    import sys
    import typing

    if sys.version_info < (3, 12):
        import typing_extensions

        typing.TypedDict = typing_extensions.TypedDict  # type: ignore[misc]
