"""dataset.json and the progress figures of one extraction (core, no Prefect)."""

import json

import pytest
import torch

from eyas.extraction.data import TokenizedSample, write_shard_plans
from eyas.extraction.dataset import build_dataset_manifest, dataset_path
from eyas.extraction.extract import ShardProgress
from eyas.extraction.progress import ExtractionRun
from eyas.extraction.shards import Sample, write_shard

PROVENANCE = {
    "layer_ids": [2, 4, 5],
    "layer_convention": "capture-before",
    "capture_ids": [2, 4, 5],
    "layer_ids_capture_before": [2, 4, 5],
    "layer_ids_output_of": [1, 3, 4],
    "last_hidden_norm": "post",
    "target_checkpoint": "/m",
    "target_revision": "r1",
    "tokenizer_sha256": "t" * 64,
    "chat_template_sha256": "c" * 64,
    "eyas_version": "0.1.0",
    "backend": "local",
    "patch_version": "local",
}


def _shard(tmp_path, plan, encoding="plain", **meta):
    n = plan.num_tokens
    samples = [
        Sample(
            torch.arange(n),
            torch.ones(n, dtype=torch.bool),
            torch.randn(n, 24).bfloat16(),
            torch.randn(n, 8).bfloat16(),
        )
    ]
    return write_shard(
        tmp_path / f"{plan.name}.safetensors",
        samples,
        {**PROVENANCE, "content_hash": plan.content_hash, "cache_key": "k", **meta},
        encoding=encoding,
    )


def test_progress_figures_and_dataset_json_when_the_last_shard_is_done(tmp_path):
    plans = write_shard_plans(
        [TokenizedSample([3] * n, [1] * n) for n in (10, 20, 30)], 3, tmp_path / "plan"
    )
    dataset_path(tmp_path).write_text("{}")  # stale, from an earlier plan
    events = []
    run = ExtractionRun(
        tmp_path,
        plans,
        plan_info={"data_path": "/d.jsonl", "data_sha256": "s", "stats": {"x": 1}},
        on_change=lambda r, e: events.append(e),
    )
    assert not dataset_path(tmp_path).exists()
    run.shard_done(plans[0], _shard(tmp_path, plans[0]), reused=True)  # found on disk
    run.shard_started(plans[1].name)
    p = ShardProgress(plans[1].name, 0, 1, 12, 20, 12 * 2053, 0.5)
    run.shard_progress(p.shard, p.tokens_done, p.bytes_done, p.samples_done)
    f = run.figures()
    assert (f["shards_done"], f["shards_reused"], f["tokens_done"], f["num_tokens"]) == (
        1,
        1,
        22,
        60,
    )
    assert f["gb_written"] == round(12 * 2053 / 1e9, 4) and 0 < f["percent"] < 100
    run.shard_done(plans[1], _shard(tmp_path, plans[1]), reused=False)
    assert run.dataset is None and not dataset_path(tmp_path).exists()
    run.shard_done(plans[2], _shard(tmp_path, plans[2]), reused=False)
    ds = json.loads(dataset_path(tmp_path).read_text())
    assert ds == run.dataset and events[-1] == "complete"
    assert ds["format"] == "eyas-dataset/1" and ds["num_shards"] == 3 and ds["num_tokens"] == 60
    assert [s["file"] for s in ds["shards"]] == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
        "shard-00002.safetensors",
    ]
    for key, value in PROVENANCE.items():
        assert ds[key] == value, key
    assert ds["data"] == {"data_path": "/d.jsonl", "data_sha256": "s", "stats": {"x": 1}}
    assert [r["status"] for r in run.table()] == ["reused", "done", "done"]


def test_only_the_shard_that_completes_the_dataset_reports_it(tmp_path):
    """Two shards finishing together: the one whose count completed the dataset gets the manifest,
    the other None, also when the second finishes between the first's count and its return (here:
    inside the first's change event); a shard counted again gets None."""
    plans = write_shard_plans(
        [TokenizedSample([3] * n, [1] * n) for n in (10, 20)], 2, tmp_path / "plan"
    )
    shards = [_shard(tmp_path, p) for p in plans]
    got = {}

    def on_change(run, event):
        if event == "shard" and "last" not in got:
            got["last"] = run.shard_done(plans[1], shards[1], reused=False)

    run = ExtractionRun(tmp_path, plans, plan_info={}, on_change=on_change)
    first = run.shard_done(plans[0], shards[0], reused=False)
    assert first is None and got["last"] == run.dataset and run.dataset["num_shards"] == 2
    assert run.shard_done(plans[1], shards[1], reused=True) is None


def test_shards_that_disagree_make_no_dataset(tmp_path):
    plans = write_shard_plans(
        [TokenizedSample([3] * n, [1] * n) for n in (10, 20)], 2, tmp_path / "plan"
    )
    a = _shard(tmp_path, plans[0])
    b = _shard(tmp_path, plans[1], last_hidden_norm="pre")
    with pytest.raises(ValueError, match="shards disagree on last_hidden_norm"):
        build_dataset_manifest([a, b])


def test_fp8_error_is_summarised_over_shards(tmp_path):
    plans = write_shard_plans(
        [TokenizedSample([3] * n, [1] * n) for n in (10, 30)], 2, tmp_path / "plan"
    )
    ms = [_shard(tmp_path, p, encoding="fp8_e4m3") for p in plans]
    ds = build_dataset_manifest(ms)
    assert ds["encoding"] == "fp8_e4m3" and ds["fp8_error"]["aux"]["tokens"] == 40
    worst = max(m["fp8_error"]["aux"]["max_token_rel"] for m in ms)
    assert ds["fp8_error"]["aux"]["max_token_rel"] == worst
