"""Prefect task: serve the target plainly and with the drafter, and measure the speed-up."""

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from eyas.config import PipelineConfig
from eyas.serve_bench import run_serve_bench


@task(task_run_name="serve-bench@{cfg.server.host.name}", cache_policy=NO_CACHE)
def benchmark_serving(cfg: PipelineConfig, drafter_dir: str, prompts: list[list[int]]) -> dict:
    """Launch plain and speculative servers in turn (same prompts), return figures and speed-ups."""
    logger = get_run_logger()
    result = run_serve_bench(cfg, drafter_dir, prompts, log=logger.info)
    logger.info("single-stream speed-up %sx at acceptance length %s (outputs identical: %s)",
                result["speedup"]["single_stream_tokens_per_s"], result["acceptance_length"],
                result["identical_outputs"])
    return result
