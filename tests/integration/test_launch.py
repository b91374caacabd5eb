import socket

import pytest

from eyas.config import load_config
from eyas.server import readiness
from eyas.server.hosts import LocalHost
from eyas.server.launch import (
    LaunchError,
    capture_launch,
    launch_command,
    start_server,
    stop_recorded,
    stop_server,
)
from tests.stage_config import ROOT, stage_config


def _wait(host, cfg, handle):
    s = cfg.sensor
    return readiness.wait_until_ready(
        host,
        log_path=handle.log_path,
        pid=handle.pid,
        url=handle.url,
        start_offset=handle.log_offset,
        poll_interval_s=s.poll_interval_s,
        stall_timeout_s=30,
        deadline_s=120,
        http_timeout_s=5,
    )


def test_sglang_command_has_the_capture_flags():
    cfg = load_config(ROOT / "configs" / "kimi-k2.5-sglang.yaml")
    cmd = launch_command(capture_launch(cfg))
    assert cmd.startswith(
        "/opt/sglang/.venv/bin/python3 -m sglang.launch_server --model-path /models/Kimi-K2.5"
    )
    for flag in (
        "--enable-return-aux-hidden-states",
        "--return-aux-hidden-state-layer-ids 2 30 58",
        "--disable-radix-cache",
        "--disable-prefill-cuda-graph",
        "--speculative-algorithm EAGLE3",
        "--forward-hooks",
        "--tp-size 8",
        "--chunked-prefill-size 8192",
    ):
        assert flag in cmd, flag


def test_launch_sense_refuse_and_stop(tmp_path, random_target):
    host, cfg = LocalHost(), stage_config(tmp_path, random_target)
    handle = start_server(host, capture_launch(cfg))
    try:
        assert handle.log_offset == 0 and host.is_alive(handle.pid)
        report = _wait(host, cfg, handle)
        assert report.shards_total == len(list(random_target.glob("*.safetensors")))
        with pytest.raises(LaunchError, match="still alive"):
            start_server(host, capture_launch(cfg))  # the recorded server lives
        (cfg.server.dump_dir / "leftover").mkdir(parents=True, exist_ok=True)
    finally:
        outcome = stop_server(host, capture_launch(cfg), handle)
    assert outcome["outcome"] in ("terminated", "killed") and not host.is_alive(handle.pid)
    assert not cfg.server.dump_dir.exists() and not cfg.server.pid_path.exists()
    assert stop_recorded(host, capture_launch(cfg))["outcome"] == "not running"  # idempotent

    # A relaunch appends to the same log; the sensor reads only from the new offset.
    handle2 = start_server(host, capture_launch(cfg))
    try:
        assert handle2.log_offset > 0
        assert _wait(host, cfg, handle2).seconds > 0
    finally:
        stop_server(host, capture_launch(cfg), handle2)


def test_refuses_a_taken_port(tmp_path, random_target):
    cfg = stage_config(tmp_path, random_target)
    with socket.socket() as s:
        s.bind(("127.0.0.1", cfg.server.port))
        s.listen()
        with pytest.raises(LaunchError, match=f"port {cfg.server.port} is already in use"):
            start_server(LocalHost(), capture_launch(cfg))


def test_max_running_requests_goes_to_the_extraction_launch_only(tmp_path, random_target):
    from eyas.evaluation.serving import serving_launch

    cfg = stage_config(tmp_path, random_target, **{"server.max_running_requests": 6})
    assert "--max-running-requests 6" in launch_command(capture_launch(cfg))
    # the serving benchmark compares plain and speculative serving, which eyas-local runs one at a
    # time
    assert "--max-running-requests" not in launch_command(serving_launch(cfg, "plain", None))
    unset = stage_config(tmp_path, random_target, **{"server.max_running_requests": None})
    assert "--max-running-requests" not in launch_command(capture_launch(unset))


def test_dp_size_goes_to_the_extraction_launch_only(tmp_path, random_target):
    from eyas.evaluation.serving import serving_launch

    cfg = stage_config(tmp_path, random_target, **{"server.dp_size": 2})
    assert "--dp-size 2" in launch_command(capture_launch(cfg))
    assert "--dp-size" not in launch_command(
        serving_launch(cfg, "plain", None)
    )  # speed is compared per replica
    assert "--dp-size" not in launch_command(
        capture_launch(stage_config(tmp_path, random_target, **{"server.dp_size": None}))
    )


def _environ(pid: int) -> dict[str, str]:
    raw = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_only_the_capture_launch_gets_the_dump_folder_and_the_capture_settings(
    tmp_path, random_target
):
    """server.env/launch_args reach every launch; capture_env, capture_launch_args and EYAS_DUMP_DIR
    only the extraction launch; benchmark.launch_args only the serving benchmark's launches."""
    from eyas.dump import DUMP_DIR_ENV
    from eyas.evaluation.serving import serving_launch

    host = LocalHost()
    cfg = stage_config(
        tmp_path,
        random_target,
        **{
            "server.env": {"EYAS_T_EVERY": "1"},
            "server.capture_env": {"EYAS_T_CAPTURE": "1"},
            "server.launch_args": ["--served-model-name", "t"],
            "server.capture_launch_args": ["--random-seed", "7"],
            "benchmark.launch_args": ["--dtype", "bfloat16"],
        },
    )
    serving = serving_launch(cfg, "plain", None)
    for launch, capture in ((capture_launch(cfg), True), (serving, False)):
        handle = start_server(host, launch)
        try:
            env, argv = _environ(handle.pid), host.process_identity(handle.pid).argv
            _wait(host, cfg, handle)
        finally:
            stop_server(host, launch, handle)
        assert env["EYAS_T_EVERY"] == "1" and argv[argv.index("--served-model-name") + 1] == "t"
        assert (DUMP_DIR_ENV in env) == capture and ("EYAS_T_CAPTURE" in env) == capture
        assert ("--random-seed" in argv) == capture and (
            "--enable-return-aux-hidden-states" in argv
        ) == capture
        assert ("--dtype" in argv) != capture
    assert env.get(DUMP_DIR_ENV) is None


def test_the_source_patch_mode_launches_without_forward_hooks(tmp_path):
    base = {"server.backend": "sglang"}
    hook = launch_command(capture_launch(stage_config(tmp_path, tmp_path / "ckpt", **base)))
    patch = launch_command(
        capture_launch(
            stage_config(tmp_path, tmp_path / "ckpt", **base, **{"server.capture": "source_patch"})
        )
    )
    assert "--forward-hooks" in hook and "--forward-hooks" not in patch
    assert "--enable-return-aux-hidden-states" in patch and "--disable-prefill-cuda-graph" in patch
