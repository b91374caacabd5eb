"""The plan section: the throughputs `eyas preflight` plans with."""

from __future__ import annotations

import pytest

from eyas.config import ConfigError, load_config
from eyas.config.plan import PlanConfig
from tests.stage_config import ROOT


def test_plan_figures_are_positive():
    assert PlanConfig().gpu_memory_gb is None
    assert (
        load_config(
            ROOT / "configs" / "local-tiny.yaml", {"plan.train_tokens_per_s": 123.0}
        ).plan.train_tokens_per_s
        == 123.0
    )
    with pytest.raises(ConfigError, match=r"plan\.prefill_tokens_per_s"):
        load_config(ROOT / "configs" / "local-tiny.yaml", {"plan.prefill_tokens_per_s": 0})
