"""Subflow: hidden-state extraction, from the conversations to verified shards on disk.

    prefect deployment run 'eyas-extract/extract' --params '{"overrides": {"extraction.num_shards":
    8}}'

Holds the server host's GPU lock (flows/runtime/host_lock.py) from launch to stop, so two runs
never start two servers on the same GPUs; the second waits in Running.
"""

from __future__ import annotations

from dataclasses import replace

from eyas_prefect.flows.common import (
    DEFAULT_CONFIG,
    STOP_ON_FAILURE,
    ConfigParam,
    Overrides,
    checked_flow,
    resolve_config,
)
from eyas_prefect.flows.runtime.host_lock import gpu_host
from eyas_prefect.flows.serve import run_name, serve
from eyas_prefect.tasks.extract import (
    extract_shard_task_for,
    extraction_context,
    prepare_data,
    regenerate_data,
    shard_cached,
)
from eyas_prefect.tasks.patch import patch_host
from eyas_prefect.tasks.preflight import preflight_check
from eyas_prefect.tasks.server import server_gone, stop
from prefect import flow, get_run_logger
from prefect.events import emit_event
from prefect.futures import as_completed
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner

from eyas.config import PipelineConfig
from eyas.extraction.client import naming_the_cause
from eyas.extraction.shards import ShardManifest
from eyas.extraction.stage import ExtractionContext, check_shards, regeneration_pending
from eyas.report import Stopwatch
from eyas.results import Extracted
from eyas.server.launch import ServerDied


@flow(
    name="eyas-extract",
    flow_run_name=run_name("extract"),
    log_prints=True,
    task_runner=ThreadPoolTaskRunner(max_workers=2),
    **STOP_ON_FAILURE,
)
@checked_flow
def extract(config: ConfigParam = DEFAULT_CONFIG, overrides: Overrides | None = None) -> Extracted:
    """Plan the shards, bring the server up, (regenerate the replies,) extract every shard, stop it.

    When every shard is already intact on disk (a re-run), no server is launched at all.
    """
    cfg = resolve_config(config, overrides)
    with extraction_context() as ctx:  # the extraction's runs, server pools and progress publisher
        return _extract(ctx, cfg)


def _extract(ctx: ExtractionContext, cfg: PipelineConfig) -> Extracted:
    stage = Stopwatch()
    # eyas.standalone: "false" inside the pipeline, whose own train stage follows (automations.py)
    resource = {
        "prefect.resource.id": f"eyas.run.{cfg.name}",
        "eyas.host": cfg.server.host.name,
        "eyas.standalone": "false" if flow_run.parent_flow_run_id else "true",
    }
    regen = cfg.data.regenerate.enabled

    # 1. Data first: a bad input file should fail before a ten-minute server load.
    preflight_check(cfg)
    with stage("prepare"):
        prepared = prepare_data(ctx, cfg)
        if regen and not regeneration_pending(cfg):  # regenerated before: no server needed for it
            prepared = prepare_data(ctx, cfg, regenerate_data(ctx, cfg), take_output_dir=False)
            regen = False
    # 2. The server host's SGLang, patched (the local backend needs nothing).
    with stage("patch"):
        patched = patch_host(cfg)
    patch_version = patched.patch_version or "local"
    # 3. Every shard intact on disk (a re-run): all cache hits, so no server and no GPU lock.
    #    (Pending regeneration replans the shards: checking the present ones would be wasted
    #    reading.)
    up, deaths = None, []  # deaths: why the server died, each time it was relaunched
    checks = None if regen else check_shards(cfg, prepared.plans, patch_version)
    if checks is not None and all(c.intact for c in checks.values()):
        with stage("extract"):
            manifests = _extract_all(ctx, cfg, prepared.plans, patch_version, resource, checks)
    else:
        # 4. Launch, wait until ready, (regenerate,) extract, stop: the host is ours meanwhile.
        manifests, prepared, up = _extract_on_server(
            ctx, cfg, prepared, patch_version, resource, checks, regen, stage, deaths
        )
    emit_event(
        event="eyas.extraction.completed",
        resource=resource,
        payload={"shards": len(manifests), "tokens": sum(m.num_tokens for m in manifests)},
    )
    return Extracted(
        manifests,
        prepared.prompts,
        prepared.stats,
        patch=patched,
        ready=up.ready if up else None,
        stages={**(up.stages if up else {}), **stage.seconds},
        relaunches=deaths,
    )


def _extract_on_server(
    ctx,
    cfg,
    prepared,
    patch_version: str,
    resource: dict,
    checks,
    regen: bool,
    stage: Stopwatch,
    deaths: list[str],
):
    """Under the server host's GPU lock: launch, wait until ready, (regenerate,) extract, stop ->
    (manifests, prepared data, the server's `serve` result). A server that dies is relaunched once
    (why, appended to `deaths`); finished parts and shards stay, the rest resume."""
    with gpu_host(cfg):
        up = serve(cfg)
        try:
            while True:
                try:
                    # the target answers the training conversations; shards come from its answers
                    if regen:
                        with stage("regenerate"):
                            regenerated = regenerate_data(ctx, cfg)
                        with stage("prepare"):
                            prepared = prepare_data(ctx, cfg, regenerated, take_output_dir=False)
                        regen = False
                    with stage("extract"):
                        manifests = _extract_all(
                            ctx, cfg, prepared.plans, patch_version, resource, checks
                        )
                    return manifests, prepared, up
                except Exception:
                    up = _relaunch_if_dead(cfg, up, deaths, stage)
                    ctx.new_server()
                    checks = None  # shards finished before the death: checked again
        finally:
            with stage("stop"):
                stop(cfg, up.handle)


def _error_of(future) -> Exception | None:
    """What a shard task raised (waiting for it to end); None when it completed or never ran."""
    if future.wrapped_future.cancelled():
        return None
    try:
        future.result()
    except Exception as error:  # noqa: BLE001 - each shard's own failure, judged by the caller
        return error
    return None


def _relaunch_if_dead(cfg, up, deaths: list[str], stage: Stopwatch):
    """After a failure: re-raise it unless the server died; relaunch a dead server once (returns the
    new one); a second death fails with both reasons. Call inside an `except` block."""
    reason = server_gone(cfg, up.handle)
    if reason is None:
        raise
    deaths.append(reason)
    if len(deaths) > 1:
        raise ServerDied(
            f"the target server died during extraction ({deaths[0]}), was relaunched, and died "
            f"again ({deaths[1]})"
        ) from None
    get_run_logger().warning(
        "the target server died (%s): relaunching it once; finished shards stay, the others resume",
        reason,
    )
    with stage("stop"):
        stop(cfg, up.handle)  # its record and dump folder
    return serve(cfg)


def _extract_all(
    ctx, cfg, plans, patch_version: str, resource: dict, checks: dict | None = None
) -> list[ShardManifest]:
    """One task per shard (bounded by the task runner), an `eyas.shard.done` event as each ends.
    Each shard is checked on disk once (`checks`, made here when not given): the check decides
    whether Prefect's cache may answer, and the task reuses what it found.

    The tasks publish the progress artifact `extract-NAME` and the shard table
    `extract-shards-NAME`.
    """
    checks = checks or check_shards(cfg, plans, patch_version)
    futures = [
        extract_shard_task_for(checks[plan.name]).submit(
            ctx, cfg, plan, patch_version, checks[plan.name]
        )
        for plan in plans
    ]
    plan_of = {id(f): plan for f, plan in zip(futures, plans)}
    cached = set()
    for done, future in enumerate(as_completed(futures), 1):
        try:
            m = future.result()
        except Exception as error:
            # one failure ends the stage: the shards still queued never start (nor send a
            # request to a server that stalled or died)
            for queued in futures:
                if not queued.wrapped_future.running():  # one in flight ends with its own error
                    queued.wrapped_future.cancel()
            # a stalled pool names its reason in one shard's error (the others only point at it,
            # eyas/extraction/client.py PoolStopped): the stage fails with that one, once the
            # shards in flight have ended (naming_the_cause reads them only for a follower)
            cause = naming_the_cause(error, (_error_of(f) for f in futures))
            if cause is error:
                raise
            raise cause from cause.__cause__  # its own chain, not the follower it was raised beside
        if future.state.name == "Cached":  # answered from Prefect's cache: no task body counted it
            shard_cached(ctx, cfg, plan_of[id(future)], m)
            cached.add(id(future))
        emit_event(
            event="eyas.shard.done",
            resource=resource,
            payload={"file": m.file, "tokens": m.num_tokens, "done": done, "total": len(plans)},
        )
    return [replace(f.result(), reused=True) if id(f) in cached else f.result() for f in futures]
