"""The sections after training: benchmark suites by name or with their prompt count."""

from __future__ import annotations

import pytest

from eyas.config import ConfigError, load_config
from tests.stage_config import ROOT


def test_benchmark_suites_by_name_or_with_their_prompt_count():
    cfg = load_config(
        ROOT / "configs" / "local-tiny.yaml",
        {"benchmark.suites": ["humaneval", {"name": "mtbench", "num_prompts": 5}]},
    )
    assert [(s.name, s.num_prompts) for s in cfg.benchmark.suites] == [
        ("humaneval", 16),
        ("mtbench", 5),
    ]
    with pytest.raises(ConfigError, match="benchmark.suites"):
        load_config(ROOT / "configs" / "local-tiny.yaml", {"benchmark.suites": ["gsm8k"]})
    with pytest.raises(ConfigError, match="distinct"):
        load_config(
            ROOT / "configs" / "local-tiny.yaml", {"benchmark.suites": ["humaneval", "humaneval"]}
        )
