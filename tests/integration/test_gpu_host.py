"""flows/runtime/host_lock.py gpu_host: one run per GPU host, whatever lock directory or label each
run has, and a run killed with -9 does not block the host.

Real processes against the session's real (temporary) Prefect server: the holder record and the
concurrency limit live there, and both only mean something across processes.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from eyas_prefect.flows.common import ROOT, resolve_config
from eyas_prefect.flows.runtime.host_lock import ensure_host_limit

# A flow run that holds the GPU host while the file argv[2] exists (argv[1]: the host's label).
CHILD = """
import logging, os, sys, time
from prefect import flow
from eyas_prefect.flows.common import resolve_config
from eyas_prefect.flows.runtime.host_lock import gpu_host
logging.basicConfig(level=logging.INFO)

@flow(name="hold-gpu-host")
def hold(label: str, keep: str):
    with gpu_host(resolve_config("configs/local-tiny.yaml", {"server.host.name": label})):
        print("IN", time.time(), flush=True)
        while os.path.exists(keep):
            time.sleep(0.1)
    print("OUT", time.time(), flush=True)

hold(sys.argv[1], sys.argv[2])
"""


def _child(label: str, hold: Path, env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, label, str(hold)],
        cwd=ROOT,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


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


def _kill(*procs) -> None:
    for p in procs:
        if p is not None and p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


@pytest.fixture
def child_env(prefect_harness, tmp_path):
    """Each child gets its own lock directory: the lock must not depend on one."""
    from prefect.settings import PREFECT_API_URL

    def env(lock_dir: str) -> dict:
        return {
            **os.environ,
            "PREFECT_API_URL": PREFECT_API_URL.value(),
            "PYTHONPATH": str(ROOT),
            "EYAS_LOCK_DIR": str(tmp_path / lock_dir),
        }

    return env


def test_two_runs_with_other_lock_dirs_take_turns_and_a_killed_holder_is_reclaimed(
    child_env, tmp_path
):
    """The second run waits while the first holds, though each has its own EYAS_LOCK_DIR; once the
    holder is killed with -9, the second takes the host and the slot the dead one kept."""
    label = "gpu-node-shared"
    name = ensure_host_limit(resolve_config("configs/local-tiny.yaml", {"server.host.name": label}))
    (tmp_path / "hold").touch()
    first = _child(label, tmp_path / "hold", child_env("locks-a"), tmp_path / "first.log")
    second = None
    try:
        assert _wait_for(tmp_path / "first.log", "IN", 90) is not None, (
            tmp_path / "first.log"
        ).read_text()
        assert _active_slots(name) == 1
        second = _child(label, tmp_path / "no-hold", child_env("locks-b"), tmp_path / "second.log")
        assert _wait_for(tmp_path / "second.log", "IN", 20) is None, (
            tmp_path / "second.log"
        ).read_text()
        log = (tmp_path / "second.log").read_text()
        assert f"waiting for GPU host {label} ({name}): held by flow run" in log, log
        assert _active_slots(name) == 1  # still the first run's
        # kill -9: no cleanup runs; its record and its slot stay in Prefect, its flow run stays
        # Running.
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        assert _wait_for(tmp_path / "second.log", "OUT", 60) is not None, (
            tmp_path / "second.log"
        ).read_text()
        assert second.wait(60) == 0
        log = (tmp_path / "second.log").read_text()
        assert "took it from flow run" in log and "is gone" in log, log
        assert f"gave back 1 slot(s) of {name} kept by a killed run" in log, log
        assert _active_slots(name) == 0
    finally:
        _kill(first, second)


def test_runs_on_one_host_take_turns_cleanly(child_env, tmp_path):
    name = ensure_host_limit(resolve_config("configs/local-tiny.yaml"))
    hold = tmp_path / "hold"
    hold.touch()
    a = _child("node", hold, child_env("locks"), tmp_path / "a.log")
    b = None
    try:
        assert _wait_for(tmp_path / "a.log", "IN", 90) is not None, (tmp_path / "a.log").read_text()
        b = _child("node", tmp_path / "no-hold", child_env("locks"), tmp_path / "b.log")
        end = time.monotonic() + 60
        while (
            "waiting for GPU host" not in (tmp_path / "b.log").read_text()
            and time.monotonic() < end
        ):
            time.sleep(0.2)
        assert "waiting for GPU host" in (tmp_path / "b.log").read_text(), (
            tmp_path / "b.log"
        ).read_text()
        hold.unlink()  # the first run stops its server and leaves
        assert a.wait(30) == 0 and b.wait(60) == 0
        a_out, b_in = (
            _wait_for(tmp_path / "a.log", "OUT", 1),
            _wait_for(tmp_path / "b.log", "IN", 1),
        )
        assert b_in >= a_out, (a_out, b_in)
        log = (tmp_path / "b.log").read_text()
        assert "kept by a killed run" not in log and "took it from" not in log  # a clean handover
        assert _active_slots(name) == 0
    finally:
        _kill(a, b)


def test_a_holder_elsewhere_is_waited_for_until_its_flow_run_is_final(prefect_harness):
    """A holder on another machine cannot be checked by pid: only its flow run's final state frees
    it."""
    import threading

    from eyas_prefect.flows.runtime.host_lock import gpu_host, this_machine
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import VariableCreate
    from prefect.states import Crashed, Running

    @flow(name="elsewhere")
    def elsewhere():
        from prefect.runtime import flow_run

        return str(flow_run.id)

    cfg = resolve_config("configs/local-tiny.yaml")
    name = ensure_host_limit(cfg)
    state = elsewhere(return_state=True)
    run_id = state.result()
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(run_id, state=Running(), force=True)  # as if it were still going
        record = {
            **this_machine(),
            "hostname": "gpu-node-far",
            "machine": "f" * 32,
            "run": run_id,
            "run_name": "elsewhere",
            "pid": 1,
            "start": "1",
            "since": "earlier",
        }
        client.create_variable(VariableCreate(name=name, value=record))
    entered = threading.Event()

    def take():
        with gpu_host(cfg):
            entered.set()

    t = threading.Thread(target=take, daemon=True)
    t.start()
    try:
        assert not entered.wait(5), "took the host from a holder whose run is still Running"
        with get_client(sync_client=True) as client:
            client.set_flow_run_state(run_id, state=Crashed(message="worker lost"), force=True)
        assert entered.wait(30), "did not take the host from a Crashed run"
    finally:
        t.join(30)
        with get_client(sync_client=True) as client:
            assert client.read_variable_by_name(name) is None
