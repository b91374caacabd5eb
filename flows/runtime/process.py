"""`eyas run` as one OS process: a temporary Prefect server that outlives a signal, and SIGTERM /
SIGINT that end the run within seconds, its servers stopped and its flow runs in a final state.

    report = run_in_process(eagle3_pipeline, cfg)

Without PREFECT_API_URL, Prefect would start its temporary server as a child in the run's process
group: the SIGTERM that `timeout`, CI or `kill -- -PGID` send to the group ends that server first,
and the run then goes on without an API, logging connection errors, unable to record that it
stopped. eyas starts its own instead: in a session of its own, deaf to SIGTERM and SIGINT (so a
cgroup-wide stop, as systemd sends, leaves it too), and ended when eyas closes its stdin, which
the kernel does when eyas exits, however it exits (kill -9 included).

On SIGTERM or SIGINT, Prefect's engine marks the runs Crashed ("Execution was aborted by a
termination signal") and runs their hooks on the way out (SIGTERM reaches Prefect's own handler
first, SIGINT eyas's, which raises the same TerminationSignal); the extract flow's `finally` and the
flows' hooks stop the server the run launched. When the signal comes back to eyas's handler (Prefect
re-sends it to the handler it replaced), the process stops whatever server it launched and is still
up, hands the logs over and exits at once with 128 + the signal number, without waiting for worker
threads. From that moment a watchdog bounds the rest to GRACE_S.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from typing import Any, Callable

import httpx

from eyas.errors import EyasError

GRACE_S = 15.0

# The temporary server: Prefect's own app under uvicorn, without uvicorn's signal handlers.
_SERVER = r"""
import contextlib, signal, sys, threading
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
import uvicorn

class Server(uvicorn.Server):
    def capture_signals(self):
        return contextlib.nullcontext()

    def install_signal_handlers(self):
        pass

app = "prefect.server.api.server:create_app"
server = Server(uvicorn.Config(app, factory=True, host="127.0.0.1", port=int(sys.argv[1]),
                               log_level="error", lifespan="on"))

def watch():
    sys.stdin.buffer.read()  # end of file: eyas has exited or is done with us
    server.should_exit = True

threading.Thread(target=watch, daemon=True).start()
server.run()
"""


class TemporaryServerFailed(EyasError, RuntimeError):
    """eyas run's temporary Prefect server did not answer: a port or start-up race may pass."""

    retryable = True


class TemporaryServer:
    """A Prefect API on 127.0.0.1 for the life of this process (PREFECT_HOME's database)."""

    def __init__(self, timeout_s: float = 90.0):
        from prefect.settings import get_current_settings

        from eyas.net import free_port

        settings = get_current_settings()
        env = {
            **os.environ,
            "PREFECT_UI_ENABLED": "0",
            "PREFECT__SERVER_EPHEMERAL": "1",
            "PREFECT__SERVER_FINAL": "1",
            **settings.to_environment_variables(exclude_unset=True),
            # no telemetry from a server that lives for one run: its session row raced the run's
            # writes ("database is locked") and its heartbeat failed offline, both as tracebacks
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
        }
        env.pop("PREFECT_API_URL", None)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        print(
            f"eyas: starting a temporary Prefect server on {self.url} (set PREFECT_API_URL to "
            f"use yours)",
            file=sys.stderr,
            flush=True,
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(self.port)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + max(
            timeout_s, settings.server.ephemeral.startup_timeout_seconds
        )
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise TemporaryServerFailed(
                    f"the temporary Prefect server on port {self.port} did not start "
                    f"(exit code {self.proc.returncode})"
                )
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.stdin and not self.proc.stdin.closed:
            self.proc.stdin.close()  # the server's cue to shut down cleanly
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class Termination:
    """SIGTERM and SIGINT for a run in this process: the first one starts the stop, later ones
    wait."""

    def __init__(self, grace_s: float = GRACE_S):
        self.grace_s, self.signum, self.server = grace_s, None, None
        self._done = threading.Lock()

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        from prefect.exceptions import TerminationSignal

        if self.signum is not None:
            return  # already stopping; the watchdog bounds it
        self.signum = signum
        print(
            f"eyas: {signal.Signals(signum).name}: ending the run (its servers stopped, its flow "
            f"runs final); exiting within {self.grace_s:.0f} s",
            file=sys.stderr,
            flush=True,
        )
        threading.Thread(target=self._watchdog, daemon=True, name="eyas-termination").start()
        raise TerminationSignal(signal=signum)

    def _watchdog(self) -> None:
        time.sleep(self.grace_s)
        print(
            f"eyas: still not stopped after {self.grace_s:.0f} s: exiting now",
            file=sys.stderr,
            flush=True,
        )
        self.exit()

    def exit(self) -> None:
        """Stop what this process launched and is still up, hand the logs over, exit 128 +
        signal."""
        if not self._done.acquire(blocking=False):
            return
        from eyas.server.launch import stop_launched

        for outcome in stop_launched(timeout_s=5):
            print(f"eyas: server left by the run: {outcome}", file=sys.stderr, flush=True)
        flush = threading.Thread(target=_flush_logs, daemon=True)
        flush.start()
        flush.join(5)
        if self.server is not None:
            self.server.stop(5)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(128 + (self.signum or signal.SIGTERM))


def _global_settings_from_env() -> None:
    """Prefect's process-wide settings, read again from the environment. A thread the run starts
    (the regeneration's workers, a progress publisher) sees those, not the flow's settings context:
    with the API URL they were read with at import (none), its first log line makes Prefect start an
    ephemeral server of its own ("Starting temporary server"), which then runs beside the run to its
    end and slows it (a regeneration part of the embedded default 27 s instead of 18)."""
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()


def _hand_over(timeout_s: float = 15.0) -> None:
    """Send what Prefect still holds for the API (log batches, events) while the temporary server is
    up. Left to the interpreter's exit, it finds the server gone: "Error logging to API", retries,
    and Prefect starting an ephemeral server of its own to deliver them (15 to 70 s between the
    pipeline's end and the process's on the embedded default:
    bench/results/2026-12-04_cpu2_readme-pipeline.md). Prefect 3.9.1 drains each queue through its
    worker class (APILogWorker, EventsWorker: `drain_all`); their private base drains every queue
    at once, and the public log flush is the fallback should that base change."""
    from eyas_prefect.flows.runtime.prefect_private import drain_queues

    try:
        drained = drain_queues(timeout_s)
    except Exception:  # noqa: BLE001 - nothing more to do on the way out
        drained = False
    if not drained:
        _flush_logs()


def _flush_logs() -> None:
    try:
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()  # an instance method: it drains the class-wide log worker
    except Exception:  # noqa: BLE001 - nothing more to do on the way out
        pass


def run_in_process(fn: Callable[..., Any], *args, **kwargs) -> Any:
    """Call a flow in this process, as `eyas run` does (see the module docstring)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    term = Termination()
    term.install()
    try:
        settings = nullcontext()
        if not PREFECT_API_URL.value():
            term.server = TemporaryServer()
            os.environ["PREFECT_API_URL"] = term.server.url  # for any process this run starts
            _global_settings_from_env()  # ... and any thread
            settings = temporary_settings(updates={PREFECT_API_URL: term.server.url})
        with settings:
            return fn(*args, **kwargs)
    except BaseException:
        if term.signum is not None:
            term.exit()
        raise
    finally:
        if term.server is not None and term.signum is None:
            _hand_over()  # the run's last logs and events reach the server before it goes
            term.server.stop()
