"""extraction.endpoints name the host each server dumps on; the collector's endpoints carry it."""

from pathlib import Path

import pytest

from eyas.config import ConfigError
from eyas.extraction import stage
from tests.stage_config import stage_config

TINY = Path(__file__).resolve().parents[3] / "fixtures" / "tiny-target"
NODE2 = {"kind": "ssh", "name": "gpu-node-2", "hostname": "10.0.0.2", "known_hosts": "/dev/null"}


def test_each_endpoint_carries_the_host_it_dumps_on(tmp_path):
    cfg = stage_config(
        tmp_path,
        TINY,
        **{
            "extraction.collect_workers": 3,
            "extraction.endpoints": [
                {"url": "http://10.0.0.2:30000", "dump_dir": "/dev/shm/eyas-dump", "host": NODE2},
                {"url": "http://10.0.0.3:30000", "dump_dir": "/mnt/node-3/dump"},
            ],
        },
    )
    launched, node2, shared = stage.endpoints(cfg)
    assert (
        launched.dump_host == cfg.server.host and launched.records.route == "local"
    )  # a local host: no probe
    assert (
        node2.dump_host.hostname == "10.0.0.2" and node2.records.route is None
    )  # decided at first use
    assert node2.records.field == "extraction.endpoints[0].host" and node2.records.connections == 4
    assert node2.records.where == "gpu-node-2:/dev/shm/eyas-dump"
    assert shared.dump_host is None and shared.records.route == "local"  # a path on this machine
    # the dump host is part of an endpoint's identity (the process-wide pools are keyed by it)
    same_without_host = stage.endpoints(
        stage_config(
            tmp_path,
            TINY,
            **{
                "extraction.endpoints": [
                    {"url": "http://10.0.0.2:30000", "dump_dir": "/dev/shm/eyas-dump"}
                ]
            },
        )
    )[1]
    assert same_without_host != node2 and stage.endpoints(cfg)[1] == node2


def test_an_endpoint_host_is_checked_like_the_servers(tmp_path):
    with pytest.raises(ConfigError, match="known_hosts"):
        stage_config(
            tmp_path,
            TINY,
            **{
                "extraction.endpoints": [
                    {
                        "url": "http://10.0.0.2:30000",
                        "dump_dir": "/d",
                        "host": {"kind": "ssh", "hostname": "10.0.0.2"},
                    }
                ]
            },
        )
