"""Fixtures of the megatron-core suite (runs under the heavy `megatron` environment)."""

from __future__ import annotations

import pytest
from megatron_harness import close_parallel, free_port, init_parallel


@pytest.fixture(scope="session")
def tp1():
    """This process as a one-rank gloo world: tensor parallel size 1."""
    init_parallel(0, 1, free_port())
    yield
    close_parallel()
