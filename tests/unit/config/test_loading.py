"""Loading a config: the shipped configs load with paths resolved against the file, overrides are
validated too, and a bad file fails naming the file, the field and the value."""

from __future__ import annotations

import pytest

from eyas.config import ConfigError, load_config
from tests.stage_config import ROOT


def test_embedded_default_loads_with_paths_resolved_against_the_file():
    cfg = load_config(ROOT / "configs" / "local-tiny.yaml")
    assert cfg.server.backend == "local"
    assert cfg.target.checkpoint == ROOT / "fixtures" / "tiny-target"
    assert cfg.run_dir == ROOT / "runs" / "local-tiny"
    assert cfg.server.url == f"http://127.0.0.1:{cfg.server.port}"


def test_production_config_describes_kimi_on_eight_gpus_over_ssh():
    cfg = load_config(ROOT / "configs" / "kimi-k2.5-sglang.yaml")
    assert cfg.server.backend == "sglang" and cfg.server.host.kind == "ssh"
    assert cfg.server.launch_args[:2] == ["--tp-size", "8"]
    # the hand-run node's proven environment: Ring on every launch, LL on the capture as the team
    # ran it and on the serving launches
    assert cfg.server.env["NCCL_ALGO"] == "Ring" and "NCCL_PROTO" not in cfg.server.env
    assert (
        cfg.server.capture_env["NCCL_PROTO"] == "LL"
        and cfg.benchmark.server_env["NCCL_PROTO"] == "LL"
    )
    assert str(cfg.server.dump_dir).startswith("/dev/shm")
    assert len(cfg.target.capture_ids()) == 3
    assert cfg.server.url == "http://gpu-node-1:30000"


def test_overrides_are_validated_too():
    cfg = load_config(ROOT / "configs" / "local-tiny.yaml", {"training.max_steps": 7})
    assert cfg.training.max_steps == 7
    with pytest.raises(ConfigError, match=r"training\.max_steps.*got -1"):
        load_config(ROOT / "configs" / "local-tiny.yaml", {"training.max_steps": -1})


def test_bad_config_names_file_field_and_value(tmp_path):
    text = (ROOT / "configs" / "local-tiny.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        text.replace("num_shards: 4", "num_shards: many").replace(
            "dtype: bfloat16", "dtype: int4", 1
        )
    )
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    msg = str(e.value)
    assert str(bad) in msg
    assert "extraction.num_shards" in msg and "'many'" in msg
    assert "extraction.dtype" in msg and "'int4'" in msg


def test_unknown_key_is_refused(tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text(
        (ROOT / "configs" / "local-tiny.yaml")
        .read_text()
        .replace("stall_timeout_s", "stall_timout_s")
    )
    with pytest.raises(ConfigError, match=r"sensor\.stall_timout_s.*Extra inputs"):
        load_config(bad)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "x.yaml").write_text("name: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "x.yaml")


def test_a_local_server_python_is_expanded_and_read_from_the_configs_folder(monkeypatch):
    monkeypatch.setenv("HOME", "/home/op")
    cfg = ROOT / "configs" / "local-tiny.yaml"
    assert (
        load_config(cfg, {"server.python": "~/envs/sglang/bin/python"}).server.python
        == "/home/op/envs/sglang/bin/python"
    )
    assert load_config(cfg, {"server.python": "../venv/bin/python"}).server.python == str(
        ROOT / "venv" / "bin" / "python"
    )
    assert (
        load_config(cfg, {"server.python": "python3"}).server.python == "python3"
    )  # the shell's PATH finds it
    ssh = load_config(
        ROOT / "configs" / "kimi-k2.5-sglang.yaml", {"server.python": "~/sglang/bin/python"}
    )
    assert ssh.server.python == "~/sglang/bin/python"  # the GPU host's home, not this machine's
