"""The training section: training.num_validation_sequences (the shard sequences kept out of training
for the simulated acceptance length) is not data.num_heldout, and training.num_heldout says which it
is; the fields a resumed run may change are marked on the fields, every other one is
fingerprinted."""

from __future__ import annotations

import pytest

from eyas.config import ConfigError, TrainingConfig, load_config
from eyas.config.training import MAY_CHANGE, ONLY_WHERE_SET
from tests.helpers_training import training_config
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


#: The fields a resumed run may change, as eyas/training/train.py's _fingerprint listed them by hand
#: before the fields were marked: checkpoints written then must keep resuming.
LISTED = {
    "output_dir",
    "checkpoint_every",
    "device",
    "eval_every",
    "batch_size",
    "grad_accum",
    "distributed",
    "compile",
    "teacher_cache_gb",
    "loader_workers",
    "disk_check",
}


def test_the_fingerprint_leaves_out_the_marked_fields_and_ema_decay_only_when_off(tmp_path):
    assert TrainingConfig.marked(MAY_CHANGE) == LISTED
    assert TrainingConfig.marked(ONLY_WHERE_SET) == {"ema_decay"}
    for ema_decay in (0.0, 0.8):
        cfg = training_config(tmp_path, ema_decay=ema_decay, batch_size=2, compile=True)
        want = cfg.model_dump(mode="json", exclude=LISTED)
        if not ema_decay:  # off: checkpoints written before the field existed still resume
            want.pop("ema_decay")
        got = cfg.fingerprint_settings()
        assert got == want and list(got) == list(want)


def test_a_new_field_without_a_mark_is_part_of_the_fingerprint(tmp_path):
    class Later(TrainingConfig):
        new_knob: int = 3

    cfg = Later.model_validate(training_config(tmp_path).model_dump())
    assert cfg.fingerprint_settings()["new_knob"] == 3
    assert set(cfg.fingerprint_settings()) == set(Later.model_fields) - LISTED - {"ema_decay"}
