"""Prefect task: check the config against the target, the hosts and the disks before any GPU is
used.

The first task of every flow. Inside the pipeline its subflows find the pipeline's answer in the
cache (the key is the root flow run and the config), so the checks run once per run.
"""

from __future__ import annotations

import hashlib

from eyas_prefect.tasks.progress import logger
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run

from eyas.config import PipelineConfig
from eyas.errors import EyasError
from eyas.preflight import format_preflight, preflight
from eyas.report import artifact_key


class PreflightFailed(EyasError, ValueError):
    """The config cannot run as it is; the message lists every problem with its field."""


def _key(context, parameters) -> str:
    cfg: PipelineConfig = parameters["cfg"]
    digest = hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()[:16]
    return f"preflight-{flow_run.root_flow_run_id or flow_run.id}-{digest}"


@task(task_run_name="preflight", cache_key_fn=_key, persist_result=True, timeout_seconds=900)
def preflight_check(cfg: PipelineConfig) -> dict:
    """The target's config against layer ids and the drafter, the patch set, hosts, disk; the
    plan."""
    result = preflight(cfg)
    text = format_preflight(result, cfg)
    logger().info("%s", text)
    create_markdown_artifact(
        key=artifact_key("plan", cfg.name),
        markdown=f"```\n{text}\n```",
        description="eyas preflight: the plan and any problems",
    )
    if not result.ok:
        raise PreflightFailed(
            f"preflight found {len(result.problems)} problem(s): " + "; ".join(result.problems)
        )
    return {"notes": result.notes, "plan": text}
