"""Subflow: hidden-state extraction, from the conversations to verified shards on disk.

    prefect deployment run 'eyas-extract/extract' --params '{"overrides": {"extraction.num_shards": 8}}'

Holds the server host's GPU lock (a strict global concurrency limit with one slot) from launch to
stop, so two runs never start two servers on the same GPUs; the second waits in Running.
"""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.events import emit_event
from prefect.futures import as_completed
from prefect.task_runners import ThreadPoolTaskRunner

from eyas.report import Stopwatch
from flows.common import DEFAULT_CONFIG, ConfigParam, gpu_host, resolve_config, stop_server_hook
from flows.serve import run_name, serve
from tasks.extract import (extract_shard_for, prepare_data, regenerate_data, regeneration_pending,
                           shards_intact)
from tasks.patch import patch_host
from tasks.server import stop_server


@flow(name="eyas-extract", flow_run_name=run_name("extract"), log_prints=True,
      task_runner=ThreadPoolTaskRunner(max_workers=2),
      on_failure=[stop_server_hook], on_crashed=[stop_server_hook])
def extract(config: ConfigParam = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None) -> dict:
    """Plan the shards, bring the server up, (regenerate the replies,) extract every shard, stop it.

    When every shard is already intact on disk (a re-run), no server is launched at all.
    """
    cfg, stage = resolve_config(config, overrides), Stopwatch()
    resource = {"prefect.resource.id": f"eyas.run.{cfg.name}", "eyas.host": cfg.server.host.name}
    regen = cfg.data.regenerate.enabled

    # Data first: a bad input file should fail before a ten-minute server load.
    with stage("prepare"):
        plans, prompts, data_stats = prepare_data(cfg)
        if regen and not regeneration_pending(cfg):  # regenerated before: no server needed for it
            plans, prompts, data_stats = prepare_data(cfg, regenerate_data(cfg), take_output_dir=False)
            regen = False
    with stage("patch"):
        patched = patch_host(cfg)
    patch_version = patched.get("patch_version", "local")
    # (Pending regeneration replans the shards: checking the present ones would be wasted reading.)
    if not regen and all(shards_intact(cfg, plans, patch_version).values()):
        # Nothing to extract: every shard is a cache hit, so no server, no GPU lock.
        up = {"ready": {}, "patch": patched, "stages": {}}
        with stage("extract"):
            manifests = _extract_all(cfg, plans, patch_version, resource)
    else:
        with gpu_host(cfg):
            up = serve(cfg)
            try:
                if regen:  # the target answers the training conversations; shards come from its answers
                    with stage("regenerate"):
                        regenerated = regenerate_data(cfg)
                    with stage("prepare"):
                        plans, prompts, data_stats = prepare_data(cfg, regenerated, take_output_dir=False)
                with stage("extract"):
                    manifests = _extract_all(cfg, plans, patch_version, resource)
            finally:
                with stage("stop"):
                    stop_server(cfg, up["handle"])
    emit_event(event="eyas.extraction.completed", resource=resource, payload={
        "shards": len(manifests), "tokens": sum(m["num_tokens"] for m in manifests)})
    return {"manifests": manifests, "prompts": prompts, "data_stats": data_stats,
            "ready": up["ready"], "patch": up["patch"], "stages": {**up["stages"], **stage.seconds}}


def _extract_all(cfg, plans, patch_version: str, resource: dict) -> list[dict]:
    """One task per shard (bounded by the task runner), an `eyas.shard.done` event as each ends.

    The tasks publish the progress artifact `extract-NAME` and the shard table `extract-shards-NAME`.
    """
    futures = [extract_shard_for(cfg, plan, patch_version).submit(cfg, plan, patch_version) for plan in plans]
    for done, future in enumerate(as_completed(futures), 1):
        m = future.result()
        emit_event(event="eyas.shard.done", resource=resource,
                   payload={"file": m.get("file"), "tokens": m["num_tokens"], "done": done,
                            "total": len(plans)})
    return [f.result() for f in futures]
