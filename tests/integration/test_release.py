"""flows/release.py against a real Prefect server, the documented deployments and a worker: a
pipeline run killed outright mid-extraction (kill -9 of its flow-run process) lets go of what it
held at once. The worker marks it Crashed; the `release` deployment's trigger runs `release`, which
marks its extract subflow Crashed, gives back the GPU host and stops the server it launched."""

import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from eyas.config import load_config
from eyas.server.hosts import LocalHost
from eyas.server.launch import read_record
from tests.prefect_server import (
    ROOT,
    deploy_as_documented,
    deployment_run,
    start_prefect_server,
    wait_flow_run,
)

pytestmark = pytest.mark.slow


def flow_run_process(run_id: str) -> int:
    """The pid of the process running flow run `run_id` (its environment names it)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PREFECT__FLOW_RUN_ID={run_id}".encode() in env:
            return int(proc.name)
    raise AssertionError(f"no process runs flow run {run_id}")


def released(srv, run_id: str) -> list[dict]:
    """The flow runs of `release` made for the flow run `run_id`."""
    return [
        r for r in srv.post("/flow_runs/filter", {}) if r["parameters"].get("flow_run_id") == run_id
    ]


def test_a_run_killed_outright_lets_go_of_its_subflows_gpu_host_and_server(tmp_path, small):
    (tmp_path / "prefect").mkdir()
    srv = start_prefect_server(tmp_path / "prefect")
    try:
        deploy_as_documented(srv)
        overrides = small("killed")
        cfg = load_config(ROOT / "configs" / "local-tiny.yaml", overrides)
        run_id = deployment_run(srv, "eagle3-pipeline/pipeline", overrides)
        deadline = time.monotonic() + 240
        while True:  # extraction in flight: the target server answers, the GPU host is held
            try:
                with urllib.request.urlopen(f"{cfg.server.url}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server never came up"
                time.sleep(0.2)
        server_pid = read_record(LocalHost(), cfg.server).pid
        os.kill(flow_run_process(run_id), signal.SIGKILL)

        run = wait_flow_run(srv, run_id, timeout=120)
        assert run["state"]["type"] == "CRASHED", run["state"]
        deadline = time.monotonic() + 60
        while not (mine := released(srv, run_id)):  # the trigger's run of `release`
            assert time.monotonic() < deadline, "no release run was triggered"
            time.sleep(1)
        release = wait_flow_run(srv, mine[0]["id"], timeout=180)
        logs = srv.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [release["id"]]}}})
        assert release["state"]["type"] == "COMPLETED", (
            release["state"]["message"][:2000],
            [x["message"][:500] for x in logs],
        )
        assert release["name"] == f"release-{run_id}"

        subs = srv.post(
            "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}}
        )
        assert subs and all(r["state"]["type"] in ("CRASHED", "COMPLETED") for r in subs), [
            (r["name"], r["state"]["type"]) for r in subs
        ]
        assert any(
            r["name"].startswith("extract-") and r["state"]["type"] == "CRASHED" for r in subs
        )
        held = srv.post("/variables/filter", {"variables": {"name": {"like_": "eyas-gpu-host-"}}})
        assert held == [], held
        assert not LocalHost().is_alive(server_pid) and not cfg.server.pid_path.exists()
    finally:
        srv.stop()
