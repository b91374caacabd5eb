"""The data section: conversations, their length handling, and their regeneration by the target."""

from __future__ import annotations

import pytest

from eyas.config import ConfigError, load_config
from eyas.config.data import DataConfig, RegenerateConfig
from tests.stage_config import ROOT


def test_data_defaults_and_choices(tmp_path):
    cfg = DataConfig(path=tmp_path / "d.jsonl")
    assert (cfg.max_length, cfg.overlong, cfg.bad_lines, cfg.regenerate.enabled) == (512, "truncate", "error", False)
    with pytest.raises(ValueError, match="overlong"):
        DataConfig(path=tmp_path, overlong="wrap")
    with pytest.raises(ValueError, match="max_length"):
        DataConfig(path=tmp_path, max_length=1)


def test_regenerate_thinking_kwarg_is_a_template_variable_name():
    assert RegenerateConfig(thinking_kwarg="enable_thinking").thinking_kwarg == "enable_thinking"
    with pytest.raises(ValueError, match="thinking_kwarg"):
        RegenerateConfig(thinking_kwarg="thinking }}{{ x")
    with pytest.raises(ConfigError, match=r"data\.regenerate\.num_parts"):
        load_config(ROOT / "configs" / "local-tiny.yaml", {"data.regenerate.num_parts": 0})
