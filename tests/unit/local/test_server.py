"""The local server's HTTP front in process (the server as a subprocess:
tests/integration/test_local_server.py)."""

from __future__ import annotations

import socket

from eyas.local.server import _HTTPServer


def test_tens_of_clients_connecting_at_once_wait_in_the_accept_queue():
    """64 connections complete their handshake before the server accepts any: socketserver's own
    backlog of 5 drops the seventh's SYN, which its kernel retries a second or more later
    (regeneration keeps 32 requests in flight per server, and several clients may share one)."""
    from http.server import BaseHTTPRequestHandler

    httpd = _HTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    socks = []
    try:
        for _ in range(64):
            socks.append(socket.create_connection(httpd.server_address, timeout=0.5))
    finally:
        for s in socks:
            s.close()
        httpd.server_close()
    assert len(socks) == 64
