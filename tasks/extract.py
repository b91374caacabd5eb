"""Prefect tasks: tokenize and plan the data, extract one shard per task."""

import uuid
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_run_logger

from eyas import data, extract
from eyas.config import PipelineConfig
from eyas.data import ShardPlan
from eyas.target import load_tokenizer


@task(task_run_name="prepare-data", cache_policy=NO_CACHE)
def prepare_data(cfg: PipelineConfig) -> tuple[list[ShardPlan], list[list[int]], dict]:
    """Tokenize the conversations, hold some out, and write one plan file per shard."""
    tokenizer = load_tokenizer(cfg.data.tokenizer or cfg.target.checkpoint)
    prepared = data.prepare(data.load_conversations(cfg.data.path), tokenizer, cfg.data)
    plans = data.write_shard_plans(prepared.train, cfg.extraction.num_shards,
                                   Path(cfg.extraction.output_dir) / "plan")
    get_run_logger().info("prepared %s", prepared.stats)
    return plans, prepared.heldout_prompts, prepared.stats


def _key(cfg: PipelineConfig, plan: ShardPlan, patch_version: str) -> str:
    return extract.shard_cache_key(plan, target_checkpoint=str(cfg.target.checkpoint),
                                   target_revision=cfg.target.revision,
                                   capture_ids=cfg.target.capture_ids(),
                                   dtype=cfg.extraction.dtype, patch_version=patch_version)


def _cache_key_checked_on_disk(context, parameters) -> str:
    """Cache across runs on what the shard depends on, but only while the file is intact."""
    cfg, plan = parameters["cfg"], parameters["plan"]
    key = _key(cfg, plan, parameters["patch_version"])
    if extract.existing_shard(cfg.extraction.output_dir, plan, key) is None:
        return f"{key}-recompute-{uuid.uuid4().hex}"  # deleted or corrupted: force a miss
    return key


@task(task_run_name="extract-{plan.name}-of-{plan.num_shards:05d}@{cfg.server.host.name}",
      cache_key_fn=_cache_key_checked_on_disk, persist_result=True, retries=2,
      retry_delay_seconds=[5, 30])
def extract_shard(cfg: PipelineConfig, plan: ShardPlan, patch_version: str) -> dict:
    """Extract one shard (or reuse an intact one); returns its manifest, never tensors."""
    key = _key(cfg, plan, patch_version)
    found = extract.existing_shard(cfg.extraction.output_dir, plan, key)
    if found is not None:
        return found
    x, t = cfg.extraction, cfg.target
    meta = {"cache_key": key, "layer_ids": t.layer_ids, "layer_convention": t.layer_convention,
            "capture_ids": t.capture_ids(), "target_checkpoint": str(t.checkpoint),
            "target_revision": t.revision, "patch_version": patch_version,
            "backend": cfg.server.backend}
    manifest = extract.extract_shard(
        plan, x.output_dir, server_url=cfg.server.url, dump_dir=cfg.server.dump_dir,
        capture_ids=t.capture_ids(), dtype=x.dtype, concurrency=x.concurrency,
        request_timeout_s=x.request_timeout_s, record_timeout_s=x.record_timeout_s, meta=meta)
    get_run_logger().info("%s: %d sequences, %d tokens, %.1f MB in %.1fs", plan.name,
                          manifest["num_samples"], manifest["num_tokens"], manifest["bytes"] / 1e6,
                          manifest["seconds"])
    return manifest
