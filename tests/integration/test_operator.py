"""What an operator does, against a real Prefect server: the documented commands (README.md and
docs/operations.md, run as written), bad configs that fail with the reason, the failure webhook,
the run tags, and a worker that stops on SIGTERM.
"""

import json
import re
import time

import pytest

from eyas.net import free_port
from tests.prefect_server import doc_commands, sh, sigterm_worker, task_runs, wait_flow_run

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
    ".venv/bin/python -m eyas_prefect.flows.serve_bench configs/kimi-k2.5-sglang.yaml "
    "/data/eyas/runs/kimi-k2.5/drafter": "needs the production GPU hosts",
    "cd /srv/eyas": "here (the repository root)",
    "export PREFECT_API_URL=http://prefect-host:4200/api": "here (the server's env)",
    ".venv/bin/prefect server start --host 0.0.0.0 --port 4200 "
    "&": "here (tests/prefect_server.py, 127.0.0.1)",
    ".venv/bin/prefect work-pool create eyas --type process": "here",
    "until .venv/bin/prefect work-pool ls >/dev/null 2>&1; do sleep 2; done": "here: the Deploy "
    "block as pasted (tests/integration/test_docs_paste.py), and README's Prefect block",
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
    task_runs(server, [run["id"]])  # until each is recorded with its final state
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


def test_the_worker_stops_on_sigterm_within_seconds(server):
    """One SIGTERM stops the documented worker (`eyas worker`), idle, within seconds, saying so. A
    second worker of the documented command, so the session's own worker serves on."""
    log = server.home / "worker-sigterm.log"
    out = sigterm_worker(server.start_worker(log.name, "--name", "sigterm-test"), log)
    assert "eyas worker: SIGTERM: stopped the Prefect worker" in out, out[-3000:]
    assert "no flow run of it was running" in out, out[-3000:]
