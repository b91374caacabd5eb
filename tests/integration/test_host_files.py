"""The Host seam's file methods (list_dir, read_file, remove_tree): this machine and a real sshd."""

import os

import pytest

from eyas.config import HostConfig
from eyas.net import free_port
from eyas.server import ssh_host
from eyas.server.hosts import HostError, HostUnreachable, LocalHost
from eyas.server.ssh_host import SSHHost


def _ssh_host(sshd) -> SSHHost:
    return SSHHost(
        HostConfig(
            kind="ssh",
            name="loopback",
            hostname="127.0.0.1",
            port=sshd.port,
            user=sshd.user,
            key_filename=sshd.client_key,
            known_hosts=sshd.known_hosts,
            connect_timeout_s=5,
        )
    )


@pytest.fixture(params=["local", pytest.param("ssh", marks=pytest.mark.ssh)])
def host(request):
    h = LocalHost() if request.param == "local" else _ssh_host(request.getfixturevalue("sshd"))
    yield h
    h.close()


def test_list_read_and_remove_a_tree(host, tmp_path):
    tree = tmp_path / "dump"
    (tree / "r-1" / "sub").mkdir(parents=True)
    data = os.urandom(3 << 20) + b"end"  # several SFTP requests' worth
    (tree / "r-1" / "0000000000.safetensors").write_bytes(data)
    (tree / "r-1" / ".tmp").write_bytes(b"x")
    (tree / "r-1" / "sub" / "f").write_bytes(b"y")
    (tree / "keep").write_bytes(b"z")

    assert host.list_dir(tree) == ["keep", "r-1"]
    assert host.list_dir(tree / "r-1") == [".tmp", "0000000000.safetensors", "sub"]
    assert host.list_dir(tmp_path / "absent") is None
    assert host.read_file(tree / "r-1" / "0000000000.safetensors") == data
    assert host.read_file(tree / "r-1" / "empty-or-absent") is None
    (tree / "empty").write_bytes(b"")
    assert host.read_file(tree / "empty") == b""

    assert host.remove_tree(tree / "r-1") == 3
    assert not (tree / "r-1").exists() and (tree / "keep").read_bytes() == b"z"
    assert host.remove_tree(tree / "r-1") == 0  # gone already: nothing to do
    assert host.remove_tree(tree / "keep") == 0  # a file is not a tree: left alone
    assert (tree / "keep").exists()


def test_a_large_file_streams_through_cat_over_ssh(host, tmp_path, monkeypatch):
    monkeypatch.setattr(ssh_host, "STREAM_BYTES", 1 << 20)  # the exec-channel path, on a small file
    data = os.urandom((2 << 20) + 5)
    (tmp_path / "big").write_bytes(data)
    (tmp_path / "odd name's").write_bytes(data)
    assert (
        host.read_file(tmp_path / "big") == data and host.read_file(tmp_path / "odd name's") == data
    )


def test_reading_a_folder_is_an_error_naming_the_host(host, tmp_path):
    with pytest.raises(HostError, match=rf"\[{host.name}\]") as e:
        host.read_file(tmp_path)
    assert not isinstance(e.value, HostUnreachable)  # an answer about the path, not a lost host


@pytest.mark.ssh
def test_a_dropped_connection_reconnects_and_a_closed_port_is_unreachable(sshd, tmp_path):
    host = _ssh_host(sshd)
    try:
        (tmp_path / "f").write_bytes(b"data")
        assert host.read_file(tmp_path / "f") == b"data"
        host._conn.client.get_transport().close()  # the connection dies under the open SFTP channel
        assert host.list_dir(tmp_path) == ["f"]  # the next call connects again
    finally:
        host.close()
    gone = SSHHost(
        HostConfig(
            kind="ssh",
            name="gone",
            hostname="127.0.0.1",
            port=free_port(),
            user=sshd.user,
            key_filename=sshd.client_key,
            known_hosts=sshd.known_hosts,
            connect_timeout_s=5,
        )
    )
    with pytest.raises(HostUnreachable, match=r"\[gone\]"):
        gone.list_dir(tmp_path)
