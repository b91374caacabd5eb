"""eyas preflight as a whole, on the embedded default: it passes and plans, every problem is
collected naming its field, and the command line's exit status and output say so."""

from __future__ import annotations

import pytest

from eyas.cli import main as cli
from eyas.preflight import preflight
from tests.stage_config import ROOT
from tests.tiny_config import fields, tiny


def test_the_embedded_default_passes_and_plans(tmp_path):
    r = preflight(tiny(tmp_path))
    assert r.ok, r.problems
    p = r.plan
    assert p.data.sequences == 468 and p.data.conversations and "tokenized" in p.data.source
    assert (
        p.bytes_per_token == 4 * 256 * 2 + 5
    )  # 3 aux layers + the last, hidden 256, bf16, id + mask
    assert p.total_bytes > p.data.tokens * p.bytes_per_token
    assert [s.name for s in p.stages] == ["extract", "regenerate", "train"]
    assert p.stages[0].hours == pytest.approx(p.data.tokens / 4000 / 3600)
    assert 1.4e6 < p.trainable_params < 1.7e6  # docs: 1.57M trainable parameters
    assert any("server.host.kind=local" in n for n in r.notes)


def test_all_problems_are_collected_each_naming_its_field(tmp_path):
    cfg = tiny(
        tmp_path,
        **{
            "target.layer_ids": [2, 4, 9],
            "training.draft_vocab_size": 5000,
            "data.max_length": 5000,
            "training.batch_size": 500,
        },
    )
    r = preflight(cfg, free_bytes=10)
    assert fields(r) == [
        "target.layer_ids",
        "data.max_length",
        "training.draft_vocab_size",
        "extraction.output_dir",
        "training.batch_size",
    ]
    assert "5000" in r.problems[2] and "4096" in r.problems[2]
    assert "0.00 GB free" in r.problems[3] and "extraction.keep_free_gb=1.0" in r.problems[3]


def test_cli_exit_status_and_output(tmp_path, capsys):
    args = [
        "preflight",
        str(ROOT / "configs" / "local-tiny.yaml"),
        "--set",
        f"run_dir={tmp_path}/run",
        "--set",
        f"extraction.output_dir={tmp_path}/shards",
        "--set",
        f"training.output_dir={tmp_path}/train",
    ]
    assert cli(args) == 0
    out = capsys.readouterr().out
    assert "preflight: OK" in out and "shards" in out and "train " in out and "memory" in out
    assert cli([*args, "--set", "target.layer_ids=[2,4,50]"]) == 1
    out = capsys.readouterr().out
    assert "problem: target.layer_ids=[2, 4, 50]:" in out and "preflight: 1 problem(s)" in out
