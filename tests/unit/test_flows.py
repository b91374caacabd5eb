"""The flows' config parameter: a YAML path, an inline mapping, or a loaded config, plus overrides."""

import re

import pytest
import yaml

from eyas.config import ConfigError, load_config
from flows.common import ROOT, host_limit_name, resolve_config


def test_a_path_is_taken_from_the_repository_root_wherever_the_run_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = resolve_config("configs/local-tiny.yaml", {"training.max_steps": 20})
    assert cfg == load_config(ROOT / "configs" / "local-tiny.yaml", {"training.max_steps": 20})
    assert cfg.training.max_steps == 20 and cfg.target.checkpoint == ROOT / "fixtures" / "tiny-target"


def test_an_inline_mapping_resolves_relative_paths_against_the_repository_root():
    raw = yaml.safe_load((ROOT / "configs" / "local-tiny.yaml").read_text())
    for section, key in (("target", "checkpoint"), ("data", "path")):
        raw[section][key] = raw[section][key].removeprefix("../")
    raw["run_dir"] = "runs/inline"
    cfg = resolve_config(raw, {"name": "inline"})
    assert cfg.name == "inline" and cfg.run_dir == ROOT / "runs" / "inline"
    assert cfg.target.checkpoint == ROOT / "fixtures" / "tiny-target"


def test_a_loaded_config_passes_through_and_takes_overrides():
    cfg = load_config(ROOT / "configs" / "local-tiny.yaml")
    assert resolve_config(cfg) is cfg
    again = resolve_config(cfg, {"server.port": 31000})
    assert again.server.port == 31000 and again.target.checkpoint == cfg.target.checkpoint
    # The GPU-host lock is the machine's, whatever the label says: a safe name, never a path.
    name = host_limit_name(again)
    assert re.fullmatch(r"eyas-gpu-host-[a-z0-9-]+-[0-9a-f]{10}", name), name
    assert host_limit_name(resolve_config(cfg, {"server.host.name": "another-label"})) == name
    with pytest.raises(ConfigError, match="server.host.name"):  # and a path is no label at all
        resolve_config(cfg, {"server.host.name": "../../../etc/evil"})


def test_a_bad_override_names_the_field():
    with pytest.raises(ConfigError, match="training.max_steps"):
        resolve_config("configs/local-tiny.yaml", {"training.max_steps": -1})
