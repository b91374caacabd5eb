"""The data section: conversations, their length handling, and their regeneration by the target."""

from __future__ import annotations

import pytest

from eyas.config import ConfigError, load_config
from eyas.config.data import DataConfig, RegenerateConfig
from tests.stage_config import ROOT


def test_data_defaults_and_choices(tmp_path):
    cfg = DataConfig(path=tmp_path / "d.jsonl")
    assert (cfg.max_length, cfg.overlong, cfg.bad_lines, cfg.regenerate.enabled) == (
        512,
        "truncate",
        "error",
        False,
    )
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


def test_a_thinking_target_is_sampled_as_recommended_unless_told_otherwise():
    """Reasoning decoded greedily loops: thinking on samples at 1.0 by default; off, or a model that
    does not think, is greedy; top_p is sent only where it is on and the temperature is above 0."""
    assert RegenerateConfig(thinking=True).sampling() == {"temperature": 1.0}
    assert RegenerateConfig(thinking=True, top_p=0.95).sampling() == {
        "temperature": 1.0,
        "top_p": 0.95,
    }
    assert RegenerateConfig(thinking=False, top_p=0.95).sampling() == {"temperature": 0.0}
    assert RegenerateConfig().sampling() == {"temperature": 0.0}
    assert RegenerateConfig(thinking=True, temperature=0.0).sampling() == {"temperature": 0.0}
    assert RegenerateConfig(temperature=0.7, top_p=0.9).sampling() == {
        "temperature": 0.7,
        "top_p": 0.9,
    }
    with pytest.raises(ValueError, match="top_p"):
        RegenerateConfig(top_p=0)
