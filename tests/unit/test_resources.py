"""eyas/resources.py: the shipped patch sets, configs and tiny target are found from the package."""

from __future__ import annotations

from eyas.resources import shipped, shipped_root
from tests.stage_config import ROOT


def test_shipped_paths_resolve_to_the_checkouts_files():
    assert shipped_root() == ROOT  # a checkout: no eyas/_shipped copy
    assert shipped("configs", "local-tiny.yaml") == ROOT / "configs" / "local-tiny.yaml"
    assert shipped("configs", "local-tiny.yaml").is_file()
    assert (shipped("patches", "sglang") / "0.5.23" / "manifest.json").is_file()
