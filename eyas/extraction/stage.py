"""The extraction stage as the tasks run it: one config in, plans, regenerated data and shards out.

    # one per extraction, handed to every step
    with ExtractionContext(publisher_for=publisher) as ctx:
        prepared = prepare(ctx, cfg, log=print)            # lock, clean, tokenize, plan, disk check
        path = regenerate_replies(ctx, cfg, log=print)      # optional: the target answers again
        manifest = run_shard(ctx, cfg, plan, patch_version, log=print)

Prefect-free. What lives for the length of an extraction is kept in its ExtractionContext, per
output dir and endpoint set: the ExtractionRun whose figures the caller publishes, and the server
pools, so the bound on requests in flight holds across shard tasks running in threads.
"""

from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

from eyas import __version__
from eyas.config import PipelineConfig
from eyas.extraction import data, dataset, extract, locks
from eyas.extraction.client import Endpoint, ServerPool
from eyas.extraction.data import ShardPlan
from eyas.extraction.progress import ExtractionRun
from eyas.extraction.shards import ShardManifest
from eyas.files import sha256_file
from eyas.layers import to_output_of
from eyas.server.hosts import make_host
from eyas.server.launch import auth_headers, capture_launch, server_alive
from eyas.target import load_tokenizer, local_copy, target_dims, trust_remote_code

Log = Callable[..., None]  # log(fmt, *args), as logging.Logger.info takes them


@dataclass(frozen=True)
class Prepared:
    """What prepare-data hands the later stages."""

    plans: list[ShardPlan]  # one per shard, in order
    prompts: list[list[int]]  # held-out prompts (token ids) for evaluation and serving
    stats: dict  # counts: conversations, tokens, skipped lines, truncations


# ---------------------------------------------------------------------------------------------
# One extraction's state: its ExtractionRun per output dir, its server pool per endpoint set
# ---------------------------------------------------------------------------------------------


class ExtractionContext:
    """What the steps of one extraction share, made by the caller and handed to each: the
    ExtractionRun of each output dir (its figures; `publisher_for(run name)` makes the callback that
    publishes them) and one server pool per endpoint set (closed with the context)."""

    def __init__(self, publisher_for: Callable[[str], Callable] | None = None):
        self.publisher_for = (
            publisher_for  # run name -> the on_change callback of its ExtractionRun
        )
        self._runs: dict[str, ExtractionRun] = {}
        self._pools: dict[tuple, ServerPool] = {}
        self._lock = threading.Lock()

    def __enter__(self) -> ExtractionContext:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    def register(
        self, cfg: PipelineConfig, plans: list[ShardPlan], plan_info: dict
    ) -> ExtractionRun:
        on_change = self.publisher_for(cfg.name) if self.publisher_for else None
        run = ExtractionRun(
            cfg.extraction.output_dir, plans, plan_info=plan_info, on_change=on_change
        )
        with self._lock:
            self._runs[_key(cfg)] = run
        return run

    def run_for(self, cfg: PipelineConfig, plan: ShardPlan) -> ExtractionRun:
        """The run of the output dir; rebuilt from the plan index when prepare ran elsewhere."""
        with self._lock:
            run = self._runs.get(_key(cfg))
        if (
            run is not None
            and plan.name in run.plans
            and run.plans[plan.name].content_hash == plan.content_hash
        ):
            return run
        index = data.read_plan_index(Path(plan.path).parent)
        plans = [
            ShardPlan(
                s["index"],
                len(index["shards"]),
                Path(s["path"]),
                s["content_hash"],
                s["num_sequences"],
                s["num_tokens"],
                index.get("provenance", {}),
            )
            for s in index["shards"]
        ]
        return self.register(cfg, plans, index)

    def new_server(self) -> None:
        """The server was relaunched: the next requests go through fresh pools. Until then a pool
        that found its server stalled or gone fails every request at once, sending none."""
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()

    def pool(self, cfg: PipelineConfig) -> ServerPool:
        """The pool of cfg's endpoints, shared by the threads of this extraction."""
        x = cfg.extraction
        headers = auth_headers(cfg.server)
        key = (
            tuple(endpoints(cfg)),
            x.request_timeout_s,
            x.request_retries,
            x.retry_backoff_s,
            x.stall_timeout_s,
            tuple(headers.items()),
        )
        with self._lock:
            if key not in self._pools:
                logging.getLogger("httpx").setLevel(
                    logging.WARNING
                )  # one INFO line per request otherwise
                self._pools[key] = ServerPool(
                    endpoints(cfg),
                    request_timeout_s=x.request_timeout_s,
                    retries=x.request_retries,
                    backoff_s=x.retry_backoff_s,
                    headers=headers,
                    stall_timeout_s=x.stall_timeout_s,
                )
            return self._pools[key]


def _key(cfg: PipelineConfig) -> str:
    return str(Path(cfg.extraction.output_dir).resolve())


def endpoints(cfg: PipelineConfig) -> list[Endpoint]:
    """The launched server (dropped at once if its process dies) plus extraction.endpoints, each
    with the host it dumps on: its records are read here when its dump folder is visible here, else
    through that host (eyas/extraction/records.py), with a connection per collecting worker."""
    x = cfg.extraction
    conns = x.collect_workers + 1  # the workers' reads, and the removals beside them
    return [
        Endpoint(
            cfg.server.url,
            cfg.server.dump_dir,
            x.concurrency,
            alive=partial(server_alive, capture_launch(cfg)),
            dump_host=cfg.server.host,
            dump_connections=conns,
        )
    ] + [
        Endpoint(
            e.url,
            e.dump_dir,
            e.concurrency or x.concurrency,
            dump_host=e.host,
            dump_connections=conns,
            dump_field=f"extraction.endpoints[{i}].host",
        )
        for i, e in enumerate(x.endpoints)
    ]


# ---------------------------------------------------------------------------------------------
# Prepare: the output dir, the data, the shard plans
# ---------------------------------------------------------------------------------------------


def take_output_dir(
    cfg: PipelineConfig, log: Log, holder: str = "", on_reclaim: Callable[[str], None] | None = None
) -> None:
    """One run per output dir. Holding its lock proves a killed run's partial files and server are
    stale: discard the files, stop that server (only if it runs this config's command), and tell
    `on_reclaim` who held the lock last (the killed run: "<pid> flow run <id>"). Another live run
    holding it: OutputBusy, before anything is touched."""
    out = Path(cfg.extraction.output_dir)
    previous = locks.read_holder(out / ".eyas.lock")
    locks.lock_output_dir(out, holder)
    if previous and on_reclaim is not None:
        on_reclaim(previous)
    removed = locks.discard_partials(out)
    if removed:
        log("discarded %d partial file(s) of a killed run: %s", len(removed), removed[:10])
    with make_host(cfg.server.host) as host:
        reclaimed = locks.reclaim_stale_server(host, cfg)
    if reclaimed:
        log("server recorded in %s: %s", cfg.server.pid_path, reclaimed)


def prepare(
    ctx: ExtractionContext,
    cfg: PipelineConfig,
    data_path: str | None = None,
    *,
    take_dir: bool = True,
    log: Log,
    holder: str = "",
    on_reclaim: Callable[[str], None] | None = None,
) -> Prepared:
    """Take the output dir, clean a killed run's leftovers, tokenize, plan the shards, check disk
    space.

    `data_path` replaces data.path (the regenerated conversations, say). `take_dir=False` when this
    run took it already: its own server, launched since, must not be taken for stale. `holder`
    names this run in the lock file (what a second run's OutputBusy reports).
    """
    x, out = cfg.extraction, Path(cfg.extraction.output_dir)
    source = Path(data_path or cfg.data.path)
    if take_dir:
        take_output_dir(cfg, log, holder, on_reclaim)
    # Tokenize and check every line (ids against the target's vocabulary).
    folder = local_copy(cfg.target)
    hidden, vocab = target_dims(folder)
    tokenizer = load_tokenizer(
        folder, trust_remote_code=trust_remote_code(cfg.target, cfg.server.backend)
    )
    records, skipped = data.load_records(source, vocab_size=vocab, bad_lines=cfg.data.bad_lines)
    prepared = data.prepare(
        records,
        tokenizer,
        cfg.data.model_copy(update={"path": source}),
        vocab_size=vocab,
        skipped=skipped,
    )
    regenerated = source.with_name(
        "regenerate.json"
    )  # regenerate()'s summary, beside regenerated.jsonl
    if (
        data_path is not None and regenerated.exists()
    ):  # report.json's `regeneration` (reasoning tokens)
        prepared.stats["regeneration"] = {
            k: v for k, v in json.loads(regenerated.read_text()).items() if k != "params"
        }
    provenance = {**data.tokenizer_hashes(tokenizer, folder), "eyas_version": __version__}
    info = {
        "provenance": provenance,
        "data_path": str(source),
        "data_sha256": sha256_file(source),
        "stats": prepared.stats,
    }
    plans = data.write_shard_plans(prepared.train, x.num_shards, out / "plan", info=info)
    # Refuse now, before a long server load, if the shards cannot fit.
    needed = dataset.estimate_bytes(
        plans, hidden, len(cfg.target.layer_ids), x.dtype, x.encoding, out
    )
    space = dataset.check_disk_space(out, needed, keep_free_gb=x.keep_free_gb)
    ctx.register(cfg, plans, info)
    log(
        "prepared %s; shards need %.3f GB more, %.1f GB free",
        {k: v for k, v in prepared.stats.items() if k not in ("skipped_lines", "regeneration")},
        needed / 1e9,
        space["free_bytes"] / 1e9,
    )
    for line in prepared.stats["skipped_lines"][:10]:
        log("skipped %s", line)
    return Prepared(plans, prepared.heldout_prompts, prepared.stats)


# ---------------------------------------------------------------------------------------------
# Regenerate: the target answers the training conversations again (data.regenerate)
# ---------------------------------------------------------------------------------------------


def _regeneration_inputs(cfg: PipelineConfig):
    """(training records, held-out records, tokenizer, output dir, target, skipped lines)."""
    folder = local_copy(cfg.target)
    _, vocab = target_dims(folder)
    tokenizer = load_tokenizer(
        folder, trust_remote_code=trust_remote_code(cfg.target, cfg.server.backend)
    )
    records, skipped = data.load_records(
        cfg.data.path, vocab_size=vocab, bad_lines=cfg.data.bad_lines
    )
    num_heldout = min(
        cfg.data.num_heldout, len(records) - 1
    )  # evaluation prompts: kept as they are
    train, heldout = records[: len(records) - num_heldout], records[len(records) - num_heldout :]
    out_dir = cfg.data.regenerate.output_dir or Path(cfg.extraction.output_dir) / "regenerated"
    return (
        train,
        heldout,
        tokenizer,
        Path(out_dir),
        f"{cfg.target.checkpoint}@{cfg.target.revision}",
        skipped,
    )


def regeneration_pending(cfg: PipelineConfig) -> list[int]:
    """Parts of the regeneration still to ask the target for; [] = regenerated.jsonl needs no
    server."""
    from eyas.extraction.regenerate import pending_parts

    train, _, tokenizer, out_dir, target, _ = _regeneration_inputs(cfg)
    return pending_parts(
        train,
        tokenizer,
        out_dir,
        cfg.data.regenerate,
        target=target,
        max_length=cfg.data.max_length,
    )


def regenerate_replies(
    ctx: ExtractionContext,
    cfg: PipelineConfig,
    *,
    log: Log,
    on_progress: Callable | None = None,
    warn: Log | None = None,
) -> str:
    """Answer the training conversations again with the target (resumable by part); the new file.

    on_progress gets a RegenerationProgress after every conversation (the caller throttles)."""
    from eyas.extraction.regenerate import regenerate

    train, heldout, tokenizer, out_dir, target, skipped = _regeneration_inputs(cfg)
    for line in skipped[:10]:
        log("skipped %s", line)

    def on_part(k: int, n: int, m: dict) -> None:
        state = "reused" if m.get("reused") else f"{m['seconds']:.1f}s"
        log(
            "regenerate part %d/%d: %d conversations, %d turns answered by the target (%s)",
            k + 1,
            n,
            m["conversations"],
            m["regenerated_turns"],
            state,
        )

    path, summary = regenerate(
        train,
        tokenizer,
        ctx.pool(cfg).calling(warn),
        out_dir,
        cfg.data.regenerate,
        max_length=cfg.data.max_length,
        target=target,
        passthrough=heldout,
        on_part=on_part,
        on_progress=on_progress,
    )
    log("regenerated %s", {k: v for k, v in summary.items() if k != "params"})
    return str(path)


# ---------------------------------------------------------------------------------------------
# Extract: one shard, checked against its inputs on disk
# ---------------------------------------------------------------------------------------------


def shard_key(cfg: PipelineConfig, plan: ShardPlan, patch_version: str) -> str:
    """What the shard depends on: its content hash, the target, layers, dtype, encoding, patch."""
    return extract.shard_cache_key(
        plan,
        target_checkpoint=str(cfg.target.checkpoint),
        target_revision=cfg.target.revision,
        capture_ids=cfg.target.capture_ids(),
        dtype=cfg.extraction.dtype,
        patch_version=patch_version,
        encoding=cfg.extraction.encoding,
    )


def check_shard(cfg: PipelineConfig, plan: ShardPlan, patch_version: str) -> extract.ShardCheck:
    """The shard on disk against this config's inputs (extract.check_shard)."""
    return extract.check_shard(cfg.extraction.output_dir, plan, shard_key(cfg, plan, patch_version))


def check_shards(
    cfg: PipelineConfig, plans: list[ShardPlan], patch_version: str
) -> dict[str, extract.ShardCheck]:
    """check_shard for every plan, hashed side by side (a re-run at scale reads every shard
    once)."""
    with ThreadPoolExecutor(max(1, min(8, len(plans))), thread_name_prefix="eyas-verify") as ex:
        return dict(
            zip(
                [p.name for p in plans], ex.map(lambda p: check_shard(cfg, p, patch_version), plans)
            )
        )


def shard_meta(cfg: PipelineConfig, plan: ShardPlan, patch_version: str) -> dict:
    """Provenance written into the shard's header and manifest."""
    t = cfg.target
    capture = t.capture_ids()
    return {
        "layer_ids": t.layer_ids,
        "layer_convention": t.layer_convention,
        "capture_ids": capture,
        "layer_ids_capture_before": capture,
        "layer_ids_output_of": to_output_of(capture),
        "target_checkpoint": str(t.checkpoint),
        "target_revision": t.revision,
        "patch_version": patch_version,
        "backend": cfg.server.backend,
        "eyas_version": __version__,
        "tokenizer_sha256": plan.provenance.get("tokenizer_sha256"),
        "chat_template_sha256": plan.provenance.get("chat_template_sha256"),
    }


def run_shard(
    ctx: ExtractionContext,
    cfg: PipelineConfig,
    plan: ShardPlan,
    patch_version: str,
    *,
    log: Log,
    warn: Log | None = None,
    check: extract.ShardCheck | None = None,
) -> ShardManifest:
    """Reuse the shard where `check` (made now when not given) found it intact, else extract it,
    feeding the run's figures; returns its manifest."""
    run = ctx.run_for(cfg, plan)
    check = check or check_shard(cfg, plan, patch_version)
    reused = check.intact
    if reused:
        manifest = check.manifest
        log(
            "%s: intact on disk, reused (%d sequences, %d tokens)",
            plan.name,
            manifest["num_samples"],
            manifest["num_tokens"],
        )
    else:
        if check.state != "missing":  # a shard on disk that cannot be reused: say why it is redone
            log("%s on disk is %s: extracting it again", plan.name, check.reason[:300])
        manifest = _extract(ctx, cfg, plan, patch_version, run, warn)
        log(
            "%s: %d sequences, %d tokens, %.1f MB in %.1fs (%.0f tok/s)",
            plan.name,
            manifest["num_samples"],
            manifest["num_tokens"],
            manifest["bytes"] / 1e6,
            manifest["seconds"],
            manifest["num_tokens"] / max(manifest["seconds"], 1e-9),
        )
    shard = ShardManifest.from_json(manifest, reused=reused)
    shard_finished(ctx, cfg, plan, shard, log=log)
    return shard


def _extract(
    ctx: ExtractionContext,
    cfg: PipelineConfig,
    plan: ShardPlan,
    patch_version: str,
    run,
    warn: Log | None,
) -> dict:
    """The shard extracted through the context's server pool, its progress fed to the run."""
    x = cfg.extraction

    def on_progress(p: extract.ShardProgress) -> None:
        run.shard_progress(p.shard, p.tokens_done, p.bytes_done, p.samples_done)

    run.shard_started(plan.name)
    try:
        return extract.extract_shard(
            plan,
            x.output_dir,
            pool=ctx.pool(cfg).calling(warn),
            capture_ids=cfg.target.capture_ids(),
            dtype=x.dtype,
            encoding=x.encoding,
            meta={
                **shard_meta(cfg, plan, patch_version),
                "cache_key": shard_key(cfg, plan, patch_version),
            },
            record_timeout_s=x.record_timeout_s,
            collect_workers=x.collect_workers,
            on_progress=on_progress,
        )
    except Exception as e:
        run.shard_failed(plan.name, f"{type(e).__name__}: {e}")
        raise


def shard_finished(
    ctx: ExtractionContext, cfg: PipelineConfig, plan: ShardPlan, shard: ShardManifest, *, log: Log
) -> None:
    """Count a shard as done (also one Prefect answered from its cache, which runs no task body)."""
    complete = ctx.run_for(cfg, plan).shard_done(plan, shard.to_json(), reused=shard.reused)
    if complete is not None:
        log(
            "dataset complete: %s (%d shards, %d tokens, %.3f GB)",
            dataset.dataset_path(cfg.extraction.output_dir),
            complete["num_shards"],
            complete["num_tokens"],
            complete["bytes"] / 1e9,
        )
