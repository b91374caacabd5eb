"""The extraction section: shards, encoding, and further servers (endpoints) with their dump
folders."""

from __future__ import annotations

import pytest

from eyas.config import ConfigError, load_config
from eyas.config.extraction import EndpointConfig, ExtractionConfig
from tests.stage_config import ROOT


def test_an_endpoints_dump_dir_must_be_absolute_and_its_url_http():
    e = EndpointConfig(url="http://gpu-node-2:30000", dump_dir="/dev/shm/d")
    assert e.host is None and e.concurrency is None
    with pytest.raises(
        ValueError, match="endpoint http://gpu-node-2:30000: dump_dir must be absolute, got d"
    ):
        EndpointConfig(url="http://gpu-node-2:30000", dump_dir="d")
    with pytest.raises(ValueError, match="url"):
        EndpointConfig(url="gpu-node-2:30000", dump_dir="/d")


def test_extraction_encoding_and_limits(tmp_path):
    assert ExtractionConfig(output_dir=tmp_path).encoding == "plain"
    with pytest.raises(ConfigError, match=r"extraction\.encoding"):
        load_config(ROOT / "configs" / "local-tiny.yaml", {"extraction.encoding": "fp4"})
    with pytest.raises(ConfigError, match=r"extraction\.concurrency"):
        load_config(ROOT / "configs" / "local-tiny.yaml", {"extraction.concurrency": 0})
