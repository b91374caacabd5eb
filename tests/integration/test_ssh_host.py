"""The SSH host against a real sshd on loopback: a with block closes its connection, and a wrong
key, an unknown host key and a closed port each fail as their own error (what both hosts do alike:
test_hosts.py)."""

from __future__ import annotations

import pytest

from eyas.config import HostConfig
from eyas.server.hosts import HostAuthError, HostError, HostUnreachable, LocalHost, make_host
from eyas.server.ssh_host import SSHHost
from tests.sshd import ssh_config


def test_with_block_closes_the_ssh_connection_even_when_it_raises(sshd):
    with make_host(ssh_config(sshd)) as h:
        assert isinstance(h, SSHHost) and h.run("echo in").stdout == "in\n"
        assert h._conn.is_connected
    assert not h._conn.is_connected
    with pytest.raises(HostError, match="exit 4"):
        with make_host(ssh_config(sshd)) as h:
            h.run("exit 4")
    assert not h._conn.is_connected
    with make_host(HostConfig(name="here")) as local:
        assert isinstance(local, LocalHost) and local.run("echo ok").stdout == "ok\n"


def test_ssh_wrong_key_is_an_auth_error(sshd):
    h = SSHHost(ssh_config(sshd, key_filename=sshd.other_key))
    with pytest.raises(HostAuthError):
        h.run("true")


def test_ssh_unknown_host_key_is_refused(sshd, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    with pytest.raises(HostAuthError, match="unknown host key"):
        SSHHost(ssh_config(sshd, known_hosts=empty)).run("true")


def test_ssh_closed_port_is_unreachable(sshd):
    from eyas.net import free_port

    with pytest.raises(HostUnreachable):
        SSHHost(ssh_config(sshd, port=free_port())).run("true")
