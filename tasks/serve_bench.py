"""Prefect task: serve the target plainly and with the drafter, and measure the speed-up."""

from prefect import task
from prefect.logging import get_run_logger

from eyas.config import PipelineConfig
from eyas.evaluation.export import drafter_digest
from eyas.evaluation.serve_bench import run_serve_bench
from eyas.secrets import redact_args
from tasks.server import run_owner
from tasks.train import result_key


def _serving_key(context, parameters) -> str:
    """The drafter's bytes, the target, the host and its server's launch settings, the benchmark
    settings, the prompts."""
    cfg = parameters["cfg"]
    return "serve-bench-" + result_key(drafter_digest(parameters["drafter_dir"]), str(cfg.target.checkpoint),
                                       cfg.target.revision, cfg.server.host.name, cfg.server.backend,
                                       redact_args(cfg.server.launch_args), cfg.server.env,  # tuning, not keys
                                       cfg.benchmark.model_dump(mode="json"), parameters["prompts"])


def benchmark_serving_for(cfg: PipelineConfig):
    """The benchmark task, re-measured (record overwritten) when the config's `refresh` names it."""
    return benchmark_serving.with_options(refresh_cache="serve_bench" in cfg.refresh)


@task(task_run_name="serve-bench@{cfg.server.host.name}", cache_key_fn=_serving_key, persist_result=True)
def benchmark_serving(cfg: PipelineConfig, drafter_dir: str, prompts: list[list[int]]) -> dict:
    """Launch plain and speculative servers in turn (same prompts), return figures and speed-ups.

    Cached across runs on its inputs: a re-run with the same drafter, target, settings and prompts
    reports the figures measured before (`refresh: [serve_bench]` measures again).
    """
    logger = get_run_logger()
    result = run_serve_bench(cfg, drafter_dir, prompts, log=logger.info, owner=run_owner())
    logger.info("single-stream speed-up %sx at acceptance length %s (outputs identical: %s)",
                result["speedup"]["single_stream_tokens_per_s"], result["acceptance_length"],
                result["identical_outputs"])
    return result
