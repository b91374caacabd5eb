import socket

import pytest

from eyas.server import readiness
from eyas.server.hosts import LocalHost
from eyas.server.launch import LaunchError, launch_command, start_server, stop_server
from eyas.config import load_config
from tests.stage_config import ROOT, stage_config


def _wait(host, cfg, handle):
    s = cfg.sensor
    return readiness.wait_until_ready(host, log_path=handle.log_path, pid=handle.pid, url=handle.url,
                                      start_offset=handle.log_offset, poll_interval_s=s.poll_interval_s,
                                      stall_timeout_s=30, deadline_s=120, http_timeout_s=5)


def test_sglang_command_has_the_capture_flags():
    cfg = load_config(ROOT / "configs" / "kimi-k2.5-sglang.yaml")
    cmd = launch_command(cfg)
    assert cmd.startswith("/opt/sglang/.venv/bin/python3 -m sglang.launch_server --model-path /models/Kimi-K2.5")
    for flag in ("--enable-return-aux-hidden-states", "--return-aux-hidden-state-layer-ids 2 30 58",
                 "--disable-radix-cache", "--disable-prefill-cuda-graph", "--speculative-algorithm EAGLE3",
                 "--forward-hooks", "--tp-size 8", "--chunked-prefill-size 8192"):
        assert flag in cmd, flag


def test_launch_sense_refuse_and_stop(tmp_path, random_target):
    host, cfg = LocalHost(), stage_config(tmp_path, random_target)
    handle = start_server(host, cfg)
    try:
        assert handle.log_offset == 0 and host.is_alive(handle.pid)
        report = _wait(host, cfg, handle)
        assert report.shards_total == len(list(random_target.glob("*.safetensors")))
        with pytest.raises(LaunchError, match="still alive"):
            start_server(host, cfg)  # the recorded server lives
        (cfg.server.dump_dir / "leftover").mkdir(parents=True, exist_ok=True)
    finally:
        outcome = stop_server(host, cfg, handle.pid)
    assert outcome["outcome"] in ("terminated", "killed") and not host.is_alive(handle.pid)
    assert not cfg.server.dump_dir.exists() and not cfg.server.pid_path.exists()
    assert stop_server(host, cfg)["outcome"] == "not running"  # idempotent

    # A relaunch appends to the same log; the sensor reads only from the new offset.
    handle2 = start_server(host, cfg)
    try:
        assert handle2.log_offset > 0
        assert _wait(host, cfg, handle2).seconds > 0
    finally:
        stop_server(host, cfg, handle2.pid)


def test_refuses_a_taken_port(tmp_path, random_target):
    cfg = stage_config(tmp_path, random_target)
    with socket.socket() as s:
        s.bind(("127.0.0.1", cfg.server.port))
        s.listen()
        with pytest.raises(LaunchError, match=f"port {cfg.server.port} is already in use"):
            start_server(LocalHost(), cfg)


def test_max_running_requests_goes_to_the_extraction_launch_only(tmp_path, random_target):
    from eyas.evaluation.serving import server_config

    cfg = stage_config(tmp_path, random_target, **{"server.max_running_requests": 6})
    assert "--max-running-requests 6" in launch_command(cfg)
    # the serving benchmark compares plain and speculative serving, which eyas-local runs one at a time
    assert "--max-running-requests" not in launch_command(server_config(cfg, "plain", None))
    unset = stage_config(tmp_path, random_target, **{"server.max_running_requests": None})
    assert "--max-running-requests" not in launch_command(unset)


def test_dp_size_goes_to_the_extraction_launch_only(tmp_path, random_target):
    from eyas.evaluation.serving import server_config

    cfg = stage_config(tmp_path, random_target, **{"server.dp_size": 2})
    assert "--dp-size 2" in launch_command(cfg)
    assert "--dp-size" not in launch_command(server_config(cfg, "plain", None))  # speed is compared per replica
    assert "--dp-size" not in launch_command(stage_config(tmp_path, random_target, **{"server.dp_size": None}))
