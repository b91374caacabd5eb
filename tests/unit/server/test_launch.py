"""eyas/server/launch.py without a server: the launch record (server.pid) as a ServerHandle, and
what stop_server and stop_recorded do with a handle whose process is not the one it names."""

import json
import subprocess

import pytest

from eyas.config import load_config
from eyas.server.hosts import LocalHost
from eyas.server.launch import ServerHandle, capture_launch, read_record, stop_recorded, stop_server
from tests.stage_config import ROOT


@pytest.fixture
def cfg(tmp_path):
    (tmp_path / "server").mkdir()
    return load_config(
        ROOT / "configs" / "local-tiny.yaml",
        {
            "server.workdir": str(tmp_path / "server"),
            "server.dump_dir": str(tmp_path / "server" / "dump"),
        },
    )


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "300"], start_new_session=True)
    yield p
    p.kill()
    p.wait(10)


def test_a_handle_round_trips_through_its_record(cfg):
    handle = ServerHandle(
        1234,
        "gpu-1",
        "http://h:30000",
        "/srv/log",
        77,
        "python3 -m x",
        "boot",
        "99",
        "tok",
        ("run-a", "run-b"),
        "cfg",
        "2026-01-01T00:00:00+0000",
    )
    text = json.dumps(handle.to_dict())
    assert json.loads(text)["runs"] == ["run-a", "run-b"]
    assert ServerHandle.from_record(json.loads(text)) == handle
    cfg.server.pid_path.write_text(text)
    assert read_record(LocalHost(), cfg.server) == handle


def test_records_without_identity_or_of_another_shape(cfg):
    host = LocalHost()
    assert read_record(host, cfg.server) is None  # no file
    cfg.server.pid_path.write_text("4321\n")  # a bare pid: a handle of that pid alone
    assert read_record(host, cfg.server) == ServerHandle(4321)
    cfg.server.pid_path.write_text(json.dumps({"pid": 5, "start": None, "future_field": 1}))
    assert read_record(host, cfg.server) == ServerHandle(
        5
    )  # unknown fields dropped, None takes the default
    for text in ("not json", json.dumps({"pid": "5"}), json.dumps([5])):
        cfg.server.pid_path.write_text(text)
        assert read_record(host, cfg.server) is None, text


def test_a_hook_leaves_another_runs_server_alone(cfg, sleeper):
    host = LocalHost()
    me = host.process_identity(sleeper.pid)
    theirs = ServerHandle(sleeper.pid, boot=me.boot, start=me.start, owner="t", runs=("other-run",))
    cfg.server.pid_path.write_text(json.dumps(theirs.to_dict()))
    out = stop_recorded(host, capture_launch(cfg), runs={"my-run"})
    assert out["outcome"] == "left alone: launched by flow run other-run, not by this run"
    assert sleeper.poll() is None and cfg.server.pid_path.exists()


def test_a_handle_whose_pid_is_now_another_process_is_never_signalled(cfg, sleeper):
    host = LocalHost()
    me = host.process_identity(sleeper.pid)
    stale = ServerHandle(sleeper.pid, boot=me.boot, start=str(int(me.start) - 1), owner="t")
    cfg.server.pid_path.write_text(json.dumps(stale.to_dict()))
    out = stop_server(host, capture_launch(cfg), stale)
    assert (
        out["outcome"].startswith("not running (pid ")
        and "is now another process" in out["outcome"]
    )
    assert sleeper.poll() is None
    assert not cfg.server.pid_path.exists()  # the stale record goes; the process it named stays


def test_stop_recorded_with_nothing_recorded(cfg):
    assert stop_recorded(LocalHost(), capture_launch(cfg))["outcome"] == "not running"
    assert stop_recorded(LocalHost(), capture_launch(cfg), runs={"r"}) == {
        "pid": None,
        "outcome": "not running",
        "dump_dir": "kept",
    }


def test_the_launch_mode_is_no_config_field(tmp_path):
    """Capture or serve is the Launch's mode (capture_launch, serving_launch), not a server field a
    config could set."""
    from eyas.config import ConfigError

    with pytest.raises(ConfigError, match=r"server\.capture_aux[\s\S]*Extra inputs are not"):
        load_config(ROOT / "configs" / "local-tiny.yaml", {"server.capture_aux": False})
