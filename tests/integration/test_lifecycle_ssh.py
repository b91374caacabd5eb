"""Patch, launch, sense and stop over a real SSH connection, against the local target server."""

import json
import sys

import pytest

from eyas.server import readiness, sglang_patch
from eyas.server.launch import capture_launch, start_server, stop_server
from eyas.server.ssh_host import SSHHost
from tests.sshd import ssh_host_fields
from tests.stage_config import stage_config

pytestmark = pytest.mark.ssh


def ssh_stage_config(tmp, sshd, target, **extra):
    host = ssh_host_fields(sshd)
    return stage_config(
        tmp,
        target,
        **{
            "server.host": host,
            "server.python": sys.executable,
            "server.url_host": "127.0.0.1",
            "server.env": {"OMP_NUM_THREADS": "1"},
            **extra,
        },
    )


def _sense(host, cfg, handle, **kw):
    args = dict(
        log_path=handle.log_path,
        pid=handle.pid,
        url=handle.url,
        start_offset=handle.log_offset,
        poll_interval_s=0.2,
        stall_timeout_s=30,
        deadline_s=120,
        http_timeout_s=5,
    )
    return readiness.wait_until_ready(host, **{**args, **kw})


def test_patch_launch_sense_stop_over_ssh(tmp_path, sshd, random_target):
    cfg = ssh_stage_config(tmp_path, sshd, random_target)
    host = SSHHost(cfg.server.host)
    try:
        assert sglang_patch.ensure_patched(host, cfg).status == "not needed"
        handle = start_server(host, capture_launch(cfg))
        try:
            progress = []
            report = _sense(host, cfg, handle, on_progress=progress.append)
            assert report.shards_total == len(list(random_target.glob("*.safetensors")))
            assert progress and progress[-1].done == progress[-1].total
            record = json.loads((cfg.server.workdir / "server.pid").read_text())
            # who the server is, read from the SSH host's process table: what every stop checks
            # first
            assert record["pid"] == handle.pid and record["start"] and record["boot"]
            assert host.process_identity(handle.pid).start == record["start"]
        finally:
            outcome = stop_server(host, capture_launch(cfg), handle)
        assert outcome["outcome"] in ("terminated", "killed")
        assert not host.is_alive(handle.pid) and not cfg.server.dump_dir.exists()
    finally:
        host.close()


def test_a_crash_over_ssh_is_reported_with_the_log(tmp_path, sshd, random_target):
    cfg = ssh_stage_config(
        tmp_path,
        sshd,
        random_target,
        **{"server.launch_args": ["--fault", "oom-at-shard", "--fault-shard", "2"]},
    )
    host = SSHHost(cfg.server.host)
    try:
        handle = start_server(host, capture_launch(cfg))
        with pytest.raises(readiness.ServerFailed) as e:
            _sense(host, cfg, handle)
        assert e.value.reason == "oom"
        assert any("CUDA out of memory" in line for line in e.value.log_lines)
        stop_server(host, capture_launch(cfg), handle)
    finally:
        host.close()
