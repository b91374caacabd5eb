"""Issue 16.5: host keys over a real sshd. `insecure_accept_any_host_key` still reads known_hosts
and refuses a key that contradicts it (only unlisted hosts are accepted, with a warning at every
connection, and never written to the file); a missing known_hosts file is a configuration error that
names the path and the field, and the launch task does not retry it."""

import logging
import time

import pytest
from eyas_prefect.tasks.server import launch_server
from prefect import flow

from eyas.config import HostConfig
from eyas.server.hosts import HostAuthError, HostConfigError, make_host
from eyas.server.ssh_host import SSHHost
from tests.stage_config import ROOT, stage_config

WARNS = "eyas.server.ssh_host"


def ssh(sshd, **kw) -> HostConfig:
    base = dict(
        kind="ssh",
        name="loopback",
        hostname="127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        key_filename=sshd.client_key,
        known_hosts=sshd.known_hosts,
        connect_timeout_s=5,
    )
    return HostConfig(**{**base, **kw})


def _warnings(caplog) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == WARNS and r.levelno == logging.WARNING
    ]


def test_insecure_still_refuses_a_key_that_contradicts_known_hosts(sshd, tmp_path):
    wrong = tmp_path / "known_hosts"
    other = (sshd.other_key.with_suffix(".pub")).read_text().split()
    wrong.write_text(f"[127.0.0.1]:{sshd.port} {other[0]} {other[1]}\n")
    for insecure in (False, True):
        host = SSHHost(ssh(sshd, known_hosts=wrong, insecure_accept_any_host_key=insecure))
        with pytest.raises(HostAuthError, match="host key mismatch"):
            host.run("true")
        host.close()


def test_insecure_connects_to_a_listed_host_as_strict_mode_does_with_a_warning_each_time(
    sshd, caplog
):
    caplog.set_level(logging.WARNING, logger=WARNS)
    host = SSHHost(ssh(sshd, insecure_accept_any_host_key=True))
    try:
        assert host.run("echo ok").stdout == "ok\n"
        host.close()
        assert host.run("echo again").stdout == "again\n"  # a second connection
    finally:
        host.close()
    connects = [m for m in _warnings(caplog) if "insecure_accept_any_host_key: true" in m]
    assert len(connects) == 2 and all("[loopback]" in m for m in connects)
    assert not [
        m for m in _warnings(caplog) if "accepting the unlisted host key" in m
    ]  # it was listed


@pytest.mark.parametrize("listed", ["other host", "no file"])
def test_insecure_accepts_an_unlisted_host_with_a_warning_and_writes_nothing(
    sshd, tmp_path, caplog, listed
):
    caplog.set_level(logging.WARNING, logger=WARNS)
    known = None
    if listed == "other host":
        known = tmp_path / "known_hosts"
        line = sshd.known_hosts.read_text().replace(f"[127.0.0.1]:{sshd.port}", "[10.9.8.7]:22")
        known.write_text(line)
    host = SSHHost(ssh(sshd, known_hosts=known, insecure_accept_any_host_key=True))
    try:
        assert host.run("echo ok").stdout == "ok\n"
    finally:
        host.close()
    accepted = [m for m in _warnings(caplog) if "accepting the unlisted host key" in m]
    assert (
        len(accepted) == 1
        and f"[127.0.0.1]:{sshd.port}" in accepted[0]
        and "ssh-ed25519" in accepted[0]
    )
    if known is not None:
        assert known.read_text() == line  # never trust-on-first-use into the operator's file
    # strict mode refuses the same unlisted host
    if known is not None:
        with pytest.raises(HostAuthError, match="unknown host key"):
            SSHHost(ssh(sshd, known_hosts=known)).run("true")


@pytest.mark.parametrize("insecure", [False, True])
def test_a_missing_known_hosts_file_is_a_configuration_error_naming_path_and_field(
    tmp_path, insecure
):
    missing = tmp_path / "nowhere" / "known_hosts"
    cfg = HostConfig(
        kind="ssh",
        name="gpu-node-1",
        hostname="127.0.0.1",
        port=2,
        known_hosts=missing,
        insecure_accept_any_host_key=insecure,
    )
    with pytest.raises(HostConfigError) as e:
        make_host(cfg)
    assert isinstance(e.value, HostAuthError)  # the never-retried kind
    assert str(missing) in str(e.value) and "server.host.known_hosts" in str(e.value)
    with pytest.raises(HostConfigError, match=r"training\.distributed\.hosts\[1\]\.known_hosts"):
        make_host(cfg, "training.distributed.hosts[1]")


@flow
def _launch_once(cfg):
    state = launch_server(cfg, return_state=True)
    return state.is_failed(), state.state_details.task_run_id, state.result(raise_on_failure=False)


def test_the_launch_task_does_not_retry_a_missing_known_hosts(prefect_harness, tmp_path):
    from prefect.client.orchestration import get_client

    missing = tmp_path / "known_hosts"
    cfg = stage_config(
        tmp_path,
        ROOT / "fixtures" / "tiny-target",
        **{
            "server.host": {
                "kind": "ssh",
                "name": "gpu-node-1",
                "hostname": "127.0.0.1",
                "port": 2,
                "known_hosts": str(missing),
            }
        },
    )
    t0 = time.monotonic()
    failed, task_run_id, error = _launch_once(cfg)
    assert failed and time.monotonic() - t0 < 5  # the first retry would wait 5 s
    assert isinstance(error, HostConfigError) and str(missing) in str(error)
    from prefect.exceptions import ObjectNotFound

    deadline = (
        time.monotonic() + 20
    )  # the server records a task run from its events, a moment later
    with get_client(sync_client=True) as client:
        while True:
            try:
                run = client.read_task_run(task_run_id)
                if run.state is not None and run.state.is_final():
                    break
            except ObjectNotFound:
                pass
            assert time.monotonic() < deadline, "the task run never reached the server"
            time.sleep(0.2)
    assert run.run_count == 1
