"""`eyas worker`'s pieces that need no Prefect server: which flow runs a worker started, and the
line it says when a signal stops it (the worker itself: tests/integration/test_operator.py)."""

import os
import signal
import subprocess
import sys

from eyas_prefect.flows.runtime.worker import flow_runs_of, stop_line


def test_the_flow_runs_of_a_process_are_its_children_that_name_a_flow_run():
    env = {**os.environ, "PREFECT__FLOW_RUN_ID": "7f0c-run"}
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    run = subprocess.Popen(sleep, env=env)
    other = subprocess.Popen(sleep, env={k: v for k, v in env.items() if "FLOW_RUN" not in k})
    try:
        assert flow_runs_of(os.getpid()) == [(run.pid, "7f0c-run")]
        assert flow_runs_of(run.pid) == []
    finally:
        for p in (run, other):
            p.kill()
            p.wait()


def test_the_stop_line_names_the_runs_that_go_on():
    assert stop_line(signal.SIGTERM, 10, [(11, "abc"), (12, "def")]) == (
        "eyas worker: SIGTERM: stopped the Prefect worker (pid 10); the flow runs it started go on "
        "in their own processes: abc (pid 11), def (pid 12)"
    )
    assert stop_line(signal.SIGINT, 10, []) == (
        "eyas worker: SIGINT: stopped the Prefect worker (pid 10); no flow run of it was running"
    )
