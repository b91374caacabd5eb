"""What both hosts, this machine and SSH to a real sshd, do alike: run, start detached, read, copy
(the SSH host's own errors: test_ssh_host.py)."""

import os
import signal
import time

import pytest

from eyas.server.hosts import HostError, LocalHost, wait_dead
from eyas.server.ssh_host import SSHHost
from tests.sshd import ssh_config


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
    pid = host.start(
        "sh -c 'echo started $GREETING; sleep 60 & sleep 60'",
        log_path=log,
        env={"GREETING": "hi"},
        cwd=tmp_path,
    )
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
