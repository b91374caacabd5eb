"""SIGTERM and SIGINT stop an `eyas run` within seconds (issue 16, part 8).

A real `eyas run` of the embedded default (reduced, temp dirs, a free port) in its own process
group, signalled once its target server is up, the way `timeout`, CI and `kill -- -PGID` signal:
the whole group. The run must exit within GRACE seconds with its server gone and every flow run it
started in a final state, read back from the Prefect database afterwards through a real Prefect
server (tests/prefect_server.py).
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from eyas.server.hosts import LocalHost, wait_dead
from tests import eyas_run
from tests.prefect_server import start_prefect_server

GRACE = 20.0
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _temporary_servers(home: Path) -> list[int]:
    """Prefect servers running on `home`'s database (a temporary server left behind, say)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes()
            if (
                b"prefect.server.api.server" in cmd
                and f"PREFECT_HOME={home}".encode() in (proc / "environ").read_bytes()
            ):
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


def _signal_once_serving(
    tmp_path: Path, sig: int, api_url: str | None, name: str
) -> tuple[float, int | None, int]:
    """Start the run, signal its process group once its server is ready; (seconds to exit, exit
    code, server pid)."""
    data = eyas_run.small_data(tmp_path)
    (tmp_path / "prefect").mkdir()
    run = eyas_run.command("run", eyas_run.overrides(tmp_path, data, name=name))
    log = tmp_path / "run.log"
    proc = subprocess.Popen(
        run,
        cwd=eyas_run.ROOT,
        env=eyas_run.env(tmp_path, api_url),
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = None
    try:
        server = eyas_run.wait_for_server(tmp_path, log, proc)["pid"]
        t0 = time.monotonic()
        os.killpg(proc.pid, sig)
        try:
            code = proc.wait(GRACE + 30)
        except subprocess.TimeoutExpired:
            code = None
        return time.monotonic() - t0, code, server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        if server is not None and LocalHost().is_alive(server):
            LocalHost().kill_group(server, signal.SIGKILL)
        for pid in _temporary_servers(tmp_path / "prefect"):
            os.kill(pid, signal.SIGKILL)


def _flow_runs(home: Path) -> list[dict]:
    server = start_prefect_server(home)
    try:
        return server.post("/flow_runs/filter", {})
    finally:
        server.stop()


def test_sigterm_ends_an_eyas_run_on_a_temporary_prefect_server_within_seconds(tmp_path):
    """No PREFECT_API_URL: `eyas run` brings its own temporary server, which the group's SIGTERM
    must not take down before the run has recorded how it ended."""
    took, code, server = _signal_once_serving(tmp_path, signal.SIGTERM, None, "sigterm")
    log = (tmp_path / "run.log").read_text()
    assert code is not None and took < GRACE, (
        f"still running {took:.0f} s after SIGTERM:\n{log[-4000:]}"
    )
    assert code == 128 + signal.SIGTERM, log[-4000:]
    assert wait_dead(LocalHost(), server, 5), "the run's server outlived it"
    assert not (tmp_path / "server" / "server.pid").exists()
    end = time.monotonic() + 15
    while _temporary_servers(tmp_path / "prefect") and time.monotonic() < end:
        time.sleep(0.5)
    assert not _temporary_servers(tmp_path / "prefect"), (
        "the temporary Prefect server outlived the run"
    )
    runs = _flow_runs(tmp_path / "prefect")
    states = {r["name"]: (r["state_type"], r["state"]["message"]) for r in runs}
    assert runs and all(t in FINAL for t, _ in states.values()), states
    state, message = states["eagle3-sigterm@localhost"]
    assert state == "CRASHED" and "termination signal" in message, states


def test_sigint_ends_an_eyas_run_on_a_prefect_server_within_seconds(tmp_path, prefect_harness):
    """With PREFECT_API_URL set (the session's real server), Ctrl-C ends it the same way."""
    from prefect.settings import PREFECT_API_URL

    took, code, server = _signal_once_serving(
        tmp_path, signal.SIGINT, PREFECT_API_URL.value(), "sigint"
    )
    log = (tmp_path / "run.log").read_text()
    assert code is not None and took < GRACE, (
        f"still running {took:.0f} s after SIGINT:\n{log[-4000:]}"
    )
    assert wait_dead(LocalHost(), server, 5), "the run's server outlived it"
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_="-sigint@"))
        )
    assert runs and all(r.state.is_final() for r in runs), [(r.name, r.state) for r in runs]


def test_the_temporary_prefect_server_ends_with_its_eyas_process_even_on_kill_9(tmp_path):
    """No orphan API: the temporary server, deaf to signals, still goes when its eyas process
    goes."""
    (tmp_path / "prefect").mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from eyas_prefect.flows.runtime.process import TemporaryServer; "
            "s = TemporaryServer(); print(s.url, flush=True); time.sleep(300)",
        ],
        cwd=eyas_run.ROOT,
        env=eyas_run.env(tmp_path, None),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        url = holder.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:"), url
        servers = _temporary_servers(tmp_path / "prefect")
        assert len(servers) == 1
        os.killpg(
            holder.pid, signal.SIGKILL
        )  # no handler, no atexit: only the kernel closing its pipe
        holder.wait(10)
        end = time.monotonic() + 15
        while _temporary_servers(tmp_path / "prefect") and time.monotonic() < end:
            time.sleep(0.2)
        assert not _temporary_servers(tmp_path / "prefect"), (
            "the temporary server outlived its eyas process"
        )
    finally:
        if holder.poll() is None:
            os.killpg(holder.pid, signal.SIGKILL)
        for pid in _temporary_servers(tmp_path / "prefect"):
            os.kill(pid, signal.SIGKILL)


def test_kill_9_ends_the_runs_server_and_the_next_run_closes_its_flow_runs(
    tmp_path, prefect_harness
):
    """kill -9 of `eyas run`: its local target server exits with it (eyas/server/launcher.py), and
    the next run of the config, taking the output directory, sets the dead run's flow runs Crashed
    instead of leaving them Running in the UI."""
    from eyas_prefect.tasks.extract import extraction_context, prepare_data
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
    from prefect.settings import PREFECT_API_URL

    from eyas.config import load_config

    def runs(like: str):
        with get_client(sync_client=True) as client:
            return client.read_flow_runs(
                flow_run_filter=FlowRunFilter(name=FlowRunFilterName(like_=like))
            )

    took, code, server = _signal_once_serving(
        tmp_path, signal.SIGKILL, PREFECT_API_URL.value(), "kill9"
    )
    assert code == -signal.SIGKILL
    assert wait_dead(LocalHost(), server, 15), "the killed run's server outlived it"
    dead = runs("-kill9@")
    assert {r.name.split("-")[0] for r in dead} >= {"eagle3", "extract", "serve"}
    assert not all(r.state.is_final() for r in dead)  # what the UI showed: Running forever

    sets = eyas_run.overrides(tmp_path, tmp_path / "conversations.jsonl", name="kill9-again")
    cfg = load_config(
        eyas_run.ROOT / "configs" / "local-tiny.yaml",
        {k: yaml.safe_load(str(v)) if isinstance(v, str) else v for k, v in sets.items()},
    )
    from prefect import flow

    @flow(name="take-over")
    def take_over():
        with extraction_context() as ctx:
            return prepare_data(ctx, cfg)

    take_over()
    closed = {r.name: r.state for r in runs("-kill9@")}
    assert all(s.is_final() for s in closed.values()), closed
    assert all(
        s.type.value == "CRASHED"
        for n, s in closed.items()
        if n not in {r.name for r in dead if r.state.is_final()}
    )
    assert "died without reporting" in next(
        s.message for s in closed.values() if s.type.value == "CRASHED"
    )
