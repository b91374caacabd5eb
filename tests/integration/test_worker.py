"""`eyas worker` (flows/runtime/worker.py) with a run in flight, on a Prefect server of its own:
one SIGTERM stops the worker, and the run goes on to its end in its own process."""

import signal
import time
import urllib.request

import pytest

from eyas.server.hosts import LocalHost
from tests.prefect_server import ROOT, sigterm_worker, wait_flow_run

pytestmark = pytest.mark.slow


def test_one_sigterm_stops_a_worker_with_a_run_in_flight_and_the_run_completes(tmp_path, small):
    """The operator's case: the worker started as a script's background job (SIGINT ignored, which
    made Prefect's own worker deaf to its first SIGTERM), an extract run in flight (its server up,
    the GPU host held). One SIGTERM: the worker exits within seconds naming the run, and the run
    goes on in its own process to Completed, its subflows final, its server stopped and the GPU
    host given back, with no broken pipe on the way. On a Prefect server of its own, so that no
    other worker takes the run."""
    from eyas.config import load_config
    from eyas.server.launch import stop_recorded
    from tests.prefect_server import deploy_as_documented, deployment_run, start_prefect_server

    (tmp_path / "prefect").mkdir()
    srv = start_prefect_server(tmp_path / "prefect")
    try:
        deploy_as_documented(srv, worker=False)
        log = srv.home / "worker.log"
        worker = srv.start_worker(
            log.name, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)
        )
        overrides = small("op-inflight")
        cfg = load_config(ROOT / "configs" / "local-tiny.yaml", overrides)
        run_id = deployment_run(srv, "eyas-extract/extract", overrides)
        deadline = time.monotonic() + 240
        while True:  # in flight: its target server answers
            try:
                with urllib.request.urlopen(f"{cfg.server.url}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.2)
        out = sigterm_worker(worker, log)
        assert f"go on in their own processes: {run_id} (pid " in out, out[-3000:]

        run = wait_flow_run(srv, run_id, timeout=240)
        subs = srv.post(
            "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [run_id]}}}
        )
        logs = srv.post(
            "/logs/filter",
            {"logs": {"flow_run_id": {"any_": [run_id, *(r["id"] for r in subs)]}}, "limit": 200},
        )
        assert run["state"]["type"] == "COMPLETED", (
            run["state"],
            [x["message"][:300] for x in logs if x["level"] >= 30],
        )
        assert subs and all(r["state"]["type"] == "COMPLETED" for r in subs), [
            (r["name"], r["state"]["type"]) for r in subs
        ]
        assert not [
            x for x in logs if "Broken pipe" in x["message"] or "BrokenPipe" in x["message"]
        ]
        assert not cfg.server.pid_path.exists()
        assert stop_recorded(LocalHost(), cfg)["outcome"] == "not running"
        held = srv.post("/variables/filter", {"variables": {"name": {"like_": "eyas-gpu-host-"}}})
        assert held == [], held
    finally:
        srv.stop()
