"""Prefect tasks: launch the target server, wait until it is ready, stop it."""

from eyas_prefect.tasks.retry import worth_retrying
from prefect import task
from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.events import emit_event
from prefect.logging import get_run_logger

from eyas.config import PipelineConfig
from eyas.report import artifact_key
from eyas.server import launch, readiness
from eyas.server.hosts import make_host
from eyas.server.ownership import Owner


def run_owner() -> Owner:
    """A new launch token, with this flow run and its parents (innermost first): the runs whose
    failure hooks may stop what is launched now (flows/common.py STOP_ON_FAILURE)."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import flow_run

    runs, run_id = [], flow_run.id
    try:
        with get_client(sync_client=True) as client:
            while run_id and len(runs) < 16:
                runs.append(str(run_id))
                parent = client.read_flow_run(run_id).parent_task_run_id
                run_id = client.read_task_run(parent).flow_run_id if parent else None
    except Exception:  # noqa: BLE001 - outside a run, or the API went away: what we have
        pass
    return Owner.new(runs)


@task(
    task_run_name="launch-{cfg.server.backend}@{cfg.server.host.name}",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=[5, 20],
    retry_condition_fn=worth_retrying,
    timeout_seconds=600,
)
def launch_server(cfg: PipelineConfig) -> launch.ServerHandle:
    """Start the server detached; returns its handle (pid, url, log path and offset)."""
    owner = run_owner()
    with make_host(cfg.server.host) as host:
        # a top-level `serve` run leaves its server up on purpose; inside a pipeline it ends with
        # the run
        handle = launch.start_server(
            host, launch.capture_launch(cfg), owner, leave_up=len(owner.runs) <= 1
        )
    get_run_logger().info("launched pid %s on %s: %s", handle.pid, handle.host, handle.command)
    return handle


@task(task_run_name="wait-ready@{cfg.server.host.name}", cache_policy=NO_CACHE)
def wait_ready(cfg: PipelineConfig, handle: launch.ServerHandle) -> readiness.ReadyReport:
    """Poll the server log until ready (progress in the UI); fail fast on crash, stall, deadline."""
    logger = get_run_logger()
    artifact = create_progress_artifact(
        progress=0.0,
        key=artifact_key("load", cfg.name),
        description=f"target loading on {cfg.server.host.name}",
    )

    resource = {
        "prefect.resource.id": f"eyas.server.{cfg.server.host.name}.{cfg.server.port}",
        "eyas.run": cfg.name,
        "eyas.backend": cfg.server.backend,
    }

    def on_progress(p) -> None:
        eta = "?" if p.remaining_s is None else f"{p.remaining_s:.0f}s"
        logger.info("loading shards %d/%d (%d%%), ETA %s", p.done, p.total, p.percent, eta)
        update_progress_artifact(artifact_id=artifact, progress=float(p.percent))
        emit_event(
            event="eyas.server.loading",
            resource=resource,
            payload={"done": p.done, "total": p.total, "eta_s": p.remaining_s},
        )

    try:
        with make_host(cfg.server.host) as host:
            report = readiness.wait_for_server(
                host, handle, cfg.sensor, on_progress, replica_reporter(cfg, logger, resource)
            )
    except readiness.ServerFailed as e:
        # the state message keeps the cause; the log's own words go to the run's log
        logger.warning("the server log's last %d lines:\n%s", len(e.log_lines), e.log_tail())
        emit_event(
            event="eyas.server.failed",
            resource=resource,
            payload={"reason": e.reason, "log_tail": e.log_lines[-20:]},
        )
        raise
    update_progress_artifact(artifact_id=artifact, progress=100.0)
    emit_event(
        event="eyas.server.ready",
        resource=resource,
        payload={"seconds": report.seconds, "url": handle.url},
    )
    logger.info("server ready after %.1fs", report.seconds)
    return report


def replica_reporter(cfg: PipelineConfig, logger, resource: dict):
    """wait-ready's on_replicas: each change of the replicas' loads as a log line, the table
    artifact `replicas-NAME` and the event eyas.server.replicas."""

    def on_replicas(seen: dict[str, str]) -> None:
        replicas = replica_states(seen, cfg.server.dp_size)
        loaded = sum(state == "loaded" for state in replicas.values())
        logger.info(
            "replicas %s: %d of %d loaded",
            ", ".join(f"{r} {state}" for r, state in replicas.items()),
            loaded,
            len(replicas),
        )
        create_table_artifact(
            key=artifact_key("replicas", cfg.name),
            table=[{"replica": r, "weights": state} for r, state in replicas.items()],
            description=f"each replica's load on {cfg.server.host.name} ({loaded} of "
            f"{len(replicas)} loaded)",
        )
        emit_event(event="eyas.server.replicas", resource=resource, payload={"replicas": replicas})

    return on_replicas


def replica_states(seen: dict[str, str], dp_size: int | None) -> dict[str, str]:
    """Each replica's load as the log showed it, with the ones `dp_size` promises and the log has
    not named yet as "waiting"."""
    expected = {f"DP{i}": "waiting" for i in range(dp_size or 0)}
    return dict(sorted({**expected, **seen}.items(), key=lambda kv: int(kv[0].removeprefix("DP"))))


@task(
    task_run_name="stop@{cfg.server.host.name}",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=worth_retrying,
    timeout_seconds=300,
)
def stop(cfg: PipelineConfig, handle: launch.ServerHandle | None = None) -> dict:
    """Stop the server (the one `handle` names, else the recorded one) and clean its dump directory;
    only ever a process eyas launched (launch.stop_server)."""
    capture = launch.capture_launch(cfg)
    with make_host(cfg.server.host) as host:
        out = (
            launch.stop_server(host, capture, handle)
            if handle
            else launch.stop_recorded(host, capture)
        )
    get_run_logger().info(
        "server pid %s: %s; dump folder: %s", out.get("pid"), out["outcome"], out.get("dump_dir")
    )
    return out


@task(
    task_run_name="server-gone@{cfg.server.host.name}",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=5,
    retry_condition_fn=worth_retrying,
)
def server_gone(cfg: PipelineConfig, handle: launch.ServerHandle) -> str | None:
    """Why the launched server has died (its log's fatal line), or None while it runs."""
    with make_host(cfg.server.host) as host:
        return launch.gone_reason(host, launch.capture_launch(cfg), handle)
