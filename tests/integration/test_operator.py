"""What an operator does, against a real Prefect server: the documented commands (README.md and
docs/operations.md, run as written), bad configs that fail with the reason, the failure webhook,
the run tags, and a worker that stops on SIGTERM.
"""

import json
import os
import re
import shlex
import signal
import subprocess
import time
import urllib.request

import pytest

from eyas.net import free_port
from eyas.server.hosts import LocalHost
from tests.prefect_server import BIN, ROOT, doc_commands, sh, wait_flow_run

pytestmark = pytest.mark.slow

#: Every command line of the docs' bash blocks, and what runs it. "here": this module, against its
#: server. The others need what a test machine lacks, or are run elsewhere as named.
COMMANDS = {
    "python3 -m venv .venv && .venv/bin/pip install -q --no-compile torch==2.13.0 -e . && "
    ".venv/bin/eyas run "
    "configs/local-tiny.yaml": "the install: .ci/run; `eyas run` of this config: "
    "tests/integration/test_eyas_run_output.py (reduced)",
    "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && .venv/bin/pip install -q "
    "-e '.[test]' && .venv/bin/python -m pytest -q": ".ci/run, exactly (tests/unit/test_readme.py)",
    ".venv/bin/prefect server start --host 127.0.0.1 --port 4200 "
    "&": "here (tests/prefect_server.py, on a free port)",
    "export PREFECT_API_URL=http://127.0.0.1:4200/api": "here (the server's env)",
    "export PREFECT_SERVER_ANALYTICS_ENABLED=false": "here (the server's env: "
    "tests/prefect_server.py)",
    ".venv/bin/eyas run "
    "configs/local-tiny.yaml": "tests/integration/test_eyas_run_output.py (reduced)",
    "eyas check-config configs/kimi-k2.5-sglang.yaml": "here",
    "eyas preflight configs/kimi-k2.5-sglang.yaml": "needs the production SSH hosts",
    "eyas run configs/kimi-k2.5-sglang.yaml": "needs the production GPU hosts",
    "eyas run configs/local-tiny.yaml --set "
    "training.max_steps=50": "tests/integration/test_eyas_run_output.py (reduced)",
    "eyas stop configs/kimi-k2.5-sglang.yaml": "needs the production SSH hosts",
    ".venv/bin/python -m flows.serve_bench configs/kimi-k2.5-sglang.yaml "
    "/data/eyas/runs/kimi-k2.5/drafter": "needs the production GPU hosts",
    "cd /srv/eyas": "here (the repository root)",
    "export PREFECT_API_URL=http://prefect-host:4200/api": "here (the server's env)",
    ".venv/bin/prefect server start --host 0.0.0.0 --port 4200 "
    "&": "here (tests/prefect_server.py, 127.0.0.1)",
    ".venv/bin/prefect work-pool create eyas --type process": "here",
    "until .venv/bin/prefect work-pool ls >/dev/null 2>&1; do sleep 2; done": "here: the Deploy "
    "block as pasted (test_the_deploy_block_runs_as_pasted_in_order), and README's Prefect block",
    ".venv/bin/prefect --no-prompt deploy --all --prefect-file deployments/prefect.yaml": "here",
    ".venv/bin/eyas worker --pool eyas": "here, stopped by SIGTERM (idle; a run in flight)",
    ".venv/bin/prefect deployment run 'eagle3-pipeline/pipeline'": "here (pool paused)",
    ".venv/bin/prefect deployment run 'eagle3-pipeline/pipeline' --param "
    "config=configs/kimi-k2.5-sglang.yaml": "here (pool paused)",
    """.venv/bin/prefect deployment run 'eagle3-pipeline/pipeline' --params '{"overrides": {"training.max_steps": 50}}'""": "here (pool paused)",  # noqa: E501 - the docs' command, verbatim
    """.venv/bin/prefect deployment run 'eyas-train/train' --params "$(.venv/bin/python -c 'import json, yaml; print(json.dumps({"config": yaml.safe_load(open("configs/local-tiny.yaml"))}))')\"""": "here (pool paused)",  # noqa: E501 - the docs' command, verbatim
    """.venv/bin/python deployments/automations.py kimi-k2.5 --params '{"config": "configs/kimi-k2.5-sglang.yaml"}'""": "here",  # noqa: E501 - the docs' command, verbatim
    ".venv/bin/prefect deployment run 'eyas-extract/extract' --param "
    "config=configs/kimi-k2.5-sglang.yaml": "here (pool paused)",
    ".venv/bin/python deployments/notifications.py "
    "https://hooks.example.com/eyas": "here (URL: a receiver on 127.0.0.1)",
}


def bash_block(doc: str, heading: str) -> str:
    """The first bash block after `heading` in a doc."""
    text = (ROOT / doc).read_text()
    return re.search(r"```bash\n(.*?)```", text[text.index(heading) :], re.S).group(1)


def test_the_deploy_block_runs_as_pasted_in_order(tmp_path):
    """docs/operations.md's Deploy block as one script, in order, on a fresh Prefect home: the
    operator's host, port and checkout substituted, the worker run for 20 s. The work pool is
    created right after the server starts, so the block must wait for it."""
    port = free_port()
    script = (
        bash_block("docs/operations.md", "### Deploy")
        .replace("http://prefect-host:4200", f"http://127.0.0.1:{port}")
        .replace("--host 0.0.0.0 --port 4200", f"--host 127.0.0.1 --port {port}")
        .replace("cd /srv/eyas", f"cd {shlex.quote(str(ROOT))}")
        .replace(".venv/bin/eyas worker", "timeout 20 .venv/bin/eyas worker")
        .replace(".venv/bin/", f"{BIN}/")
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path), PWD=str(ROOT))
    bash = subprocess.Popen(
        ["bash", "-c", f"set -e\n{script}\n"],
        cwd=tmp_path,
        env=env,
        stdout=open(tmp_path / "block.log", "w"),  # the backgrounded server keeps it open
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the backgrounded server: stopped with the group below
    )
    try:
        bash.wait(timeout=300)
        out = (tmp_path / "block.log").read_text()
        # the worker's 20 s end as `timeout` ends it (124); every line before it must succeed
        assert bash.returncode == 124, out[-4000:]
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/deployments/filter",
            data=b"{}",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            names = {d["name"] for d in json.loads(r.read())}
        assert {"pipeline", "nightly", "train", "extract"} <= names, names
    finally:
        try:
            os.killpg(bash.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_docs_commands_are_exactly_the_listed_ones():
    assert sorted(set(doc_commands())) == sorted(COMMANDS)


@pytest.fixture(scope="module")
def server(deployed):
    return deployed


def run_deployment(server, name: str, params: dict) -> str:
    out = server.cli("deployment", "run", name, "--params", json.dumps(params))
    return re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1)


BAD = [  # parameters, the run's name, what the one-line message names
    (
        {"overrides": {"training.max_stepz": 20}},
        "eagle3-local-tiny",
        "training.max_stepz: Extra inputs",
    ),
    (
        {"overrides": {"training.max_steps": "many"}},
        "eagle3-local-tiny",
        "training.max_steps: Input should be a valid integer",
    ),
    ({"config": "configs/no-such.yaml"}, "eagle3-no-such", "no-such.yaml: config file not found"),
]


def test_a_bad_config_fails_with_the_reason_under_a_readable_name_and_notifies(server, webhooks):
    ids = [run_deployment(server, "eagle3-pipeline/pipeline", params) for params, _, _ in BAD]
    for run_id, (params, name, reason) in zip(ids, BAD):
        run = wait_flow_run(server, run_id, timeout=180)
        state = run["state"]
        assert state["type"] == "FAILED", (params, state)
        assert reason in state["message"] and "\n" not in state["message"], state["message"]
        assert run["name"] == name, run["name"]

    # The failure webhook: one POST per failed run, naming it and the reason (the receiver is the
    # session's: other modules' runs post to it too).
    def posted(name: str, reason: str) -> bool:
        return any(
            p["body"].startswith(f"{name} ended Failed: ") and reason in p["body"]
            for p in webhooks.posts
        )

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(posted(name, reason) for _, name, reason in BAD):
        time.sleep(1)
    for _, name, reason in BAD:
        assert posted(name, reason), [p["body"] for p in webhooks.posts]


def test_overrides_are_typed_in_the_run_form(server):
    dep = server.get("/deployments/name/eagle3-pipeline/pipeline")
    schema = dep["parameter_openapi_schema"]["properties"]["overrides"]
    mapping = next(s for s in schema["anyOf"] if s.get("type") == "object")
    assert {t.get("type") for t in mapping["additionalProperties"]["anyOf"]} == {
        "string",
        "integer",
        "number",
        "boolean",
        "array",
        "object",
        "null",
    }


def test_flow_and_task_runs_carry_config_host_and_revision_tags(server, tmp_path):
    params = {
        "overrides": {
            "name": "op-tags",
            "server.port": free_port(),
            "server.workdir": str(tmp_path / "server"),
            "server.dump_dir": str(tmp_path / "server" / "dump"),
        }
    }
    run = wait_flow_run(
        server, run_deployment(server, "eyas-teardown/teardown", params), timeout=180
    )
    assert run["state"]["type"] == "COMPLETED", run["state"]
    assert run["name"] == "teardown-op-tags@localhost"
    want = {"config:op-tags", "host:localhost"}
    assert want <= set(run["tags"]) and any(t.startswith("revision:") for t in run["tags"]), run[
        "tags"
    ]
    tasks = server.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [run["id"]]}}})
    assert tasks and all(want <= set(t["tags"]) for t in tasks), [
        (t["name"], t["tags"]) for t in tasks
    ]


def test_the_documented_runs_are_accepted_as_written(server):
    """Every `prefect deployment run` line of the docs, and the automation script, as written; the
    pool is paused so they run nothing (the production config has no hosts here)."""
    sh(server, "prefect work-pool pause eyas")
    try:
        before = {r["id"] for r in server.post("/flow_runs/filter", {})}
        lines = [
            c
            for c in doc_commands()
            if c.startswith(".venv/bin/prefect deployment run")
            or "automations.py" in c
            or c.startswith("eyas check-config")
        ]
        for line in lines:
            sh(server, line.replace("eyas check-config", "python -m eyas check-config"))
        new = [r for r in server.post("/flow_runs/filter", {}) if r["id"] not in before]
        assert len(new) == sum(c.startswith(".venv/bin/prefect deployment run") for c in lines)
        inline = next(r for r in new if isinstance(r["parameters"].get("config"), dict))
        assert inline["parameters"]["config"]["name"] == "local-tiny"
        for r in new:
            server.post(
                f"/flow_runs/{r['id']}/set_state", {"state": {"type": "CANCELLED"}, "force": True}
            )
    finally:
        sh(server, "prefect work-pool resume eyas")


#: one SIGTERM to exit, on a loaded CI machine (it takes well under a second on an idle one)
STOP_S = 10.0


def _sigterm(worker: subprocess.Popen, log, within: float = STOP_S) -> str:
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


def test_the_worker_stops_on_sigterm_within_seconds(server):
    """One SIGTERM stops the documented worker (`eyas worker`), idle, within seconds, saying so. A
    second worker of the documented command, so the session's own worker serves on."""
    log = server.home / "worker-sigterm.log"
    out = _sigterm(server.start_worker(log.name, "--name", "sigterm-test"), log)
    assert "eyas worker: SIGTERM: stopped the Prefect worker" in out, out[-3000:]
    assert "no flow run of it was running" in out, out[-3000:]


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
        out = _sigterm(worker, log)
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
