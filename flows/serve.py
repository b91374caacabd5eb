"""Subflows that own the target server: bring it up (patch, launch, wait) and tear it down.

    # a server for manual work; stop it with teardown
    prefect deployment run 'eyas-serve/serve'
    prefect deployment run 'eyas-teardown/teardown'

Run alone, `serve` leaves the server up (that is its purpose); inside `extract` the caller holds the
host's GPU lock and stops the server when extraction ends.
"""

from __future__ import annotations

from eyas_prefect.flows.common import (
    DEFAULT_CONFIG,
    STOP_ON_FAILURE,
    ConfigParam,
    Overrides,
    checked_flow,
    config_label,
    resolve_config,
)
from eyas_prefect.flows.failures import failure_artifact_hook
from eyas_prefect.tasks.patch import patch_host, unpatch_host
from eyas_prefect.tasks.preflight import preflight_check
from eyas_prefect.tasks.server import launch_server, stop, wait_ready
from prefect import flow
from prefect.runtime import flow_run

from eyas.report import Stopwatch
from eyas.results import ServerUp


def run_name(prefix: str):
    """flow_run_name: `<prefix>-<config name>@<server host>`, whatever form the config came in; a
    config that does not load gives `<prefix>-<its name or file stem>` (the run then fails with
    why)."""

    def name() -> str:
        p = flow_run.parameters
        try:
            cfg = resolve_config(p["config"], p.get("overrides"))
        except Exception:  # noqa: BLE001 - named anyway; checked_flow fails the run with the reason
            return f"{prefix}-{config_label(p.get('config'), p.get('overrides'))}"
        return f"{prefix}-{cfg.name}@{cfg.server.host.name}"

    return name


@flow(name="eyas-serve", flow_run_name=run_name("serve"), log_prints=True, **STOP_ON_FAILURE)
@checked_flow
def serve(config: ConfigParam = DEFAULT_CONFIG, overrides: Overrides | None = None) -> ServerUp:
    """Patch the server host, launch the target server, wait until it is ready."""
    cfg, stage = resolve_config(config, overrides), Stopwatch()
    preflight_check(cfg)
    with stage("patch"):
        patched = patch_host(cfg)
    with stage("launch"):
        handle = launch_server(cfg)
    with stage("wait_ready"):
        ready = wait_ready(cfg, handle)
    return ServerUp(handle, ready, patched, stage.seconds)


@flow(
    name="eyas-teardown",
    flow_run_name=run_name("teardown"),
    log_prints=True,
    on_failure=[failure_artifact_hook],
)
@checked_flow
def teardown(
    config: ConfigParam = DEFAULT_CONFIG, overrides: Overrides | None = None, unpatch: bool = False
) -> dict:
    """Stop the server a config launched (idempotent); optionally restore the host's SGLang."""
    cfg = resolve_config(config, overrides)
    out = {"stop": stop(cfg)}
    if unpatch:
        out["unpatch"] = unpatch_host(cfg)
    return out
