"""After a run is killed outright: its subflows marked Crashed, the GPU hosts it held given back,
the servers it launched stopped, at once.

    prefect deployment run 'eyas-release/release' --param flow_run_id=ID    # by hand

A flow-run process killed outright (kill -9, the OOM killer, a lost machine) runs none of its own
cleanup: the worker marks the run Crashed, but its subflows stay Running, and the GPU-host lock it
held (flows/runtime/host_lock.py) stays taken until a later run finds its holder dead. The
`release` deployment (deployments/prefect.yaml) has a trigger that runs this flow for every eyas
deployment run that ends Crashed, so a killed run lets go of what it held at once. On a run that
released everything itself it finds nothing to do.
"""

from __future__ import annotations

from uuid import UUID

from eyas_prefect.flows.common import stop_server_hook
from eyas_prefect.flows.runtime.host_lock import release_held_by
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
from prefect.logging import get_run_logger
from prefect.states import Crashed


def family(client, flow_run_id: str) -> list:
    """The flow run and its subflow runs at every depth, the run first."""
    runs, todo = [client.read_flow_run(flow_run_id)], [UUID(str(flow_run_id))]
    while todo:
        children = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=todo)
            )
        )
        todo = [r.id for r in children]
        runs += children
    return runs


@flow(name="eyas-release", flow_run_name="release-{flow_run_id}")
def release(flow_run_id: str) -> dict:
    """Mark the run's unfinished subflows Crashed, give back the GPU hosts it or they hold, stop
    the servers they launched (the stop hook's rules: only what this run launched)."""
    log = get_run_logger()
    with get_client(sync_client=True) as client:
        runs = family(client, flow_run_id)
        top = runs[0]
        if top.state is None or not top.state.is_final():
            log.info("flow run %s is %s, not over: nothing to release", top.name, top.state)
            return {"run": top.name, "released": False}
        why = f"its flow run {top.name} ended {top.state.name}"
        crashed = []
        for run in runs[1:]:
            if run.state is not None and not run.state.is_final():
                client.set_flow_run_state(run.id, Crashed(message=why), force=True)
                crashed.append(run.name)
        freed = release_held_by(client, {str(r.id) for r in runs})
    for name in crashed:
        log.warning("subflow run %s marked Crashed: %s", name, why)
    for name in freed:
        log.warning("GPU host lock %s given back: %s", name, why)
    stop_server_hook(None, top, top.state)  # says what it stopped, in the run's own log
    return {"run": top.name, "released": True, "subflows_crashed": crashed, "hosts_freed": freed}
