"""Secrets without servers: where they may be written in a config, how they are resolved on the
worker, and that every printed form hides them (the end-to-end canary run is
tests/integration/test_safety_secrets.py)."""

import json
import shlex

import pytest
from eyas_prefect.flows.common import resolve_config
from fastapi.encoders import jsonable_encoder

from eyas.config import ConfigError, load_config
from eyas.secrets import MASK, redact, redact_args, register
from eyas.server.hosts import HostError
from eyas.server.launch import (
    LaunchError,
    auth_headers,
    capture_launch,
    launch_command,
    launch_secrets,
)
from eyas.server.readiness import ServerFailed
from tests.stage_config import ROOT

TINY = ROOT / "configs" / "local-tiny.yaml"


def _cfg(**overrides):
    return load_config(TINY, overrides)


def test_a_secret_looking_name_in_plain_env_is_refused_with_the_way_out():
    for name in ("HF_TOKEN", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWORD"):
        with pytest.raises(
            ConfigError,
            match=rf"server.env.{name} looks like a "
            rf"secret.*env_from.*secret_env",
        ):
            _cfg(**{"server.env": {name: "x"}})
    with pytest.raises(ConfigError, match="more than one of env, secret_env, env_from"):
        _cfg(**{"server.secret_env": {"A": "1"}, "server.env_from": ["A"]})
    assert (
        _cfg(**{"server.env": {"NCCL_ALGO": "Ring", "CUDA_VISIBLE_DEVICES": "0"}}).server.env[
            "NCCL_ALGO"
        ]
        == "Ring"
    )


def test_secrets_resolve_on_the_worker_and_dump_masked():
    cfg = _cfg(
        **{
            "server.secret_env": {"WANDB_API_KEY": "sekrit-1"},
            "server.env_from": {"HF_TOKEN": "MY_HF"},
            "server.launch_args": ["--api-key", "sekrit-2", "--log-level", "info"],
        }
    )
    assert launch_secrets(cfg.server, environ={"MY_HF": "sekrit-3"}) == {
        "HF_TOKEN": "sekrit-3",
        "WANDB_API_KEY": "sekrit-1",
    }
    with pytest.raises(LaunchError, match="server.env_from: MY_HF is not set"):
        launch_secrets(cfg.server, environ={})
    assert auth_headers(cfg.server) == {"Authorization": "Bearer sekrit-2"}
    for dumped in (
        cfg.model_dump(mode="json"),
        jsonable_encoder(cfg),
        json.loads(cfg.model_dump_json()),
    ):
        text = json.dumps(dumped)  # what Prefect stores as parameters, what check-config prints
        assert "sekrit" not in text and dumped["server"]["secret_env"] == {
            "WANDB_API_KEY": "**********"
        }
        assert dumped["server"]["launch_args"] == ["--api-key", MASK, "--log-level", "info"]
    masked = resolve_config(
        cfg.model_dump(mode="json")
    )  # a failure hook reads the stored parameters back
    with pytest.raises(LaunchError, match="holds \\*{10}, the mask Prefect stored"):
        launch_secrets(masked.server, environ={"MY_HF": "x"})
    again = resolve_config(
        cfg, {"training.max_steps": 3}
    )  # eyas run CONFIG --set ...: the real values stay
    assert again.server.secret_env["WANDB_API_KEY"].get_secret_value() == "sekrit-1"
    assert again.server.launch_args[1] == "sekrit-2" and "sekrit-2" in shlex.split(
        launch_command(capture_launch(again))
    )


def test_secret_values_in_an_inline_config_or_overrides_are_refused():
    raw = _cfg().model_dump(mode="json")
    raw["server"]["secret_env"] = {"HF_TOKEN": "hf_real"}
    with pytest.raises(
        ConfigError,
        match=r"inline config carries secret values "
        r"\(server.secret_env.HF_TOKEN\)",
    ):
        resolve_config(raw)
    with pytest.raises(
        ConfigError,
        match=r"overrides carries secret values \(server.launch_args "
        r"\(--api-key\)\)",
    ):
        resolve_config(str(TINY), {"server.launch_args": ["--api-key=k123"]})
    with pytest.raises(ConfigError, match="server.secret_env.X"):
        resolve_config(str(TINY), {"server.secret_env.X": "v"})
    assert resolve_config(str(TINY), {"server.env_from": ["HF_TOKEN"]}).server.env_from == {
        "HF_TOKEN": "HF_TOKEN"
    }


def test_every_printed_form_hides_secret_flags_and_registered_values():
    register("registered-secret-9")
    e = HostError(
        "gpu-1",
        "python3 -m sglang.launch_server --api-key 'k 1' --api-key=k2 --x registered-secret-9",
        1,
        "echo registered-secret-9",
    )
    assert "k 1" not in str(e) and "k2" not in str(e) and "registered-secret-9" not in str(e)
    assert "--api-key *** --api-key=*** --x ***" in str(e) and e.command.endswith("--x ***")
    assert redact_args(["--api-key", "a", "--api-key=b", "--port", "1"]) == [
        "--api-key",
        MASK,
        f"--api-key={MASK}",
        "--port",
        "1",
    ]
    failed = ServerFailed(
        "crashed", ["server_args=ServerArgs(model_path='/m', api_key='abc123', port=1)"]
    )
    assert "abc123" not in str(failed) and "api_key='***'" in failed.log_lines[0]
    assert redact("nothing secret here") == "nothing secret here"


def test_argparses_metavar_is_not_a_secret_and_the_text_after_it_stays():
    usage = "usage: launch_server [--api-key API_KEY] [--port PORT]; error: bad"
    assert redact(usage) == usage
    assert redact("--api-key API_KEY2 --port 1") == "--api-key *** --port 1"
