"""Prefect tasks: prepare the data (and the output dir), extract one shard per task, with progress."""

from __future__ import annotations

import atexit
import logging
import re
import threading
import time
from functools import partial
from pathlib import Path

from prefect import task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.logging import get_logger, get_run_logger

from eyas import __version__

from eyas.extraction import data, dataset, extract, locks as resume
from eyas.extraction.client import Endpoint, ServerPool
from eyas.config import PipelineConfig
from eyas.extraction.data import ShardPlan
from eyas.server.hosts import make_host
from eyas.server.launch import server_alive
from eyas.target import load_tokenizer


def _logger():
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a run context (cache-key function, callbacks)
        return get_logger("eyas.extraction.extract")


# ---------------------------------------------------------------------------------------------
# Progress: one ExtractionRun per output dir in this process, published as artifacts and log lines
# ---------------------------------------------------------------------------------------------

_runs: dict[str, dataset.ExtractionRun] = {}
_runs_lock = threading.Lock()
PUBLISH_EVERY_S = 2.0  # progress artifact and log line, at most this often while shards run
TABLE_EVERY_S = 30.0  # a new version of the shard table (500 rows in production), at most this often


class _Publisher:
    """Turns ExtractionRun updates into a progress artifact, a table artifact and log lines."""

    def __init__(self, name: str):
        slug = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-") or "run"
        self.progress_key, self.table_key = f"extract-{slug}", f"extract-shards-{slug}"
        self.artifact_id = None
        self.last = self.last_table = 0.0
        self.lock = threading.Lock()
        self.warned = False

    def __call__(self, run: dataset.ExtractionRun, event: str) -> None:
        now = time.monotonic()
        with self.lock:
            if event == "progress" and now - self.last < PUBLISH_EVERY_S:
                return
            self.last = now
            table = event == "complete" or (event == "shard" and now - self.last_table >= TABLE_EVERY_S)
            if table:
                self.last_table = now
        figures, text = run.figures(), run.describe()
        _logger().info("extraction: %s", text)
        try:
            with self.lock:
                if self.artifact_id is None:
                    self.artifact_id = create_progress_artifact(
                        progress=figures["percent"], key=self.progress_key, description=text)
                else:
                    update_progress_artifact(artifact_id=self.artifact_id, progress=figures["percent"],
                                             description=text)
            if table:
                create_table_artifact(table=run.table(), key=self.table_key,
                                      description=f"extraction shards: {text}")
        except Exception as e:  # noqa: BLE001 - the UI is a view; extraction goes on without it
            if not self.warned:
                self.warned = True
                _logger().warning("extraction progress artifacts unavailable (%s: %s)", type(e).__name__, e)


def _register_run(cfg: PipelineConfig, plans: list[ShardPlan], plan_info: dict) -> dataset.ExtractionRun:
    run = dataset.ExtractionRun(cfg.extraction.output_dir, plans, plan_info=plan_info,
                                on_change=_Publisher(cfg.name))
    with _runs_lock:
        _runs[str(Path(cfg.extraction.output_dir).resolve())] = run
    return run


def _run_for(cfg: PipelineConfig, plan: ShardPlan) -> dataset.ExtractionRun:
    """This process's run for the output dir; rebuilt from plan.json when prepare ran elsewhere."""
    key = str(Path(cfg.extraction.output_dir).resolve())
    with _runs_lock:
        run = _runs.get(key)
    if run is not None and plan.name in run.plans and run.plans[plan.name].content_hash == plan.content_hash:
        return run
    index = data.read_plan_index(Path(plan.path).parent)
    plans = [ShardPlan(s["index"], len(index["shards"]), Path(s["path"]), s["content_hash"], s["num_sequences"],
                       s["num_tokens"], index.get("provenance", {})) for s in index["shards"]]
    return _register_run(cfg, plans, index)


# ---------------------------------------------------------------------------------------------
# Servers: one pool per process and endpoint set, so the in-flight bound holds across shard tasks
# ---------------------------------------------------------------------------------------------

_pools: dict[tuple, ServerPool] = {}
_pools_lock = threading.Lock()


@atexit.register
def _close_pools() -> None:
    with _pools_lock:
        for pool in _pools.values():
            pool.close()
        _pools.clear()


def endpoints(cfg: PipelineConfig) -> list[Endpoint]:
    """The launched server (dropped at once if its process dies) plus extraction.endpoints."""
    x = cfg.extraction
    return [Endpoint(cfg.server.url, cfg.server.dump_dir, x.concurrency, alive=partial(server_alive, cfg))] + [
        Endpoint(e.url, e.dump_dir, e.concurrency or x.concurrency) for e in x.endpoints]


def _pool_for(cfg: PipelineConfig) -> ServerPool:
    x = cfg.extraction
    key = (tuple(endpoints(cfg)), x.request_timeout_s, x.request_retries, x.retry_backoff_s)
    with _pools_lock:
        if key not in _pools:
            _pools[key] = ServerPool(endpoints(cfg), request_timeout_s=x.request_timeout_s,
                                     retries=x.request_retries, backoff_s=x.retry_backoff_s)
        return _pools[key]


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------

def _take_output_dir(cfg: PipelineConfig, logger) -> None:
    """One run per output dir. Holding its lock proves a killed run's partial files and server are
    stale: discard the files, stop that server (only if it runs this config's command)."""
    out = Path(cfg.extraction.output_dir)
    resume.lock_output_dir(out)
    removed = resume.discard_partials(out)
    if removed:
        logger.info("discarded %d partial file(s) of a killed run: %s", len(removed), removed[:10])
    host = make_host(cfg.server.host)
    try:
        reclaimed = resume.reclaim_stale_server(host, cfg)
    finally:
        host.close()
    if reclaimed:
        logger.warning("server recorded in %s: %s", cfg.server.pid_path, reclaimed)


@task(task_run_name="prepare-data", cache_policy=NO_CACHE)
def prepare_data(cfg: PipelineConfig, data_path: str | None = None,
                 take_output_dir: bool = True) -> tuple[list[ShardPlan], list[list[int]], dict]:
    """Take the output dir, clean a killed run's leftovers, tokenize, plan the shards, check disk space.

    `data_path` replaces data.path (the regenerated conversations, say). `take_output_dir=False`
    when this run took it already: its own server, launched since, must not be taken for stale.
    """
    logger, x, out = _logger(), cfg.extraction, Path(cfg.extraction.output_dir)
    source = Path(data_path or cfg.data.path)
    if take_output_dir:
        _take_output_dir(cfg, logger)
    # Tokenize and check every line (ids against the target's vocabulary).
    folder = cfg.data.tokenizer or cfg.target.checkpoint
    hidden, vocab = dataset.target_dims(folder, cfg.target.checkpoint)
    tokenizer = load_tokenizer(folder)
    records, skipped = data.load_records(source, vocab_size=vocab, bad_lines=cfg.data.bad_lines)
    prepared = data.prepare(records, tokenizer, cfg.data.model_copy(update={"path": source}), vocab_size=vocab,
                            skipped=skipped)
    provenance = {**data.tokenizer_hashes(tokenizer, folder), "eyas_version": __version__}
    info = {"provenance": provenance, "data_path": str(source), "data_sha256": data.sha256_file(source),
            "stats": prepared.stats}
    plans = data.write_shard_plans(prepared.train, x.num_shards, out / "plan", info=info)
    # Refuse now, before a long server load, if the shards cannot fit.
    needed = dataset.estimate_bytes(plans, hidden, len(cfg.target.layer_ids), x.dtype, x.encoding, out)
    space = dataset.check_disk_space(out, needed, keep_free_gb=x.keep_free_gb)
    _register_run(cfg, plans, info)
    logger.info("prepared %s; shards need %.3f GB more, %.1f GB free", {k: v for k, v in prepared.stats.items()
                if k != "skipped_lines"}, needed / 1e9, space["free_bytes"] / 1e9)
    for line in prepared.stats["skipped_lines"][:10]:
        logger.warning("skipped %s", line)
    return plans, prepared.heldout_prompts, prepared.stats


def _regeneration_inputs(cfg: PipelineConfig):
    """(training records, held-out records, tokenizer, output dir, target, skipped lines) of the regeneration."""
    folder = cfg.data.tokenizer or cfg.target.checkpoint
    _, vocab = dataset.target_dims(folder, cfg.target.checkpoint)
    tokenizer = load_tokenizer(folder)
    records, skipped = data.load_records(cfg.data.path, vocab_size=vocab, bad_lines=cfg.data.bad_lines)
    num_heldout = min(cfg.data.num_heldout, len(records) - 1)  # evaluation prompts: kept as they are
    train, heldout = records[: len(records) - num_heldout], records[len(records) - num_heldout:]
    out_dir = cfg.data.regenerate.output_dir or Path(cfg.extraction.output_dir) / "regenerated"
    return train, heldout, tokenizer, Path(out_dir), f"{cfg.target.checkpoint}@{cfg.target.revision}", skipped


def regeneration_pending(cfg: PipelineConfig) -> list[int]:
    """Parts of the regeneration still to ask the target for; [] = regenerated.jsonl needs no server."""
    from eyas.extraction.regenerate import pending_parts

    train, _, tokenizer, out_dir, target, _ = _regeneration_inputs(cfg)
    return pending_parts(train, tokenizer, out_dir, cfg.data.regenerate, target=target,
                         max_length=cfg.data.max_length)


@task(task_run_name="regenerate-data@{cfg.server.host.name}", cache_policy=NO_CACHE)
def regenerate_data(cfg: PipelineConfig) -> str:
    """Answer the training conversations again with the target (resumable by part); returns the new file."""
    from eyas.extraction.regenerate import regenerate

    logger = _logger()
    train, heldout, tokenizer, out_dir, target, skipped = _regeneration_inputs(cfg)
    for line in skipped[:10]:
        logger.warning("skipped %s", line)

    def on_part(k: int, n: int, m: dict) -> None:
        state = "reused" if m.get("reused") else f"{m['seconds']:.1f}s"
        logger.info("regenerate part %d/%d: %d conversations, %d turns answered by the target (%s)",
                    k + 1, n, m["conversations"], m["regenerated_turns"], state)

    path, summary = regenerate(train, tokenizer, _pool_for(cfg), out_dir, cfg.data.regenerate,
                               max_length=cfg.data.max_length, target=target, passthrough=heldout,
                               on_part=on_part)
    logger.info("regenerated %s", {k: v for k, v in summary.items() if k != "params"})
    return str(path)


def _key(cfg: PipelineConfig, plan: ShardPlan, patch_version: str) -> str:
    return extract.shard_cache_key(plan, target_checkpoint=str(cfg.target.checkpoint),
                                   target_revision=cfg.target.revision,
                                   capture_ids=cfg.target.capture_ids(),
                                   dtype=cfg.extraction.dtype, patch_version=patch_version,
                                   encoding=cfg.extraction.encoding)


def shard_intact(cfg: PipelineConfig, plan: ShardPlan, patch_version: str) -> bool:
    """The shard's file is on disk, matches its manifest, and was made from these exact inputs."""
    return extract.existing_shard(cfg.extraction.output_dir, plan, _key(cfg, plan, patch_version)) is not None


def shards_intact(cfg: PipelineConfig, plans: list[ShardPlan], patch_version: str) -> dict[str, bool]:
    """shard_intact for every plan, hashed side by side (a re-run at scale reads every shard once;
    the sha256 is remembered, so the cache-key function's check of the same file is then free)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(1, min(8, len(plans))), thread_name_prefix="eyas-verify") as ex:
        return dict(zip([p.name for p in plans], ex.map(lambda p: shard_intact(cfg, p, patch_version), plans)))


def _shard_cache_key(context, parameters) -> str:
    """What the shard depends on: its content hash, the target, layers, dtype, encoding, patch."""
    cfg, plan = parameters["cfg"], parameters["plan"]
    key = _key(cfg, plan, parameters["patch_version"])
    found = extract.existing_shard(cfg.extraction.output_dir, plan, key)
    if found is not None:
        _run_for(cfg, plan).shard_done(plan, found, reused=True)  # a cache hit never runs the task body
    return key


def extract_shard_for(cfg: PipelineConfig, plan: ShardPlan, patch_version: str):
    """The shard's task, checked on disk before the cache is trusted.

    Intact: Prefect's record under the shard's key is used (state Cached). Missing or damaged: the
    record is refreshed (recomputed and stored again under the same key, so the next run hits it;
    a one-off "miss" key would leave nothing a later run could find).
    """
    return extract_shard.with_options(refresh_cache=not shard_intact(cfg, plan, patch_version))


def shard_meta(cfg: PipelineConfig, plan: ShardPlan, patch_version: str) -> dict:
    """Provenance written into the shard's header and manifest."""
    t = cfg.target
    capture = t.capture_ids()
    return {"layer_ids": t.layer_ids, "layer_convention": t.layer_convention, "capture_ids": capture,
            "layer_ids_capture_before": capture, "layer_ids_output_of": [i - 1 for i in capture],
            "target_checkpoint": str(t.checkpoint), "target_revision": t.revision,
            "patch_version": patch_version, "backend": cfg.server.backend, "eyas_version": __version__,
            "tokenizer_sha256": plan.provenance.get("tokenizer_sha256"),
            "chat_template_sha256": plan.provenance.get("chat_template_sha256")}


@task(task_run_name="extract-{plan.name}-of-{plan.num_shards:05d}@{cfg.server.host.name}",
      cache_key_fn=_shard_cache_key, persist_result=True, retries=2,
      retry_delay_seconds=[5, 30])
def extract_shard(cfg: PipelineConfig, plan: ShardPlan, patch_version: str) -> dict:
    """Extract one shard (or reuse an intact one); returns its manifest, never tensors.

    Submit it through `extract_shard_for`, which refreshes the cache when the file is not intact.
    """
    x, run = cfg.extraction, _run_for(cfg, plan)

    def on_progress(p: extract.ShardProgress) -> None:
        run.shard_progress(p.shard, p.tokens_done, p.bytes_done, p.samples_done)

    if extract.existing_shard(x.output_dir, plan, _key(cfg, plan, patch_version)) is None:
        run.shard_started(plan.name)
    try:
        manifest, reused = extract.ensure_shard(
            plan, x.output_dir, _key(cfg, plan, patch_version), pool=_pool_for(cfg),
            capture_ids=cfg.target.capture_ids(), dtype=x.dtype, encoding=x.encoding,
            meta=shard_meta(cfg, plan, patch_version), record_timeout_s=x.record_timeout_s,
            collect_workers=x.collect_workers, on_progress=on_progress)
    except Exception as e:
        run.shard_failed(plan.name, f"{type(e).__name__}: {e}")
        raise
    logger = get_run_logger()
    if reused:
        logger.info("%s: intact on disk, reused (%d sequences, %d tokens)", plan.name,
                    manifest["num_samples"], manifest["num_tokens"])
    else:
        logger.info("%s: %d sequences, %d tokens, %.1f MB in %.1fs (%.0f tok/s)", plan.name,
                    manifest["num_samples"], manifest["num_tokens"], manifest["bytes"] / 1e6,
                    manifest["seconds"], manifest["num_tokens"] / max(manifest["seconds"], 1e-9))
    complete = run.shard_done(plan, manifest, reused=reused)
    if complete is not None:
        logger.info("dataset complete: %s (%d shards, %d tokens, %.3f GB)", dataset.dataset_path(x.output_dir),
                    complete["num_shards"], complete["num_tokens"], complete["bytes"] / 1e9)
    return manifest


logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
