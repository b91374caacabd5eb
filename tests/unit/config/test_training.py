"""The training section: training.num_validation_sequences (the shard sequences kept out of training
for the simulated acceptance length), and num_heldout, its older name, still read."""

from __future__ import annotations

import pytest

from eyas.config import ConfigError, load_config
from tests.stage_config import ROOT

TINY = ROOT / "configs" / "local-tiny.yaml"


def test_num_heldout_is_read_as_num_validation_sequences():
    assert load_config(TINY).training.num_validation_sequences is None
    assert load_config(TINY, {"training.num_heldout": 5}).training.num_validation_sequences == 5
    same = load_config(TINY, {"training.num_heldout": 5, "training.num_validation_sequences": 5})
    assert same.training.num_validation_sequences == 5
    assert "num_heldout" not in same.training.model_dump()  # stored and shown under the one name
    with pytest.raises(ConfigError, match=r"training: .*num_heldout=5 and num_validation_sequences=4: num_heldout "
                                          r"is the older name"):
        load_config(TINY, {"training.num_heldout": 5, "training.num_validation_sequences": 4})


def test_data_num_heldout_is_another_setting():
    cfg = load_config(TINY, {"data.num_heldout": 3, "training.num_validation_sequences": 7})
    assert (cfg.data.num_heldout, cfg.training.num_validation_sequences) == (3, 7)
