"""`eyas worker`: Prefect's worker for the eyas pool, stopped by one SIGTERM or SIGINT at once, the
flow runs it started going on in their own processes.

    eyas worker --pool eyas [any other `prefect worker start` option]

It runs `prefect worker start` with those options as its child, in a session of its own, and waits.
On SIGTERM or SIGINT it kills that worker (SIGKILL, the worker process only), prints one line
naming the flow runs that go on, and exits 0; if the worker ends by itself, it exits with the
worker's code. A worker whose `eyas worker` is killed outright goes with it (Linux's parent-death
signal).

Why not `prefect worker start` itself: Prefect 3.9.1's handler turns SIGTERM into a SIGINT to the
worker, and its SIGINT handler into another SIGINT, then a SIGKILL. Started with SIGINT ignored (a
background job of a script or a non-interactive shell) the worker never stops on the first SIGTERM;
otherwise the second SIGINT either kills it or meets asyncio's handler, whose graceful stop sends
SIGTERM to every flow-run process and waits for each to exit. A second SIGTERM is Prefect's
SIGKILL, which leaves the runs going on. Killing the worker process is that same second step,
taken at once: the runs are not interrupted. They write nothing to the worker's output (the
deployments' `stream_output: false`), so its exit cannot break a pipe under them; their logs go
to the Prefect API (the UI, `prefect flow-run logs`). In its own session the worker and its runs
are out of a terminal's Ctrl-C and a `kill -- -PGID` of this process's group.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _parent_death_signal():
    """A function for the worker to call before exec: SIGKILL it when `eyas worker` dies (Linux's
    prctl; None elsewhere). libc is loaded here, before the fork."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def flow_runs_of(pid: int) -> list[tuple[int, str]]:
    """(pid, flow run id) of the flow-run processes `pid` started (its children whose environment
    names a flow run), read from /proc; [] where there is no /proc."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            stat = (proc / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for var in env:
            if var.startswith(b"PREFECT__FLOW_RUN_ID="):
                found.append((int(proc.name), var.split(b"=", 1)[1].decode()))
    return sorted(found)


def stop_line(signum: int, worker_pid: int, runs: list[tuple[int, str]]) -> str:
    """What `eyas worker` says when a signal stops it."""
    went_on = (
        "; the flow runs it started go on in their own processes: "
        + ", ".join(f"{run} (pid {pid})" for pid, run in runs)
        if runs
        else "; no flow run of it was running"
    )
    name = signal.Signals(signum).name
    return f"eyas worker: {name}: stopped the Prefect worker (pid {worker_pid}){went_on}"


def main(argv: list[str]) -> int:
    worker = subprocess.Popen(
        [sys.executable, "-m", "prefect", "worker", "start", *argv],
        start_new_session=True,
        preexec_fn=_parent_death_signal(),
    )
    stopped: list[int] = []

    def stop(signum, frame) -> None:
        if stopped:
            return
        stopped.append(signum)
        runs = flow_runs_of(worker.pid)
        try:
            os.kill(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        print(stop_line(signum, worker.pid, runs), file=sys.stderr, flush=True)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    code = worker.wait()
    return 0 if stopped else code
