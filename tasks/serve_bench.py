"""Prefect task: serve the target plainly and once per chain with the drafter: acceptance,
speed-up."""

from dataclasses import fields

from eyas_prefect.tasks.progress import ServeBenchPublisher
from eyas_prefect.tasks.server import run_owner
from eyas_prefect.tasks.train import result_key
from prefect import task
from prefect.logging import get_run_logger

from eyas.config import PipelineConfig
from eyas.evaluation.export import drafter_digest
from eyas.evaluation.serve_bench import ServeBenchResult, chains, run_serve_bench
from eyas.secrets import redact_args


def _serving_key(context, parameters) -> str:
    """The drafter's bytes, the target, the host and its server's launch settings, the chains
    served, the evaluation and benchmark settings, the prompt sets (token ids and sources); and the
    result's fields: a record of another shape is measured again, not returned."""
    cfg = parameters["cfg"]
    return "serve-bench-" + result_key(
        [f.name for f in fields(ServeBenchResult)],
        drafter_digest(parameters["drafter_dir"]),
        str(cfg.target.checkpoint),
        cfg.target.revision,
        cfg.server.host.name,
        cfg.server.backend,
        redact_args(cfg.server.launch_args),
        cfg.server.env,  # tuning, not keys
        [c.name for c in chains(cfg)[0]],
        cfg.evaluation.model_dump(mode="json", exclude={"device", "method"}),
        cfg.benchmark.model_dump(mode="json"),
        parameters["sets"],
    )


def benchmark_serving_for(cfg: PipelineConfig):
    """The serving task, measured again (record overwritten) when the config's `refresh` names
    it."""
    return benchmark_serving.with_options(refresh_cache="serve_bench" in cfg.refresh)


@task(
    task_run_name="serve-bench@{cfg.server.host.name}",
    cache_key_fn=_serving_key,
    persist_result=True,
)
def benchmark_serving(
    cfg: PipelineConfig, drafter_dir: str, sets: dict[str, dict]
) -> ServeBenchResult:
    """Launch plain once, then once per chain with the drafter (same prompt sets): acceptance per
    chain and set from the servers' counters, speed-ups.

    Cached across runs on its inputs: a re-run with the same drafter, target, chains, settings and
    prompts reports the figures measured before (`refresh: [serve_bench]` measures again).
    """
    logger = get_run_logger()
    progress = ServeBenchPublisher(cfg.name, ["plain", *(c.name for c in chains(cfg)[0])])
    try:
        result = run_serve_bench(
            cfg, drafter_dir, sets, log=logger.info, owner=run_owner(), progress=progress
        )
    finally:
        progress.stop()  # a failed stage's heartbeat must not outlive it
    progress.finish()
    for chain, c in result.chains.items():
        for name, s in c["sets"].items():
            logger.info(
                "acceptance length %.3f at %s on %s (%d prompts), speed-up %sx",
                s["acceptance_length"],
                chain,
                name,
                s["num_prompts"],
                s["speedup"],
            )
    if result.speedup:
        logger.info(
            "single-stream speed-up %sx at %s (outputs identical: %s)",
            result.speedup["single_stream_tokens_per_s"],
            result.benchmark_chain,
            result.identical_outputs,
        )
    return result
