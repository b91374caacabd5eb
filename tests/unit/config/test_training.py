"""The training section: training.num_validation_sequences (the shard sequences kept out of training
for the simulated acceptance length) is not data.num_heldout, and training.num_heldout says which it
is."""

from __future__ import annotations

import pytest

from eyas.config import ConfigError, load_config
from tests.stage_config import ROOT

TINY = ROOT / "configs" / "local-tiny.yaml"


def test_training_num_heldout_is_refused_naming_both_settings():
    assert load_config(TINY).training.num_validation_sequences is None
    assert (
        load_config(
            TINY, {"training.num_validation_sequences": 5}
        ).training.num_validation_sequences
        == 5
    )
    with pytest.raises(
        ConfigError,
        match=r"training: .*num_heldout is not a training setting: .* "
        r"are "
        r"training.num_validation_sequences; .* are "
        r"data.num_heldout",
    ):
        load_config(TINY, {"training.num_heldout": 5})


def test_data_num_heldout_is_another_setting():
    cfg = load_config(TINY, {"data.num_heldout": 3, "training.num_validation_sequences": 7})
    assert (cfg.data.num_heldout, cfg.training.num_validation_sequences) == (3, 7)
