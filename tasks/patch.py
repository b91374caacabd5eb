"""Prefect tasks: patch the server host so it can dump hidden states, or undo that."""

from eyas_prefect.tasks.retry import worth_retrying
from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.config import PipelineConfig
from eyas.server import sglang_patch
from eyas.server.hosts import make_host
from eyas.server.sglang_patch import PatchReport


# One retry: a dropped connection or a failed transfer may pass; a refused login, a missing
# known_hosts or a host state eyas will not patch (PatchError) never does.
@task(
    task_run_name="patch@{cfg.server.host.name}",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=worth_retrying,
    timeout_seconds=900,
)
def patch_host(cfg: PipelineConfig) -> PatchReport:
    """Patch (or confirm) the server host; the local backend needs nothing."""
    with make_host(cfg.server.host) as host:
        return sglang_patch.ensure_patched(host, cfg)


@task(
    task_run_name="unpatch@{cfg.server.host.name}",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=worth_retrying,
    timeout_seconds=900,
)
def unpatch_host(cfg: PipelineConfig) -> PatchReport:
    """Restore the host's original SGLang files and remove eyas's hook modules."""
    with make_host(cfg.server.host) as host:
        return sglang_patch.reverse_patch(host, cfg)
