import os
import signal
import time

import pytest

from eyas.config import HostConfig
from eyas.server.hosts import HostAuthError, HostError, HostUnreachable, LocalHost, make_host, wait_dead
from eyas.server.ssh_host import SSHHost


def ssh_config(sshd, **kw) -> HostConfig:
    base = dict(kind="ssh", name="loopback", hostname="127.0.0.1", port=sshd.port, user=sshd.user,
                key_filename=sshd.client_key, known_hosts=sshd.known_hosts, connect_timeout_s=5)
    return HostConfig(**{**base, **kw})



@pytest.fixture(params=["local", "ssh"])
def host(request, tmp_path):
    if request.param == "local":
        yield LocalHost()
        return
    h = SSHHost(ssh_config(request.getfixturevalue("sshd")))
    yield h
    h.close()


def test_run_returns_output_and_raises_on_failure(host):
    assert host.run("echo hello").stdout == "hello\n"
    assert host.run("exit 3", check=False).exit_code == 3
    with pytest.raises(HostError) as e:
        host.run("echo oops >&2; exit 7")
    assert e.value.exit_code == 7 and "oops" in str(e.value)


def test_run_passes_env(host):
    assert host.run("echo $EYAS_X", env={"EYAS_X": "a b"}).stdout.strip() == "a b"


def test_start_is_detached_and_kill_group_reaches_children(host, tmp_path):
    log = tmp_path / "logs" / "bg.log"
    t0 = time.monotonic()
    pid = host.start("sh -c 'echo started $GREETING; sleep 60 & sleep 60'", log_path=log,
                     env={"GREETING": "hi"}, cwd=tmp_path)
    assert time.monotonic() - t0 < 5  # returns at once, not when the command ends
    assert host.is_alive(pid)
    deadline = time.monotonic() + 5
    while b"started hi" not in log.read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert log.read_bytes() == b"started hi\n"
    children = host.run(f"pgrep -g {pid}").stdout.split()
    assert len(children) >= 2  # sh plus its two sleeps share the group
    host.kill_group(pid, signal.SIGTERM)
    assert wait_dead(host, pid, 5)
    deadline = time.monotonic() + 5
    while host.run(f"pgrep -g {pid}", check=False).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert host.run(f"pgrep -g {pid}", check=False).stdout.strip() == ""


def test_read_from_offset_is_incremental(host, tmp_path):
    path = tmp_path / "log"
    assert host.read_from(path, 0) == (b"", 0)  # not written yet is not an error
    path.write_bytes(b"abc\rdef")
    data, off = host.read_from(path, 0)
    assert (data, off) == (b"abc\rdef", 7)
    with open(path, "ab") as f:
        f.write(b"\nxyz")
    assert host.read_from(path, off) == (b"\nxyz", 11)


def test_put_and_get_round_trip(host, tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(10000))
    host.put(src, tmp_path / "remote" / "copy.bin")
    host.get(tmp_path / "remote" / "copy.bin", tmp_path / "back" / "copy.bin")
    assert (tmp_path / "back" / "copy.bin").read_bytes() == src.read_bytes()


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
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(HostUnreachable):
        SSHHost(ssh_config(sshd, port=closed)).run("true")


def test_ssh_config_requires_known_hosts():
    with pytest.raises(ValueError, match="known_hosts"):
        HostConfig(kind="ssh", hostname="gpu-node-1")
