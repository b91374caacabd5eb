"""PipelineConfig's checks across sections: paths on an SSH host are absolute, evaluation is served
(never in process with SGLang), the serving launches' environment holds no secrets, and
data.tokenizer is refused, naming target.local_dir."""

from __future__ import annotations

import pytest

from eyas.config import ConfigError, EvaluationConfig, HostConfig, config_from_dict, load_config
from tests.stage_config import ROOT


def test_ssh_paths_must_be_absolute():
    raw = load_config(ROOT / "configs" / "kimi-k2.5-sglang.yaml").model_dump(mode="json")
    raw["server"]["dump_dir"] = "relative/dump"
    with pytest.raises(ConfigError, match="server.dump_dir must be absolute"):
        config_from_dict(raw, base_dir=ROOT)
    with pytest.raises(ValueError):
        HostConfig(kind="ssh")


def test_evaluation_is_served_by_default_and_never_in_process_with_sglang():
    tiny = load_config(ROOT / "configs" / "local-tiny.yaml")
    prod = load_config(ROOT / "configs" / "kimi-k2.5-sglang.yaml")
    assert tiny.evaluation.method == prod.evaluation.method == "server"
    assert EvaluationConfig().method == "server"
    small = load_config(ROOT / "configs" / "local-tiny.yaml", {"evaluation.method": "in_process"})
    assert small.evaluation.method == "in_process"  # a small target, chosen explicitly
    with pytest.raises(
        ConfigError,
        match=r"evaluation\.method: in_process .* server\.backend "
        r"sglang",
    ):
        load_config(ROOT / "configs" / "kimi-k2.5-sglang.yaml", {"evaluation.method": "in_process"})
    with pytest.raises(ConfigError, match="evaluation.method"):
        load_config(ROOT / "configs" / "local-tiny.yaml", {"evaluation.method": "loaded"})


def test_serving_launches_env_holds_no_secrets():
    tiny = ROOT / "configs" / "local-tiny.yaml"
    with pytest.raises(ConfigError, match="server_env.HF_TOKEN looks like a secret"):
        load_config(tiny, {"benchmark.server_env": {"HF_TOKEN": "x"}})
    with pytest.raises(ConfigError, match=r"benchmark.server_env: \['A'\] also set"):
        load_config(tiny, {"benchmark.server_env": {"A": "1"}, "server.env_from": ["A"]})


def test_data_tokenizer_is_refused_naming_target_local_dir(tmp_path):
    raw = {
        "name": "x",
        "run_dir": "run",
        "target": {"checkpoint": "/models/t", "layer_ids": [2, 4, 6], "local_dir": "copy"},
        "server": {"workdir": "/tmp/eyas-w", "dump_dir": "/tmp/eyas-d"},
        "data": {"path": "data.jsonl"},
        "extraction": {"output_dir": "shards"},
        "training": {"output_dir": "train"},
    }
    assert config_from_dict(raw, base_dir=tmp_path).target.local_dir == tmp_path / "copy"
    with pytest.raises(ConfigError, match="data.tokenizer is not a field.*target.local_dir"):
        config_from_dict({**raw, "data": {**raw["data"], "tokenizer": "copy"}}, base_dir=tmp_path)
