"""The server and sensor sections: where the server is reached, and environments that hold no
secrets."""

from __future__ import annotations

import pytest

from eyas.config import HostConfig
from eyas.config.server import SensorConfig, ServerConfig


def _server(**kw) -> ServerConfig:
    return ServerConfig(workdir="/tmp/eyas-w", dump_dir="/tmp/eyas-d", **kw)


def test_the_url_uses_url_host_then_the_ssh_hostname_then_bind():
    assert _server(port=31000).url == "http://127.0.0.1:31000"
    ssh = HostConfig(kind="ssh", hostname="gpu-node-1", insecure_accept_any_host_key=True)
    assert _server(host=ssh).url == "http://gpu-node-1:30000"
    assert _server(host=ssh, url_host="10.0.0.5").url == "http://10.0.0.5:30000"
    s = _server()
    assert (s.log_path.name, s.pid_path.name) == ("server.log", "server.pid")


def test_env_from_as_a_list_keeps_the_names_and_capture_env_holds_no_secret():
    assert _server(env_from=["HF_TOKEN"]).env_from == {"HF_TOKEN": "HF_TOKEN"}
    with pytest.raises(ValueError, match="server.capture_env.HF_TOKEN looks like a secret"):
        _server(capture_env={"HF_TOKEN": "x"})
    with pytest.raises(
        ValueError,
        match=r"\['A'\] set in more than one of env, secret_env, "
        r"env_from",
    ):
        _server(capture_env={"A": "1"}, env_from=["A"])


def test_launch_args_are_shown_without_an_api_key():
    s = _server(launch_args=["--api-key", "k-123", "--tp-size", "8"])
    assert s.model_dump(mode="json")["launch_args"] == ["--api-key", "***", "--tp-size", "8"]
    assert s.launch_args[1] == "k-123"  # the launch itself gets the value


def test_sensor_timeouts_are_positive():
    with pytest.raises(ValueError, match="deadline_s"):
        SensorConfig(deadline_s=0)
