"""Progress artifacts of the long stages against a real Prefect server: training's `train-NAME` and
`train-losses-NAME`, regeneration's `regenerate-NAME`; written at a bounded rate, right at the
end."""

import json
import time

import eyas_prefect.tasks.progress as progress
import pytest
import torch
from prefect import flow

from tests.stage_config import stage_config

torch.set_num_threads(1)


def artifacts(key: str) -> list:
    """Every version of an artifact key, oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]))
        )
    return sorted(found, key=lambda a: a.created)


@pytest.fixture
def counted(monkeypatch):
    """Every progress value written (creations and updates) and every table written, in order."""
    writes = {"progress": [], "tables": 0}
    create, update, table = (
        progress.create_progress_artifact,
        progress.update_progress_artifact,
        progress.create_table_artifact,
    )

    def create_(**kw):
        writes["progress"].append(kw["progress"])
        return create(**kw)

    def update_(**kw):
        writes["progress"].append(kw["progress"])
        return update(**kw)

    def table_(**kw):
        writes["tables"] += 1
        return table(**kw)

    monkeypatch.setattr(progress, "create_progress_artifact", create_)
    monkeypatch.setattr(progress, "update_progress_artifact", update_)
    monkeypatch.setattr(progress, "create_table_artifact", table_)
    return writes


def test_training_shows_its_progress_and_loss_table_at_a_bounded_rate(
    prefect_harness, random_target, tmp_path, counted
):
    from eyas_prefect.tasks.train import train

    from eyas.extraction.shards import ShardManifest, verify_shard
    from tests.helpers_training import sharpen_target, write_shards

    target = sharpen_target(random_target, tmp_path / "sharp")
    cfg = stage_config(
        tmp_path,
        target,
        **{
            "name": "Train_Progress.1",
            "training.max_steps": 200,
            "training.batch_size": 2,
            "training.ttt_steps": 3,
            "training.draft_vocab_size": 256,
            "training.precision": "fp32",
            "training.device": "cpu",
            "training.warmup_steps": 5,
            "training.checkpoint_every": 1000,
            "training.eval_every": 100,
            "training.num_validation_sequences": 4,
        },
    )
    shards = write_shards(target, cfg.extraction.output_dir, num_shards=1, per_shard=12, length=24)

    @flow
    def train_only():
        return train(cfg, [ShardManifest.from_json(verify_shard(p)) for p in shards])

    t0 = time.monotonic()
    result = train_only()
    elapsed = time.monotonic() - t0
    # Bounded: at most one progress write per PUBLISH_EVERY_S (plus the first and the end), far
    # fewer than the 200 steps; one table per TABLE_EVERY_S (plus the first and the end).
    writes = counted["progress"]
    assert 2 <= len(writes) <= min(200 // 5, elapsed / progress.PUBLISH_EVERY_S + 3), (
        len(writes),
        elapsed,
    )
    assert 1 <= counted["tables"] <= elapsed / progress.TABLE_EVERY_S + 3
    assert writes == sorted(writes) and writes[-1] == 100.0 and writes[0] < 100.0

    # The UI's figures: progress 100 at the end; the table is the result's history, right to the
    # last row.
    (bar,) = artifacts("train-train-progress-1")
    assert bar.type == "progress" and bar.data == 100.0 and "step 200/200" in bar.description
    tables = artifacts("train-losses-train-progress-1")
    assert len(tables) == counted["tables"] and tables[-1].type == "table"
    rows = json.loads(tables[-1].data)  # newest step first
    assert (
        rows == result.history[::-1]
        and rows[0]["step"] == 200
        and rows[0]["loss"] == round(result.losses[-1], 5)
    )
    assert 50 <= len(rows) <= 105 and set(rows[0]) >= {
        "step",
        "loss",
        "acc_0",
        "acc_1",
        "acc_2",
        "lr",
        "tokens_per_s",
    }
    assert [r["step"] for r in rows if r["heldout_acceptance"] is not None] == [200, 100]
    assert rows[0]["heldout_acceptance"] == round(result.simulated_acceptance_length, 4)


def test_regeneration_progress_is_throttled_and_complete_at_the_end(
    prefect_harness, tmp_path, counted
):
    from eyas.extraction.regenerate import RegenerationProgress

    @flow
    def regenerate_like():
        publish = progress.RegenerationPublisher("regen-test")  # in the run, as the task makes it
        t0 = time.monotonic()
        for done in range(1, 2001):  # 2000 conversations over 4 parts, as fast as they come
            parts = done // 500
            publish(
                RegenerationProgress(
                    parts, 4, done, 2000, 0, 30 * done, time.monotonic() - t0 + 1.0
                )
            )

    regenerate_like()
    assert (
        2 <= len(counted["progress"]) <= 10
        and counted["progress"][0] == 0.0
        and counted["progress"][-1] == 100.0
    )
    (bar,) = artifacts("regenerate-regen-test")
    assert bar.data == 100.0 and "4/4 parts, 2000/2000 conversations" in bar.description
    assert "tok/s" in bar.description and "ETA 0s" in bar.description
