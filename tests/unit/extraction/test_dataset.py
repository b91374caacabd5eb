"""The whole extraction's bytes: estimated from the shard plans (shards already on disk count
nothing), and refused up front when the output disk would keep less than extraction.keep_free_gb."""

import pytest

from eyas.extraction.dataset import DiskSpaceError, check_disk_space


def test_disk_space_estimate_counts_missing_shards_and_refuses_with_a_clear_error(tmp_path):
    import torch

    from eyas.extraction.data import TokenizedSample, write_shard_plans
    from eyas.extraction.dataset import HEADER_BYTES, estimate_bytes
    from eyas.extraction.shards import Sample, write_shard

    plans = write_shard_plans(
        [TokenizedSample([3] * n, [1] * n) for n in (10, 20, 30, 40)], 2, tmp_path / "plan"
    )
    per_token = 4 * 256 * 2 + 5  # 3 aux layers + last, H=256, bf16, + id and mask
    full = estimate_bytes(plans, 256, 3, "bfloat16", "plain", tmp_path)
    assert full == 100 * per_token + 8 * 6 + 2 * HEADER_BYTES
    # A shard already on disk for this plan, dtype and encoding needs no more space.
    m = write_shard(
        tmp_path / "shard-00000.safetensors",
        [
            Sample(
                torch.full((n,), 3),
                torch.ones(n, dtype=torch.bool),
                torch.zeros(n, 768, dtype=torch.bfloat16),
                torch.zeros(n, 256, dtype=torch.bfloat16),
            )
            for n in (10, 20)
        ],
        {"content_hash": plans[0].content_hash},
    )
    assert (
        estimate_bytes(plans, 256, 3, "bfloat16", "plain", tmp_path)
        == full - 30 * per_token - 8 * 3 - HEADER_BYTES
    )
    assert m["bytes"] <= 30 * per_token + 8 * 3 + HEADER_BYTES
    fp8 = estimate_bytes(plans, 256, 3, "bfloat16", "fp8_e4m3", tmp_path / "elsewhere")
    assert fp8 - 2 * HEADER_BYTES < (full - 2 * HEADER_BYTES) * 0.53
    with pytest.raises(
        DiskSpaceError,
        match=r"needs 5\.00 GB more and must leave "
        r"extraction\.keep_free_gb"
        r"=1000000\.0 GB free, but the disk has .* GB free",
    ):
        check_disk_space(tmp_path / "out", 5_000_000_000, keep_free_gb=1e6)
    assert check_disk_space(tmp_path / "out", 1000, keep_free_gb=0)["needed_bytes"] == 1000
