"""A failed run's reason against a real Prefect server, a process worker and the deployments of
deployments/prefect.yaml: its state message is `failed at TASK: reason`, its logs hold no traceback
for an error eyas raised itself; one webhook POST per failed deployment run, naming the run's page,
the deployment, the task and the reason; an operator's cancel ends the run Cancelled and says so;
`eyas run` ends a failed run with one line, `eyas: run Failed: failed at TASK: reason`.
"""

import json
import re
import socket
import subprocess
import sys
import time

import pytest

from tests import eyas_run
from tests.prefect_server import ROOT, deployment_run, runs_named, wait_flow_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(deployed):
    return deployed


def logs_of(
    server, run_ids: list[str], last: str = "Finished", timeout_s: float = 30.0
) -> list[str]:
    """The runs' log lines, once one starting with `last` is there (the flow-run process sends its
    last batch after the state is final)."""

    def newest() -> list[
        str
    ]:  # the newest 200 lines (the API's page), oldest first: a run's end is asserted on
        return [
            x["message"]
            for x in server.post(
                "/logs/filter",
                {
                    "logs": {"flow_run_id": {"any_": run_ids}},
                    "limit": 200,
                    "sort": "TIMESTAMP_DESC",
                },
            )
        ][::-1]

    deadline = time.monotonic() + timeout_s
    while True:
        logs = newest()
        if any(line.startswith(last) for line in logs) or time.monotonic() > deadline:
            time.sleep(2)  # the enclosing runs' last lines come in their own batches
            return newest()
        time.sleep(1)


def family(server, run: dict, name: str) -> list[str]:
    """The run and its subflow runs (named `*-NAME@localhost`)."""
    return sorted({run["id"], *(r["id"] for r in runs_named(server, f"%-{name}@localhost"))})


def posts_about(webhooks, name: str, settle_s: float = 8.0, timeout_s: float = 60.0) -> list[dict]:
    """Webhook POSTs naming `name`, once the first came and a subflow's would have followed."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not [p for p in webhooks.posts if name in p["body"]]:
        time.sleep(0.5)
    time.sleep(settle_s)
    return [p for p in webhooks.posts if name in p["body"]]


def test_a_bad_config_fails_with_one_line_no_traceback_and_an_artifact(server):
    out = server.cli(
        "deployment",
        "run",
        "eagle3-pipeline/pipeline",
        "--params",
        json.dumps({"overrides": {"name": "bad-cfg", "training.max_stepz": 20}}),
    )
    run = wait_flow_run(server, re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1), timeout=180)
    state = run["state"]
    assert state["type"] == "FAILED", state
    message = state["message"]
    assert message.startswith("failed at config: ") and "\n" not in message, message
    assert "training.max_stepz: Extra inputs are not permitted" in message, message
    logs = logs_of(server, [run["id"]])
    assert not [line for line in logs if "Traceback" in line], logs
    # the reason, once: Prefect's last line of the run
    assert [line for line in logs if "training.max_stepz" in line] == [
        f"Finished in state Failed({message!r})"
    ], logs
    art = server.post("/artifacts/filter", {"artifacts": {"key": {"any_": ["failure-bad-cfg"]}}})
    assert art and message in art[0]["data"], art


def test_a_launch_failure_posts_once_with_the_run_link_deployment_task_and_reason(
    server, small, webhooks
):
    """A launch refused deep in `serve` (its port taken) fails serve, extract and the pipeline: one
    POST, for the pipeline's deployment run."""
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen(1)
    port = blocker.getsockname()[1]
    try:
        overrides = small("fail-launch", **{"server.port": port})
        run = wait_flow_run(server, deployment_run(server, "eagle3-pipeline/pipeline", overrides))
    finally:
        blocker.close()
    state = run["state"]
    assert state["type"] == "FAILED", state
    assert (
        state["message"]
        == f"failed at launch-local@localhost: [localhost] port {port} is already in use; "
        "pick another server.port"
    ), state["message"]
    logs = logs_of(server, family(server, run, "fail-launch"))
    assert not any("Traceback" in line for line in logs), logs
    # the launch task's end (its retry condition declined a retry, so Prefect logs no error line
    # before it), then serve's, extract's and the pipeline's, each with the reason
    task_end = (
        "Finished in state Failed('Task run encountered an exception LaunchError: [localhost] "
        f"port {port} is already in use; pick another server.port')"
    )
    assert [line for line in logs if f"port {port} is already in use" in line] == [task_end] + [
        f"Finished in state Failed({state['message']!r})"
    ] * 3, logs
    posts = posts_about(webhooks, "fail-launch")
    assert len(posts) == 1, posts
    body = posts[0]["body"]
    assert body.startswith(f"eagle3-fail-launch@localhost ended Failed: {state['message']}\n"), body
    assert f"run: http://127.0.0.1:{server.port}/runs/flow-run/{run['id']}" in body, body
    assert "deployment: eagle3-pipeline/pipeline" in body, body


def test_a_server_refusing_its_launch_args_fails_with_argparses_error_first(server, small):
    """A bad `server.launch_args` entry: the server prints its usage and its error and exits. The
    state message is at most 300 characters and leads with argparse's error line; the usage text
    is in the run's log and the failure artifact, not in the message."""
    run = wait_flow_run(
        server,
        deployment_run(
            server,
            "eagle3-pipeline/pipeline",
            small("bad-flag", **{"server.launch_args": ["--bogus-flag"]}),
        ),
    )
    message = run["state"]["message"]
    assert run["state"]["type"] == "FAILED", run["state"]
    assert message.startswith(
        "failed at wait-ready@localhost: eyas serve-local: error: unrecognized arguments: "
        "--bogus-flag ("
    ), message
    assert len(message) <= 300 and "usage:" not in message, message
    logs = "\n".join(logs_of(server, family(server, run, "bad-flag")))
    assert "[--port PORT]" in logs, logs  # the log tail, in the run's log
    art = server.post("/artifacts/filter", {"artifacts": {"key": {"any_": ["failure-bad-flag"]}}})
    assert art and "[--port PORT]" in art[0]["data"], art


def test_an_operator_cancel_reads_as_a_cancel(server, small):
    """Cancelled while the server loads (it hangs at its first weight shard): the run ends
    Cancelled, and each flow run's log says the operator cancelled it."""
    overrides = small(
        "cancel", **{"server.launch_args": ["--fault", "hang-at-shard", "--fault-shard", "1"]}
    )
    run_id = deployment_run(server, "eagle3-pipeline/pipeline", overrides)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        tasks = server.post(
            "/task_runs/filter",
            {
                "task_runs": {"name": {"any_": ["wait-ready@localhost"]}},
                "flow_runs": {"name": {"like_": "%-cancel@localhost"}},
            },
        )
        if (
            tasks and (tasks[0].get("state") or {}).get("type") == "RUNNING"
        ):  # a new run may have no state yet
            break
        time.sleep(0.5)
    else:
        raise AssertionError("the run never reached wait-ready")
    server.cli("flow-run", "cancel", run_id)
    run = wait_flow_run(server, run_id, timeout=120)
    assert run["state"]["type"] == "CANCELLED", run["state"]
    logs = logs_of(server, family(server, run, "cancel"), last="Flow run was cancelled.")
    said = [line for line in logs if line.startswith("cancelled by the operator: stopping")]
    assert len(said) == 3, logs  # serve, extract, the pipeline
    assert not [line for line in logs if line.startswith("Finished in state Failed")], logs


def test_a_second_run_of_a_busy_config_prints_the_refusal_once(tmp_path):
    """`eyas run` while another process holds the output directory: OutputBusy, no traceback, and
    the process's last line is the run's state and reason."""
    data = eyas_run.small_data(tmp_path)
    sets = eyas_run.overrides(tmp_path, data, name="busy")
    (tmp_path / "shards").mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom eyas.extraction.locks import "
            "lock_output_dir\nlock_output_dir(sys.argv[1], 'flow run first')\nprint('held', "
            "flush=True)\ntime.sleep(600)",
            str(tmp_path / "shards"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        r = subprocess.run(
            eyas_run.command("run", sets),
            cwd=ROOT,
            env=eyas_run.env(tmp_path, None),
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.kill()
        holder.wait(10)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "Traceback" not in out, out
    assert out.count("Task run failed with exception: OutputBusy(") == 1, out
    ends = [line for line in out.splitlines() if line.startswith("eyas: run ")]
    assert len(ends) == 1 and out.rstrip().endswith(ends[0]), out[-2000:]
    assert ends[0].startswith(
        f"eyas: run Failed: failed at prepare-data: extraction.output_dir {tmp_path / 'shards'} is "
        "in use by another eyas run (pid "
    ), ends
