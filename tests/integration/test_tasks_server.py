"""The server tasks inside real Prefect flow runs: progress artifact, events, failure states."""

import asyncio
import time

import pytest
from eyas_prefect.tasks.server import launch_server, wait_ready
from eyas_prefect.tasks.server import stop as stop_task
from prefect import flow

from eyas.server.hosts import LocalHost
from eyas.server.launch import capture_launch, stop_recorded
from tests.stage_config import stage_config


async def _events(prefix: str, since_s: float = 300) -> list[dict]:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        r = await client._client.post(
            "/events/filter",
            json={
                "filter": {
                    "event": {"prefix": [prefix]},
                    "occurred": {"since": _iso(time.time() - since_s)},
                },
                "limit": 50,
            },
        )
        return r.json()["events"]


def _iso(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


def _wait_for_events(
    prefix: str, resource_id: str, names: set[str], timeout: float = 20
) -> set[str]:
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    while time.monotonic() < deadline and not names <= seen:
        seen = {
            e["event"]
            for e in asyncio.run(_events(prefix))
            if e["resource"]["prefect.resource.id"] == resource_id
        }
        time.sleep(0.5)
    return seen


@flow
def serve_and_stop(cfg):
    handle = launch_server(cfg)
    try:
        return wait_ready(cfg, handle)
    finally:
        stop_task(cfg, handle)


def test_ready_server_gives_progress_artifact_and_events(prefect_harness, tmp_path, random_target):
    from prefect.client.orchestration import get_client

    # capitals, '_' and '.' are fine in a run name but not in a Prefect artifact key: the key is
    # normalised
    # two replicas: each one's load is a table row, and an event as it changes
    cfg = stage_config(tmp_path, random_target, **{"name": "Sensor_OK.1", "server.dp_size": 2})
    ready = serve_and_stop(cfg)
    assert ready.shards_total >= 8 and ready.replicas == {"DP0": "loaded", "DP1": "loaded"}

    async def artifact():
        async with get_client() as client:
            return await client.read_latest_artifacts()

    latest = {a.key: a for a in asyncio.run(artifact())}
    assert (
        latest["load-sensor-ok-1"].type == "progress"
        and float(latest["load-sensor-ok-1"].data) == 100.0
    )
    table = latest["replicas-sensor-ok-1"]
    assert table.type == "table" and "loaded" in str(table.data) and "DP1" in str(table.data)
    rid = f"eyas.server.localhost.{cfg.server.port}"
    wanted = {"eyas.server.loading", "eyas.server.replicas", "eyas.server.ready"}
    assert wanted <= _wait_for_events("eyas.server.", rid, wanted)


def test_crash_fails_the_task_with_the_reason_and_stops_the_server(
    prefect_harness, tmp_path, random_target
):
    cfg = stage_config(
        tmp_path,
        random_target,
        **{
            "name": "sensor-oom",
            "server.launch_args": ["--fault", "oom-at-shard", "--fault-shard", "3"],
        },
    )
    state = serve_and_stop(cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match="oom") as e:
        state.result()
    assert "CUDA out of memory" in str(e.value)
    assert not cfg.server.pid_path.exists()  # the flow's finally stopped it
    assert stop_recorded(LocalHost(), capture_launch(cfg))["outcome"] == "not running"
    rid = f"eyas.server.localhost.{cfg.server.port}"
    assert "eyas.server.failed" in _wait_for_events("eyas.server.", rid, {"eyas.server.failed"})
