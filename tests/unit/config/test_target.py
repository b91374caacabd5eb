"""The target section: layer ids in either convention, as the server captures them."""

from __future__ import annotations

import pytest

from eyas.config import TargetConfig


def test_layer_conventions():
    assert TargetConfig(
        checkpoint="x", layer_ids=[1, 29, 57], layer_convention="output-of"
    ).capture_ids() == [2, 30, 58]
    assert TargetConfig(checkpoint="x", layer_ids=[2, 30, 58]).capture_ids() == [2, 30, 58]
    with pytest.raises(ValueError, match="ascending"):
        TargetConfig(checkpoint="x", layer_ids=[30, 2])
