"""The drafter against the target: a warm start's training.init_from must be there and of this run's
sizes."""

from __future__ import annotations

import json

from eyas.preflight import preflight
from tests.tiny_config import TINY, fields, tiny


def test_a_warm_starts_init_from_is_checked_naming_the_field(tmp_path):
    from eyas.evaluation.export import sglang_config
    from eyas.target import read_config
    from eyas.training.train import drafter_config

    missing = preflight(tiny(tmp_path, **{"training.init_from": str(tmp_path / "old" / "drafter")}))
    assert fields(missing) == ["training.init_from"] and "does not exist" in missing.problems[0]

    cfg = tiny(tmp_path)
    tcfg = read_config(TINY)
    dcfg = drafter_config(cfg.training, tcfg, tcfg["hidden_size"], 3)
    for name, dvocab in (("fits", dcfg.draft_vocab_size), ("other", 1024)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"")  # preflight reads the sizes only
        other = dcfg.__class__(**{**dcfg.__dict__, "draft_vocab_size": dvocab})
        (folder / "config.json").write_text(
            json.dumps(sglang_config(other, cfg.target.capture_ids(), "bfloat16", {}))
        )
    assert preflight(tiny(tmp_path, **{"training.init_from": str(tmp_path / "fits")})).ok
    r = preflight(tiny(tmp_path, **{"training.init_from": str(tmp_path / "other")}))
    assert fields(r) == ["training.init_from"]
    assert (
        "training.draft_vocab_size gives draft_vocab_size=2048 in this run, 1024 in the drafter"
        in r.problems[0]
    )
