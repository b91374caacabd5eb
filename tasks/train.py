"""Prefect tasks: train the drafter, export it in SGLang's format, measure its acceptance length."""

import hashlib
import json
from dataclasses import fields
from pathlib import Path

from eyas_prefect.tasks.progress import TrainingPublisher
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from eyas.config import PipelineConfig
from eyas.evaluation.evaluate import EvalResult, evaluate_acceptance
from eyas.evaluation.export import drafter_digest, export_drafter
from eyas.extraction.shards import ShardManifest
from eyas.training.distributed import launch_training
from eyas.training.train import TrainResult, train_drafter


@task(task_run_name="train-drafter", cache_policy=NO_CACHE)
def train(cfg: PipelineConfig, manifests: list[ShardManifest]) -> TrainResult:
    """Train the EAGLE-3 drafter on the extracted shards (resumes from its last checkpoint).

    In this process by default; under torchrun on training.distributed's hosts when it asks for
    more than one process or another host (its steps then come from rank 0's launch/progress.jsonl).
    Its progress: the artifacts `train-NAME` (step/total, tokens/s, ETA) and `train-losses-NAME`
    (the loss table), updated at a bounded rate (tasks/progress.py).
    """
    logger = get_run_logger()
    shard_paths = [Path(cfg.extraction.output_dir) / m.file for m in manifests]
    run = launch_training if cfg.training.distributed.launched else train_drafter
    publisher = TrainingPublisher(cfg.name, cfg.training.max_steps)
    result = run(
        cfg.training,
        cfg.target,
        shard_paths,
        log=logger.info,
        warn=logger.warning,
        on_step=publisher,
    )
    publisher.finish(result)
    return result


@task(task_run_name="export-drafter", cache_policy=NO_CACHE, timeout_seconds=3600)
def export(cfg: PipelineConfig, trained: TrainResult, shard: ShardManifest) -> str:
    """Write the drafter folder SGLang loads (config.json, model.safetensors with d2t/t2d); the
    shard's manifest says which layers it captured."""
    out = export_drafter(
        Path(trained.checkpoint_dir),
        Path(cfg.run_dir) / "drafter",
        target=cfg.target,
        export=cfg.export,
        shard_meta=shard.meta,
    )
    get_run_logger().info("drafter exported to %s (SGLang's LlamaForCausalLMEagle3 format)", out)
    return str(out)


def result_key(*parts) -> str:
    """A cache key over JSON-able parts (config sections, digests, prompts)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _evaluation_key(context, parameters) -> str:
    """The drafter's bytes, the target, the settings and prompts: the same inputs, the same figures
    (and the result's fields: a record of another shape is measured again, not returned)."""
    cfg, prompts = parameters["cfg"], parameters["prompts"]
    return "evaluate-" + result_key(
        [f.name for f in fields(EvalResult)],
        drafter_digest(parameters["drafter_dir"]),
        str(cfg.target.checkpoint),
        cfg.target.revision,
        cfg.target.capture_ids(),
        cfg.evaluation.model_dump(mode="json"),
        prompts[: cfg.evaluation.num_prompts],
    )


def evaluate_for(cfg: PipelineConfig):
    """The evaluation task, recomputed (record overwritten) when the config's `refresh` names it."""
    return evaluate.with_options(refresh_cache="evaluate" in cfg.refresh)


@task(task_run_name="evaluate-acceptance", cache_key_fn=_evaluation_key, persist_result=True)
def evaluate(cfg: PipelineConfig, drafter_dir: str, prompts: list[list[int]]) -> EvalResult:
    """Greedy chain speculative decoding with the exported drafter against the target, per
    setting."""
    result = evaluate_acceptance(
        Path(drafter_dir),
        Path(cfg.target.checkpoint),
        prompts[: cfg.evaluation.num_prompts],
        cfg.evaluation,
        cfg.target.capture_ids(),
    )
    for name, s in result.settings.items():
        get_run_logger().info(
            "acceptance length %.3f at %s over %d prompts",
            s["acceptance_length"],
            name,
            result.num_prompts,
        )
    return result
