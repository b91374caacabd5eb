"""A free TCP port, for servers started on this machine (the local server's replicas, a temporary
Prefect server, tests and benchmarks)."""

from __future__ import annotations

import socket


def free_port(bind: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `bind` right now."""
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]
