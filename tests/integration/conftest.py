"""One deployed Prefect server for the whole session: the modules that run deployments share it
(starting a server, a worker and every deployment costs tens of seconds on a small machine). Each
test names its runs, directories and ports after itself, so runs of different modules never meet."""

from __future__ import annotations

import pytest

from tests.prefect_server import WebhookReceiver, deploy_as_documented, start_prefect_server


@pytest.fixture(scope="session")
def webhooks():
    """The failure webhook's receiver on 127.0.0.1: `.posts` holds every POST of the session."""
    receiver = WebhookReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def deployed(tmp_path_factory, webhooks):
    """A Prefect server deployed as docs/operations.md says: the eyas pool, every deployment of
    deployments/prefect.yaml, a process worker (limit 2), the failure webhook."""
    srv = start_prefect_server(tmp_path_factory.mktemp("prefect-home"))
    try:
        deploy_as_documented(srv, webhooks.url)
        yield srv
    finally:
        srv.stop()
