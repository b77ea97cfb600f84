"""Where a test's ranks meet: a ``file://`` store in a folder of its own, never a port.

A free port found by binding to port 0 and closing the socket is only free until someone else
takes it: on a busy machine another process did, before rank 0's gloo store listened
(``EADDRINUSE``), and one spawn of the megatron suite failed 52 tests. torch's file store needs
no port at all: every rank opens the same file (``init_method="file://..."``), which must be
new for each process group, hence a temporary folder per group that goes away with it.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_store() -> Iterator[str]:
    """An ``init_method`` for one process group (every rank of it gets the same string)."""
    with tempfile.TemporaryDirectory(prefix="fp32patch-rendezvous-") as folder:
        yield Path(folder, "store").as_uri()


def init_gloo(rank: int, world: int, init_method: str, **kwargs) -> None:
    """The default process group over gloo, met at ``init_method`` (from ``file_store``)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, **kwargs)


# A server's listening port (vLLM's and TRL's HTTP servers) cannot be a file: the port is found free
# here and the server binds it later, so it may be lost in between. A server that lost it exits saying
# so at startup; its caller starts it again on another port (``SERVER_TRIES`` in all).
SERVER_TRIES = 3


def server_port() -> int:
    """A port that was free a moment ago, for a server that binds it itself (see ``lost_the_port``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lost_the_port(log: str) -> bool:
    """Whether a server's log says another process took its port first."""
    return "Address already in use" in log or "EADDRINUSE" in log or "[Errno 98]" in log
