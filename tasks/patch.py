"""Prefect task: make sure the server host can dump hidden states."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas import sglang_patch
from eyas.config import PipelineConfig
from eyas.hosts import make_host


@task(task_run_name="patch@{cfg.server.host.name}", cache_policy=NO_CACHE, retries=1,
      retry_delay_seconds=5)
def patch_host(cfg: PipelineConfig) -> dict:
    """Patch (or confirm) the server host; the local backend needs nothing."""
    host = make_host(cfg.server.host)
    try:
        return sglang_patch.ensure_patched(host, cfg)
    finally:
        host.close()
