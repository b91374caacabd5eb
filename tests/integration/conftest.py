"""One deployed Prefect server for the whole session: the modules that run deployments share it
(starting a server, a worker and every deployment costs tens of seconds on a small machine). Each
test names its runs, directories and ports after itself, so runs of different modules never meet."""

from __future__ import annotations

import pytest

from eyas.net import free_port
from tests.conftest import DEPLOYED_SERVER_MODULES
from tests.prefect_server import ROOT, WebhookReceiver, deploy_as_documented, start_prefect_server


@pytest.fixture(scope="session")
def webhooks():
    """The failure webhook's receiver on 127.0.0.1: `.posts` holds every POST of the session."""
    receiver = WebhookReceiver()
    yield receiver
    receiver.stop()


#: the deployed server while it runs, for the hook below to stop it
_DEPLOYED = []


@pytest.fixture(scope="session")
def deployed(tmp_path_factory, webhooks):
    """A Prefect server deployed as docs/operations.md says: the eyas pool, every deployment of
    deployments/prefect.yaml, a process worker (limit 2), the failure webhook."""
    srv = start_prefect_server(tmp_path_factory.mktemp("prefect-home"))
    _DEPLOYED.append(srv)
    try:
        deploy_as_documented(srv, webhooks.url)
        yield srv
    finally:
        srv.stop()


def pytest_runtest_teardown(item, nextitem):
    """The modules that use the deployed server run one after another on one worker
    (tests/conftest.py): after the last of them its server and worker stop, instead of polling on
    the cores until the worker's other modules are done."""
    if _DEPLOYED and _module(item) in DEPLOYED_SERVER_MODULES:
        if nextitem is None or _module(nextitem) not in DEPLOYED_SERVER_MODULES:
            _DEPLOYED.pop().stop()


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """Dotted overrides for a deployment run: the tiny target on 40 conversations, 20 steps, own
    dirs and port."""

    def make(name: str, **extra) -> dict:
        tmp = tmp_path_factory.mktemp(name)
        data = tmp / "conversations.jsonl"
        lines = (ROOT / "fixtures" / "data" / "conversations.jsonl").read_text().splitlines()[:40]
        data.write_text("\n".join(lines) + "\n")
        return {
            "name": name,
            "run_dir": str(tmp / "run"),
            "server.port": free_port(),
            "server.workdir": str(tmp / "server"),
            "server.dump_dir": str(tmp / "server" / "dump"),
            "data.path": str(data),
            "data.max_length": 128,
            "data.num_heldout": 2,
            "extraction.output_dir": str(tmp / "shards"),
            "training.output_dir": str(tmp / "train"),
            "training.max_steps": 20,
            "training.warmup_steps": 2,
            "training.checkpoint_every": 10,
            "training.batch_size": 4,
            "evaluation.num_prompts": 2,
            "evaluation.max_new_tokens": 8,
            "benchmark.suites": [],
            "sensor.poll_interval_s": 0.1,
            "server.dp_size": None,
            **extra,
        }  # one replica: these runs share 2 cores with other tests

    return make
