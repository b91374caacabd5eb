"""A real Prefect server on 127.0.0.1 with a process work pool and a worker, for deployment tests.

Everything runs with its own PREFECT_HOME, so it never touches an operator's server or database.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from eyas.net import free_port

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
POOL = "eyas"
DOCS = ("README.md", "docs/operations.md")
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}  #: a flow run's final state types


@dataclass
class PrefectServer:
    home: Path
    port: int
    env: dict
    procs: list = field(default_factory=list)

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def cli(self, *args: str, timeout: float = 120) -> str:
        r = subprocess.run(
            [str(BIN / "prefect"), *args],
            cwd=ROOT,
            env=self.env,
            text=True,
            capture_output=True,
            timeout=timeout,
        )
        if r.returncode != 0:
            raise AssertionError(
                f"prefect {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
            )
        return r.stdout

    def spawn(self, args: list[str], log: str, **popen) -> subprocess.Popen:
        """`prefect ARGS` (or, args[0] a path, that program) in a session of its own, output to
        home/log; stopped by stop()."""
        program = args if "/" in args[0] else [str(BIN / "prefect"), *args]
        p = subprocess.Popen(
            program,
            cwd=ROOT,
            env=self.env,
            stdout=open(self.home / log, "w"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            **popen,
        )
        self.procs.append(p)
        return p

    def start_worker(self, log: str, *options: str, **popen) -> subprocess.Popen:
        """The docs' worker command (`.venv/bin/eyas worker --pool eyas`) with `options` added."""
        return self.spawn(
            [*shlex.split(worker_line().replace(".venv/bin/", f"{BIN}/")), *options], log, **popen
        )

    def get(self, path: str):
        with urllib.request.urlopen(self.api + path, timeout=10) as r:
            return json.loads(r.read())

    def post(self, path: str, body: dict):
        req = urllib.request.Request(
            self.api + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                for sig in (
                    signal.SIGTERM,
                    signal.SIGINT,
                    signal.SIGKILL,
                ):  # a worker wants TERM then INT
                    try:
                        os.killpg(p.pid, sig)
                        p.wait(10)
                        break
                    except subprocess.TimeoutExpired:
                        continue
                    except ProcessLookupError:
                        break


def start_prefect_server(home: Path, timeout: float = 90) -> PrefectServer:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PWD=str(ROOT),
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_WORKER_PREFETCH_SECONDS="1",
        PATH=f"{BIN}:{os.environ.get('PATH', '')}",
    )
    server = PrefectServer(home, port, env)
    server.spawn(["server", "start", "--host", "127.0.0.1", "--port", str(port)], "server.log")
    deadline = time.monotonic() + timeout
    while True:
        try:
            if server.get("/health") is True:
                return server
        except OSError:
            pass
        if time.monotonic() > deadline or server.procs[0].poll() is not None:
            server.stop()
            raise AssertionError(
                "prefect server did not start:\n" + (home / "server.log").read_text()[-3000:]
            )
        time.sleep(0.5)


class WebhookReceiver:
    """A loopback HTTP server that records the JSON bodies POSTed to it (a failure webhook's
    target): `.url`, `.posts`, `.stop()`."""

    def __init__(self):
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, HTTPServer

        posts = self.posts = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                posts.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self._httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}/eyas"
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._httpd.shutdown()


def doc_commands() -> list[str]:
    """Every command line of the bash blocks of README.md and docs/operations.md, in order."""
    out = []
    for doc in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", (ROOT / doc).read_text(), re.S):
            for line in block.splitlines():
                line = re.sub(r"\s+#\s.*$", "", line).strip()  # a trailing comment
                if line and not line.startswith("#"):
                    out.append(line)
    return out


def sh(server: PrefectServer, line: str, timeout: float = 120) -> str:
    """A documented command as written, in the repository root, .venv/bin meaning this
    interpreter's."""
    line = line.replace(".venv/bin/", f"{BIN}/")
    r = subprocess.run(
        ["bash", "-c", line],
        cwd=ROOT,
        env=server.env,
        text=True,
        capture_output=True,
        timeout=timeout,
    )
    assert r.returncode == 0, f"{line}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def worker_line() -> str:
    """The docs' command that starts a worker."""
    return next(c for c in doc_commands() if re.match(r"\.venv/bin/eyas worker ", c))


def deploy_as_documented(
    server: PrefectServer, webhook_url: str | None = None, worker: bool = True
) -> None:
    """docs/operations.md's Deploy block as written (the pool, every deployment, a worker unless
    `worker` is false), then the failure notification posting to `webhook_url` (if given)."""
    deploy = [
        c
        for c in doc_commands()
        if c.startswith(".venv/bin/prefect ")
        and "server start" not in c
        and " deployment run " not in c
    ]
    for line in deploy:
        sh(server, line)
    if worker:
        server.start_worker("worker.log", "--limit", "2")
    if webhook_url:
        notify = next(c for c in doc_commands() if "notifications.py" in c)
        sh(server, notify.replace("https://hooks.example.com/eyas", webhook_url))


def deployment_run(server, name: str, overrides: dict) -> str:
    out = server.cli("deployment", "run", name, "--params", json.dumps({"overrides": overrides}))
    return re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1)


def wait_flow_run(server, run_id: str, timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        run = server.get(f"/flow_runs/{run_id}")
        if run["state"]["type"] in TERMINAL:
            return run
        time.sleep(1)
    raise AssertionError(
        f"flow run {run_id} not finished in {timeout}s: {run['state']}\n"
        + (server.home / "worker.log").read_text()[-4000:]
    )


def runs_named(server, pattern: str) -> list[dict]:
    return server.post("/flow_runs/filter", {"flow_runs": {"name": {"like_": pattern}}})


#: the task runs every pipeline run of the embedded default has, besides one extract-shard per shard
PIPELINE_TASKS = (
    "prepare-data",
    "patch@localhost",
    "launch-local@localhost",
    "wait-ready@localhost",
    "stop@localhost",
    "train-drafter",
    "export-drafter",
    "serve-bench@localhost",
)


def task_runs(server, flow_run_ids: list[str], until=None, timeout: float = 60) -> dict[str, dict]:
    """{name: state} of the flow runs' task runs once `until(states)` holds (default: there are
    some and every state is final), or as they stand after `timeout` seconds.

    A flow run's own state is written by its API call, its task runs' by the server's recorder of
    the events the run sent, which lags behind on a loaded machine: a run that has just ended may
    still lack a task run, or show one Pending under its generated name ("extract-shard-a7f")."""
    until = until or (
        lambda states: bool(states) and all(s["type"] in TERMINAL for s in states.values())
    )
    deadline = time.monotonic() + timeout
    while True:
        runs = server.post(
            "/task_runs/filter", {"flow_runs": {"id": {"any_": flow_run_ids}}, "limit": 200}
        )
        states = {r["name"]: r["state"] or {"type": None, "name": None} for r in runs}
        if until(states) or time.monotonic() > deadline:
            return states
        time.sleep(0.5)


#: one SIGTERM to exit, on a loaded CI machine (it takes well under a second on an idle one)
STOP_S = 10.0


def sigterm_worker(worker: subprocess.Popen, log, within: float = STOP_S) -> str:
    """SIGTERM the documented worker once its handlers are set; its log once it has exited, within
    `within` seconds and with 0."""
    deadline = time.monotonic() + 90
    while "started!" not in log.read_text() and time.monotonic() < deadline:
        assert worker.poll() is None, log.read_text()
        time.sleep(0.5)
    t0 = time.monotonic()
    os.kill(worker.pid, signal.SIGTERM)
    try:
        code = worker.wait(within)
    except subprocess.TimeoutExpired:
        raise AssertionError(  # noqa: B904 - the log says why, not the timeout
            f"worker alive {within} s after SIGTERM:\n{log.read_text()[-3000:]}"
        )
    took = time.monotonic() - t0
    assert code == 0 and took < within, (code, took, log.read_text()[-3000:])
    return log.read_text()
