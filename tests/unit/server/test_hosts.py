"""eyas/server/hosts.py on this machine: the seam as a context manager, names checked before a shell
sees them, and the process-table parsing every stop relies on. (Over SSH:
tests/integration/test_hosts.py.)"""

import os

import pytest

from eyas.config import HostConfig
from eyas.server.hosts import HostError, LocalHost, alive_from_status, env_exports, make_host


def test_a_with_block_hands_back_the_host_and_keeps_the_blocks_error():
    with make_host(HostConfig(name="here")) as host:
        assert isinstance(host, LocalHost) and host.name == "here"
        assert host.run("echo $EYAS_X", env={"EYAS_X": "a b"}).stdout == "a b\n"
    with pytest.raises(HostError, match=r"\[here\] command failed \(exit 3\)"):
        with make_host(HostConfig(name="here")) as host:
            host.run("exit 3")


def test_environment_names_are_checked_and_values_quoted():
    assert env_exports({"A": "x y", "B_2": "$(rm -rf /)"}) == "A='x y' B_2='$(rm -rf /)'"
    for bad in ("A B", "1A", "A;rm", "$A"):
        with pytest.raises(ValueError):
            env_exports({bad: "1"})


def test_this_process_has_an_identity_and_a_gone_pid_has_none():
    host = LocalHost()
    me = host.process_identity(os.getpid())
    assert me is not None and not me.zombie and me.start.isdigit() and me.argv
    assert host.machine_identity()[0]
    assert host.process_identity(2**22 + 12345) is None  # above any pid_max


def test_a_zombie_is_dead_only_once_its_threads_are_gone():
    assert alive_from_status("Name:\tx\nState:\tS (sleeping)\nThreads:\t1\n")
    assert not alive_from_status("Name:\tx\nState:\tZ (zombie)\nThreads:\t1\n")
    assert alive_from_status(
        "Name:\tx\nState:\tZ (zombie)\nThreads:\t3\n"
    )  # may still hold the port
