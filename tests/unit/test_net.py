"""eyas/net.py: a free loopback port is one a listener can bind."""

from __future__ import annotations

import socket

from eyas.net import free_port


def test_free_port_is_bindable():
    port = free_port()
    assert 1024 <= port <= 65535
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # OSError (in use) would fail the test
        s.listen()
        assert s.getsockname()[1] == port
