"""eyas/server/ownership.py: who a launch handle names, read from this machine's process table."""

import subprocess

from eyas.server.hosts import LocalHost
from eyas.server.launch import ServerHandle
from eyas.server.ownership import Owner, verdict


def test_verdict_tells_the_launched_process_from_a_reused_pid():
    host = LocalHost()
    p = subprocess.Popen(["sleep", "300"], start_new_session=True)  # its own group: pgrp == pid
    try:
        me = host.process_identity(p.pid)
        assert verdict(host, ServerHandle(p.pid, boot=me.boot, start=me.start)) == "alive"
        assert (
            verdict(host, ServerHandle(p.pid, boot=me.boot, start=str(int(me.start) + 1)))
            == "replaced"
        )
        assert verdict(host, ServerHandle(p.pid, boot="another-boot", start=me.start)) == "replaced"
        assert (
            verdict(host, ServerHandle(p.pid)) == "unverified"
        )  # no identity: the command line decides
    finally:
        p.kill()
        p.wait(10)
    assert verdict(host, ServerHandle(p.pid, boot=me.boot, start=me.start)) == "gone"


def test_a_process_that_leads_no_group_is_not_the_server():
    host = LocalHost()
    p = subprocess.Popen(["sleep", "300"])  # in this test's process group: a server leads its own
    try:
        me = host.process_identity(p.pid)
        assert me.pgrp != p.pid
        assert verdict(host, ServerHandle(p.pid, boot=me.boot, start=me.start)) == "replaced"
    finally:
        p.kill()
        p.wait(10)


def test_an_owner_keeps_its_runs_in_order_without_blanks():
    owner = Owner.new(["run-1", None, "", "run-0"])
    assert (
        owner.runs == ("run-1", "run-0")
        and len(owner.token) == 32
        and owner != Owner.new(["run-1", "run-0"])
    )
