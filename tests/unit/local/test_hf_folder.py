"""A Hugging Face checkpoint folder written in shards (saving the tiny target through it:
test_tiny_target.py)."""

from __future__ import annotations

import pytest

from eyas.local import hf_folder


def test_plan_shards_cuts_contiguous_runs_of_exactly_the_asked_number():
    plan = hf_folder.plan_shards([100, 1, 1, 1, 50, 50, 1, 1, 1, 1], 8)
    assert plan == sorted(plan) and set(plan) == set(range(8))
    with pytest.raises(ValueError, match="num_shards"):
        hf_folder.plan_shards([1, 2], 3)
