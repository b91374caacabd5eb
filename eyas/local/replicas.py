"""Data-parallel replicas of eyas-local (`--dp-size N`): N - 1 worker processes beside the front.

    # the same server again, on 127.0.0.1 ports of its own
    workers = start_workers(argv, 1, log)     # their lines go to this log from now on
    wait_ready(workers)                        # ... once this process has loaded its own model
    status, body = workers[0].forward("/generate", raw_body, headers)

The front process serves HTTP as before and is replica 0; every other replica is the same command
started again as a worker (`--dp-worker --dp-rank K`: an internal port on 127.0.0.1, no warm-up,
exits when the front goes), to which the front forwards whole /generate requests. A request goes to
the replica with the fewest in flight, as SGLang's data-parallel controller sends each to the
shortest queue.
Replicas are processes, not threads: a process decodes on a core of its own, while two replicas as
threads of one process decoded only 1.18x one (the GIL; measured on the tiny target, 16 sequences in
flight).

Every replica's lines carry its rank as SGLang's do ("[time DP1 TP0] Load weight begin. ..."), and a
worker's lines go to the front's log from its start, so the readiness sensor follows each replica's
load. A worker's loading bar and ready line stay out of the log: the front's bar is the one the
sensor reads, and the front's ready line the one that means the server answers.

A worker that dies takes the front with it (the log says which and how), so the readiness sensor and
the extraction see a crashed server, never a server quietly answering with half its replicas. The
workers share the front's process group, so stopping the server stops them too.
"""

from __future__ import annotations

import http.client
import os
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Callable

from eyas.errors import EyasError
from eyas.net import free_port
from eyas.server.readiness import READY_LINE

PARENT_ENV = "EYAS_DP_PARENT"  # the front's pid, for a worker to notice when it is gone
START_TIMEOUT_S = 600.0


class ReplicaFailed(EyasError, RuntimeError):
    """A worker replica exited before it was ready."""


class Worker:
    """One worker process and the front's keep-alive connections to it (one per handler thread)."""

    def __init__(self, index: int, port: int, proc: subprocess.Popen):
        self.index, self.port, self.proc = index, port, proc
        self._local = threading.local()
        self.ready = threading.Event()  # its ready line came
        self.ended = threading.Event()  # its output ended: it exited
        self.tail: deque[str] = deque(maxlen=20)  # its last lines, for a failure to quote

    def forward(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """The worker's (status, body) for this request, on this thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(
                "127.0.0.1", self.port, timeout=None
            )
        try:
            conn.request(method, path, body=body, headers=headers or {})
            res = conn.getresponse()
            return res.status, res.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self._local.conn = None
            raise


def worker_argv(argv: list[str], port: int, rank: int) -> list[str]:
    """The front's own arguments with the worker's port and rank, one replica, no warm-up and no
    injected fault (the front's loading bar is the one the sensor reads, and its fault the one that
    fires): argparse keeps the last value of a repeated option, so the overrides go at the end."""
    return [
        *argv,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dp-size",
        "1",
        "--skip-server-warmup",
        "--fault",
        "none",
        "--dp-worker",
        "--dp-rank",
        str(rank),
    ]


def start_workers(argv: list[str], count: int, log: Callable[[str], None]) -> list[Worker]:
    """Start `count` workers (they load the model while this process loads its own); their lines
    go to this process's log from now on."""
    env = {**os.environ, PARENT_ENV: str(os.getpid())}
    workers = []
    for i in range(1, count + 1):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "eyas.local.server", *worker_argv(argv, port, i)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,  # universal newlines: each of tqdm's \r updates is a line of its own
            bufsize=1,
        )
        w = Worker(i, port, proc)
        threading.Thread(target=_relay, args=(w, log), name=f"eyas-dp-{i}", daemon=True).start()
        workers.append(w)
    return workers


def wait_ready(workers: list[Worker]) -> None:
    """Wait until each worker says it is ready; one that dies first fails the start with its last
    lines. From then on a worker's exit ends this process."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for w in workers:
        while not w.ready.wait(0.2):
            if w.ended.is_set() or time.monotonic() > deadline:
                code = w.proc.poll()
                raise ReplicaFailed(
                    f"dp replica {w.index} "
                    f"{'exited with code ' + str(code) if code is not None else 'was not ready'} "
                    f"before it was ready; its last lines:\n" + "\n".join(w.tail)
                )


def _relay(w: Worker, log: Callable[[str], None]) -> None:
    """The worker's lines to this log as they come (they carry its rank), but its loading bar,
    its ready line and its access lines (the front logs every request already)."""
    for line in w.proc.stdout:
        if READY_LINE in line:
            w.ready.set()
            continue
        line = line.rstrip()
        w.tail.append(line)
        if line and "% Completed |" not in line and not line.startswith("INFO:     "):
            sys.stderr.write(line + "\n")
            sys.stderr.flush()
    code = w.proc.wait()
    w.ended.set()
    if w.ready.is_set():  # a replica gone from a serving server: the server goes with it
        log(f"dp replica {w.index} (pid {w.proc.pid}) exited with code {code}: stopping the server")
        os._exit(1)


def exit_with_parent() -> None:
    """In a worker: exit as soon as the front that started it is gone (its pid in PARENT_ENV)."""
    parent = int(os.environ[PARENT_ENV])

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, name="eyas-dp-parent", daemon=True).start()
