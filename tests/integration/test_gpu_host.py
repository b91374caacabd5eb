"""flows/common.py gpu_host: one run per GPU host, and a run killed with -9 does not block the host.

Real processes against the session's real (temporary) Prefect server: the lock is an flock plus a
strict global concurrency limit, and both only mean something across processes.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.common import ROOT, ensure_host_limit, free_dead_slots, resolve_config

CHILD = """
import logging, os, sys, time
from flows.common import gpu_host, resolve_config
logging.basicConfig(level=logging.INFO)  # outside a flow run, gpu_host logs through plain logging
cfg = resolve_config("configs/local-tiny.yaml", {"server.host.name": sys.argv[1]})
with gpu_host(cfg):
    print("IN", time.time(), flush=True)
    while os.path.exists(sys.argv[2]):  # hold the host while the test keeps this file
        time.sleep(0.1)
print("OUT", time.time(), flush=True)
"""


def _child(host: str, hold: Path, env: dict, log: Path) -> subprocess.Popen:
    """A process that holds the host's GPU lock for as long as the file `hold` exists."""
    return subprocess.Popen([sys.executable, "-c", CHILD, host, str(hold)], cwd=ROOT, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for(log: Path, word: str, timeout: float) -> float | None:
    """The time the child printed `word` at, or None if it did not within timeout."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for line in log.read_text().splitlines():
            if line.startswith(word + " "):
                return float(line.split()[1])
        time.sleep(0.2)
    return None


def _active_slots(name: str) -> int:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(name).active_slots


@pytest.fixture
def child_env(prefect_harness, tmp_path):
    from prefect.settings import PREFECT_API_URL

    return {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "EYAS_LOCK_DIR": str(tmp_path / "locks"),
            "PYTHONPATH": str(ROOT)}


def test_a_second_run_waits_for_the_host_and_takes_it_when_the_first_is_killed(child_env, tmp_path):
    host = f"gpu-node-{os.getpid()}"
    name = ensure_host_limit(resolve_config("configs/local-tiny.yaml", {"server.host.name": host}))
    (tmp_path / "hold").touch()
    first = _child(host, tmp_path / "hold", child_env, tmp_path / "first.log")
    second = None
    try:
        assert _wait_for(tmp_path / "first.log", "IN", 60) is not None, (tmp_path / "first.log").read_text()
        assert _active_slots(name) == 1
        second = _child(host, tmp_path / "no-hold", child_env, tmp_path / "second.log")
        # The second waits as long as the first lives: never two servers on one host.
        assert _wait_for(tmp_path / "second.log", "IN", 15) is None, (tmp_path / "second.log").read_text()
        # kill -9: no cleanup runs, the Prefect slot stays taken; the kernel drops the flock.
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        assert _active_slots(name) == 1
        assert _wait_for(tmp_path / "second.log", "OUT", 60) is not None, (tmp_path / "second.log").read_text()
        assert second.wait(30) == 0
        assert _active_slots(name) == 0  # the second gave its own slot back, and the dead run's is gone
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def test_runs_on_one_host_take_turns(child_env, tmp_path):
    host, hold = f"gpu-node-turns-{os.getpid()}", tmp_path / "hold"
    hold.touch()
    a = _child(host, hold, child_env, tmp_path / "a.log")
    b = None
    try:
        assert _wait_for(tmp_path / "a.log", "IN", 60) is not None, (tmp_path / "a.log").read_text()
        b = _child(host, tmp_path / "no-hold", child_env, tmp_path / "b.log")
        end = time.monotonic() + 60
        while "waiting for GPU host" not in (tmp_path / "b.log").read_text() and time.monotonic() < end:
            time.sleep(0.2)
        assert "waiting for GPU host" in (tmp_path / "b.log").read_text(), (tmp_path / "b.log").read_text()
        hold.unlink()  # the first run stops its server and leaves
        assert a.wait(30) == 0 and b.wait(60) == 0
        a_out, b_in = _wait_for(tmp_path / "a.log", "OUT", 1), _wait_for(tmp_path / "b.log", "IN", 1)
        assert b_in >= a_out, (a_out, b_in)
        assert "kept by a killed run" not in (tmp_path / "b.log").read_text()  # a clean handover
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


def test_freeing_dead_slots_of_an_idle_host_changes_nothing(prefect_harness):
    name = ensure_host_limit(resolve_config("configs/local-tiny.yaml", {"server.host.name": "idle-node"}))
    assert free_dead_slots(name) == 0 and _active_slots(name) == 0
