"""Prefect tasks of the extraction stage: prepare the data, regenerate it, extract one shard per
task.

The work is in eyas/extraction/stage.py; these wrappers add run names, retries and cache policy.
The flow makes one ExtractionContext for the extraction (its runs, its server pools, the progress
publisher of tasks/progress.py) and hands it to every task here.
"""

from __future__ import annotations

import hashlib
from dataclasses import fields, replace

from eyas_prefect.tasks.dead_runs import crash_dead_runs
from eyas_prefect.tasks.progress import ExtractionPublisher, RegenerationPublisher, logger
from eyas_prefect.tasks.retry import worth_retrying
from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.config import PipelineConfig
from eyas.extraction import stage
from eyas.extraction.data import ShardPlan
from eyas.extraction.extract import ShardCheck
from eyas.extraction.shards import ShardManifest
from eyas.extraction.stage import ExtractionContext, Prepared


def extraction_context() -> ExtractionContext:
    """The context a flow makes for one extraction: its figures published as progress artifacts."""
    return ExtractionContext(publisher_for=ExtractionPublisher)


@task(task_run_name="prepare-data", cache_policy=NO_CACHE, timeout_seconds=6 * 3600)
def prepare_data(
    ctx: ExtractionContext,
    cfg: PipelineConfig,
    data_path: str | None = None,
    take_output_dir: bool = True,
) -> Prepared:
    """Take the output dir, clean a killed run's leftovers, tokenize, plan the shards, check disk
    space."""
    from prefect.runtime import flow_run

    return stage.prepare(
        ctx,
        cfg,
        data_path,
        take_dir=take_output_dir,
        log=logger().info,
        holder=f"flow run {flow_run.id}" if flow_run.id else "",
        on_reclaim=crash_dead_runs,
    )


# Resumable by part: a retry answers only the parts not yet on disk (as a shard's task retries a
# shard)
@task(
    task_run_name="regenerate-data@{cfg.server.host.name}",
    cache_policy=NO_CACHE,
    retries=2,
    retry_delay_seconds=[5, 30],
    retry_condition_fn=worth_retrying,
)
def regenerate_data(ctx: ExtractionContext, cfg: PipelineConfig) -> str:
    """Answer the training conversations again with the target (resumable by part); returns the new
    file.

    Its progress: the artifact `regenerate-NAME` (conversations done, tokens/s, ETA)."""
    return stage.regenerate_replies(
        ctx,
        cfg,
        log=logger().info,
        warn=logger().warning,
        on_progress=RegenerationPublisher(cfg.name),
    )


def _shard_cache_key(context, parameters) -> str:
    """What the shard depends on (stage.shard_key): its content, the target, layers, dtype, patch;
    and the fields of the manifest record the task returns (a record of another shape is not
    returned)."""
    shape = hashlib.sha256(",".join(f.name for f in fields(ShardManifest)).encode()).hexdigest()[
        :12
    ]
    key = stage.shard_key(parameters["cfg"], parameters["plan"], parameters["patch_version"])
    return f"{key}-{shape}"


def extract_shard_task_for(check: ShardCheck):
    """The shard's task, as its check on disk (stage.check_shards, made once by the flow) allows.

    Intact: Prefect's record under the shard's key is used (state Cached). Missing, damaged or
    stale: the record is refreshed (recomputed and stored again under the same key, so the next run
    hits it; a one-off "miss" key would leave nothing a later run could find).
    """
    return extract_shard_task.with_options(refresh_cache=not check.intact)


def shard_cached(
    ctx: ExtractionContext, cfg: PipelineConfig, plan: ShardPlan, shard: ShardManifest
) -> None:
    """A shard Prefect answered from its cache ran no task body: count it in the progress here."""
    stage.shard_finished(ctx, cfg, plan, replace(shard, reused=True), log=logger().info)


@task(
    name="extract-shard",
    task_run_name="extract-{plan.name}-of-{plan.num_shards:05d}@{cfg.server.host.name}",
    cache_key_fn=_shard_cache_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=[5, 30],
    retry_condition_fn=worth_retrying,
)
def extract_shard_task(
    ctx: ExtractionContext,
    cfg: PipelineConfig,
    plan: ShardPlan,
    patch_version: str,
    check: ShardCheck | None = None,
) -> ShardManifest:
    """Extract one shard (or reuse an intact one) with the core's stage.run_shard; returns its
    manifest, never tensors.

    Submit it through `extract_shard_task_for(check)`, which refreshes the cache when the check
    did not find the file intact; `check` spares the body a second read of the file.
    """
    return stage.run_shard(
        ctx, cfg, plan, patch_version, log=logger().info, warn=logger().warning, check=check
    )
