"""Data-parallel replicas of eyas-local: the command a worker replica is started with."""

from __future__ import annotations

from eyas.local.arguments import parse_args
from eyas.local.replicas import worker_argv


def test_a_worker_overrides_the_fronts_port_replicas_warmup_and_fault():
    front = [
        "--model-path",
        "x",
        "--host",
        "0.0.0.0",
        "--port",
        "30000",
        "--dp-size",
        "4",
        "--fault",
        "oom-at-shard",
    ]
    w = parse_args(worker_argv(front, 40001, 3))
    assert (w.model_path, w.host, w.port, w.dp_size, w.fault) == (
        "x",
        "127.0.0.1",
        40001,
        1,
        "none",
    )
    assert w.skip_server_warmup and w.dp_worker and w.dp_rank == 3
    assert (
        worker_argv(front, 40001, 3)[: len(front)] == front
    )  # the front's own flags, overridden after them
