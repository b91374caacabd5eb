"""eyas/results.py: the records the stages hand each other are frozen and keep the stages'
objects."""

from __future__ import annotations

import dataclasses

import pytest

from eyas.extraction.shards import ShardManifest
from eyas.results import Extracted
from eyas.server.sglang_patch import PatchReport


def _manifest(num_tokens: int) -> ShardManifest:
    return ShardManifest(
        file=f"shard-{num_tokens}.safetensors",
        num_samples=2,
        num_tokens=num_tokens,
        bytes=10,
        sha256="0" * 64,
        dtype="bfloat16",
        encoding="plain",
        hidden_size=64,
        num_aux_layers=3,
    )


def test_extracted_counts_the_tokens_of_every_shard_and_is_frozen():
    extracted = Extracted(
        [_manifest(100), _manifest(23)],
        prompts=[[1, 2]],
        data_stats={},
        patch=PatchReport("local", "localhost", "not needed"),
    )
    assert extracted.num_tokens == 123
    assert extracted.ready is None and extracted.stages == {}
    with pytest.raises(dataclasses.FrozenInstanceError):
        extracted.prompts = []
