"""The plan's budgets: the shards against free disk, the drafter's training memory against the
GPU."""

from __future__ import annotations

from eyas.preflight import preflight
from tests.tiny_config import fields, tiny


def test_too_little_disk_is_refused_naming_the_output_dir(tmp_path):
    r = preflight(
        tiny(tmp_path), free_bytes=100_000_000
    )  # 0.1 GB: less than the shards + 1 GB kept free
    assert fields(r) == ["extraction.output_dir"] and str(tmp_path / "shards") in r.problems[0]
    r = preflight(
        tiny(tmp_path, **{"extraction.keep_free_gb": 0}), free_bytes=int(r.plan.total_bytes) + 1
    )
    assert r.ok, r.problems


def test_memory_over_the_gpu_is_refused_naming_the_batch_size(tmp_path):
    cfg = tiny(tmp_path, **{"plan.gpu_memory_gb": 0.1, "training.device": "cuda"})
    r = preflight(cfg)
    assert fields(r) == ["training.batch_size"] and "plan.gpu_memory_gb=0.1" in r.problems[0]
    assert r.plan.train_memory_gb > 0.1
    assert preflight(
        tiny(tmp_path, **{"plan.gpu_memory_gb": 0.1, "training.device": "cpu"})
    ).ok  # not a GPU
