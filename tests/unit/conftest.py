"""Fixtures the training tests share: a sharpened random target and two shards of its states."""

import pytest

from tests.helpers_training import sharpen_target, write_shards


@pytest.fixture(scope="session")
def sharp_target(random_target, tmp_path_factory):
    return sharpen_target(random_target, tmp_path_factory.mktemp("sharp-target"))


@pytest.fixture(scope="session")
def shards(sharp_target, tmp_path_factory):
    return write_shards(
        sharp_target, tmp_path_factory.mktemp("shards"), num_shards=2, per_shard=12, length=40
    )
