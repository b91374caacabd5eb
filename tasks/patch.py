"""Prefect tasks: patch the server host so it can dump hidden states, or undo that."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from eyas.server import sglang_patch
from eyas.config import PipelineConfig
from eyas.server.hosts import HostAuthError, make_host


def _transient(task, task_run, state) -> bool:
    """Retry only a failure that may pass (a dropped connection), never a refused host state."""
    try:
        state.result()
    except (sglang_patch.PatchError, HostAuthError):  # refused login, missing known_hosts
        return False
    except Exception:  # noqa: BLE001 - unreachable host, failed transfer: worth one more try
        return True
    return False


@task(task_run_name="patch@{cfg.server.host.name}", cache_policy=NO_CACHE, retries=1,
      retry_delay_seconds=5, retry_condition_fn=_transient, timeout_seconds=900)
def patch_host(cfg: PipelineConfig) -> dict:
    """Patch (or confirm) the server host; the local backend needs nothing."""
    host = make_host(cfg.server.host)
    try:
        return sglang_patch.ensure_patched(host, cfg)
    finally:
        host.close()


@task(task_run_name="unpatch@{cfg.server.host.name}", cache_policy=NO_CACHE, retries=1,
      retry_delay_seconds=5, retry_condition_fn=_transient, timeout_seconds=900)
def unpatch_host(cfg: PipelineConfig) -> dict:
    """Restore the host's original SGLang files and remove eyas's hook modules."""
    host = make_host(cfg.server.host)
    try:
        return sglang_patch.reverse_patch(host, cfg)
    finally:
        host.close()
