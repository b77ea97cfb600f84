"""Fixtures of the megatron-core suite (runs under the heavy `megatron` environment)."""

from __future__ import annotations

import pytest
from megatron_harness import close_parallel, init_parallel

from tests.support.rendezvous import file_store


@pytest.fixture(scope="session")
def tp1():
    """This process as a one-rank gloo world: tensor parallel size 1."""
    with file_store() as init_method:
        init_parallel(0, 1, init_method)
        yield
        close_parallel()
