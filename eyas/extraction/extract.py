"""Extraction of one shard: send its sequences through the server(s), collect the dumps, write the
shard.

    check = check_shard(out_dir, plan, cache_key)          # intact | missing | damaged | stale
    with ServerPool([Endpoint(url, dump_dir, 4)], request_timeout_s=300) as pool:
        manifest = extract_shard(plan, out_dir, pool=pool, capture_ids=[2, 4, 5], dtype="bfloat16",
                                 meta={"cache_key": cache_key, ...}, on_progress=print)

Each sequence is one /generate request with its own rid and max_new_tokens=1 (the prefill is what
we want), sent through a ServerPool (eyas.extraction.client: async, bounded in flight per server,
retried with backoff on transient errors). The server's hook writes one dump record per prefill
chunk before it answers; the collector then reads them (from this machine, or through the server's
host when its dump folder is not visible here: eyas.extraction.records), checks the chunks against
the ids we sent (eyas.dump.validate: coverage without gap or overlap, token ids, shapes, finite
values, the captured layers) and writes them chunk by chunk into their place in the shard file, a
few sequences at a time (`collect_workers`), so memory stays bounded by those sequences. A shard
that fails leaves no file behind; a shard on disk is reused only if check_shard finds it intact:
its bytes match its manifest, and its manifest this plan and cache key.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch

from eyas.dump import DTYPES, DumpError, validate
from eyas.errors import EyasError, InvalidInput
from eyas.extraction.client import (
    Endpoint,
    Follower,
    RequestFailed,
    ServerPool,
    attempt_rids,
    is_follower,
    naming_the_cause,
)
from eyas.extraction.data import ShardPlan, plan_file_hash, read_shard_plan
from eyas.extraction.records import DumpStore
from eyas.extraction.shards import (
    ShardError,
    ShardWriter,
    bytes_per_token,
    partial_path,
    verify_shard,
)
from eyas.layers import to_capture_before
from eyas.server.hosts import HostError

SAMPLING = {"max_new_tokens": 1, "temperature": 0}


class ExtractionError(EyasError, RuntimeError):
    """A shard could not be extracted; names the shard and the sequence."""

    retryable = True  # a sequence whose records did not come may come on the next try


class ShardStopped(ExtractionError, Follower):
    """A shard given up with the pool's other requests; another shard's error names why."""

    retryable = False


@dataclass
class ShardProgress:
    shard: str
    samples_done: int
    num_samples: int
    tokens_done: int
    num_tokens: int
    bytes_done: int  # estimated from the tokens written
    seconds: float


def shard_path(out_dir: str | Path, plan: ShardPlan) -> Path:
    return Path(out_dir) / f"{plan.name}.safetensors"


def shard_cache_key(
    plan: ShardPlan,
    *,
    target_checkpoint: str,
    target_revision: str | None,
    capture_ids: list[int],
    dtype: str,
    patch_version: str,
    encoding: str = "plain",
) -> str:
    """What a shard's content depends on: its sequences, the target, the layers, dtype, the hook."""
    parts = [
        plan.content_hash,
        target_checkpoint,
        str(target_revision),
        ",".join(map(str, capture_ids)),
        dtype,
        patch_version,
        "eyas-shard/1",
    ]
    if encoding != "plain":
        parts.append(encoding)  # plain keys stay what they were before encodings existed
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


@dataclass(frozen=True)
class ShardCheck:
    """What is on disk for one planned shard, read once: intact (with its manifest), or missing,
    damaged or stale (made from other inputs), with why."""

    state: Literal["intact", "missing", "damaged", "stale"]
    reason: str = ""
    manifest: dict[str, Any] | None = None

    @property
    def intact(self) -> bool:
        return self.state == "intact"


def check_shard(out_dir: str | Path, plan: ShardPlan, cache_key: str) -> ShardCheck:
    """The one check of a shard on disk: its file against its manifest (every byte hashed), and the
    manifest against this plan and cache key."""
    path = shard_path(out_dir, plan)
    if not path.exists():
        return ShardCheck("missing", "missing")
    try:
        manifest = verify_shard(path, full=True)
    except FileNotFoundError:
        return ShardCheck("missing", "missing")
    except (ValueError, OSError, KeyError) as e:
        return ShardCheck("damaged", f"damaged: {type(e).__name__}: {e}")
    if (
        manifest.get("cache_key") != cache_key
        or manifest.get("content_hash", plan.content_hash) != plan.content_hash
    ):
        return ShardCheck(
            "stale",
            "from other inputs (its cache key or plan differs: another target, layers, dtype or "
            "data)",
        )
    return ShardCheck("intact", manifest=manifest)


class _Cancelled(Exception):
    pass


def extract_shard(
    plan: ShardPlan,
    out_dir: str | Path,
    *,
    capture_ids: list[int],
    dtype: str,
    meta: dict[str, Any],
    pool: ServerPool | None = None,
    encoding: str = "plain",
    record_timeout_s: float = 60.0,
    collect_workers: int = 2,
    on_progress: Callable[[ShardProgress], None] | None = None,
    server_url: str | None = None,
    dump_dir: str | Path | None = None,
    concurrency: int = 4,
    request_timeout_s: float = 300.0,
    retries: int = 2,
    backoff_s: float = 1.0,
) -> dict[str, Any]:
    """Extract one planned shard into out_dir; returns its manifest.

    Give a shared `pool`, or `server_url` + `dump_dir` for a one-server pool made for this call.
    """
    if pool is None:
        if server_url is None or dump_dir is None:
            raise InvalidInput("extract_shard needs a pool, or server_url and dump_dir")
        with ServerPool(
            [Endpoint(server_url, Path(dump_dir), concurrency)],
            request_timeout_s=request_timeout_s,
            retries=retries,
            backoff_s=backoff_s,
        ) as own:
            return extract_shard(
                plan,
                out_dir,
                capture_ids=capture_ids,
                dtype=dtype,
                meta=meta,
                pool=own,
                encoding=encoding,
                record_timeout_s=record_timeout_s,
                collect_workers=collect_workers,
                on_progress=on_progress,
            )
    if plan_file_hash(plan.path) != plan.content_hash:
        raise ExtractionError(
            f"{plan.name}: plan file {plan.path} changed since it was planned "
            f"(content hash differs); run the prepare stage again"
        )
    job = _ShardJob(
        plan, out_dir, pool, capture_ids, dtype, encoding, meta, record_timeout_s, collect_workers
    )
    window = pool.capacity + collect_workers  # keep every server busy while a few are collected
    return job.run(window, on_progress)


class _ShardJob:
    """One shard's sequences, each sent through the pool and its records written as they come."""

    def __init__(
        self,
        plan: ShardPlan,
        out_dir,
        pool: ServerPool,
        capture_ids: list[int],
        dtype: str,
        encoding: str,
        meta: dict[str, Any],
        record_timeout_s: float,
        collect_workers: int,
    ):
        self.plan, self.pool, self.capture_ids, self.dtype, self.encoding = (
            plan,
            pool,
            capture_ids,
            dtype,
            encoding,
        )
        self.meta, self.record_timeout_s = meta, record_timeout_s
        self.samples = read_shard_plan(plan.path)
        self.path = shard_path(out_dir, plan)
        partial_path(self.path).unlink(missing_ok=True)  # a killed attempt's leftover
        self.nonce = uuid.uuid4().hex[:8]  # a retry never reads records left by an earlier attempt
        self.writer: ShardWriter | None = None
        self.norm = None
        self.writer_lock, self.cancel = threading.Lock(), threading.Event()
        self.collect = threading.Semaphore(collect_workers)
        self.sent: list[concurrent.futures.Future] = []  # every sequence's request, in order
        self.t0 = time.monotonic()

    def writer_for(self, got_meta: dict, hidden: int) -> ShardWriter:
        """The shard's writer, made from the first reply's shape; every later reply must agree."""
        with self.writer_lock:
            if self.writer is None:
                self.norm = got_meta["last_hidden_norm"]
                plan = self.plan
                self.writer = ShardWriter(
                    self.path,
                    [len(s.input_ids) for s in self.samples],
                    hidden_size=hidden,
                    num_aux=len(self.capture_ids),
                    dtype=DTYPES[self.dtype],
                    encoding=self.encoding,
                    meta={
                        **self.meta,
                        "shard_index": plan.index,
                        "num_shards": plan.num_shards,
                        "content_hash": plan.content_hash,
                        "last_hidden_norm": self.norm,
                    },
                )
            elif got_meta["last_hidden_norm"] != self.norm:
                raise ExtractionError(
                    f"{self.plan.name}: the server's last_hidden_norm changed from "
                    f"{self.norm!r} to {got_meta['last_hidden_norm']!r} within the shard"
                )
            return self.writer

    def wait_reply(self, fut: concurrent.futures.Future):
        while True:
            try:
                return fut.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                if self.cancel.is_set():
                    fut.cancel()
                    raise _Cancelled() from None

    def one(self, i: int) -> int:
        """Sequence i: asked, its records collected, checked and written -> its token count."""
        s = self.samples[i]
        rid = f"eyas-{self.plan.name}-{i:06d}-{self.nonce}"
        where = f"{self.plan.name} sequence {i} (rid {rid})"
        try:
            reply = self.wait_reply(self.pool.generate(s.input_ids, rid, SAMPLING))
            with self.collect:
                if self.cancel.is_set():
                    raise _Cancelled()
                records = _wait_records(
                    reply.endpoint.records, reply.rid, len(s.input_ids), self.record_timeout_s
                )
                got = validate(records, s.input_ids)
                captured = _capture_ids(got)
                if captured != list(self.capture_ids):
                    raise ExtractionError(
                        f"{where}: server {reply.endpoint.url} captured layers {captured} "
                        f"({got.get('layer_convention')}), config expects capture-before "
                        f"{list(self.capture_ids)}"
                    )
                w = self.writer_for(got, got["hidden_size"])
                mask = torch.tensor(s.loss_mask, dtype=torch.bool)
                for rec in records:
                    a, n = rec.prefix_offset, rec.token_ids.shape[0]
                    w.put_rows(
                        i,
                        a,
                        rec.token_ids,
                        mask[a : a + n],
                        rec.aux_hidden_states,
                        rec.last_hidden_state,
                    )
                del records
        except RequestFailed as e:
            raise (ShardStopped if is_follower(e) else ExtractionError)(f"{where}: {e}") from e
        except (DumpError, ShardError) as e:
            raise ExtractionError(f"{where} from {reply.endpoint.url}: {e}") from e
        except HostError as e:
            raise ExtractionError(
                f"{where}: reading its records in {reply.endpoint.records.where}: {e}"
            ) from e
        finally:
            for ep in self.pool.endpoints:
                ep.records.remove(attempt_rids(rid, self.pool.retries))
        return len(s.input_ids)

    def send_all(self, ex: concurrent.futures.Executor, window: int, on_progress) -> None:
        """Every sequence, at most `window` in flight; on_progress each time some have finished."""
        per_token = None
        done = tokens = 0
        samples = self.samples
        num_tokens = sum(len(s.input_ids) for s in samples)
        pending, nxt = set(), 0
        while nxt < len(samples) or pending:
            while nxt < len(samples) and len(pending) < window:
                future = ex.submit(self.one, nxt)
                pending.add(future)
                self.sent.append(future)
                nxt += 1
            finished, pending = concurrent.futures.wait(
                pending, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for f in finished:
                tokens += f.result()
                done += 1
            if on_progress:
                w = self.writer
                per_token = per_token or bytes_per_token(
                    w.hidden_size, w.num_aux, self.dtype, self.encoding
                )
                on_progress(
                    ShardProgress(
                        self.plan.name,
                        done,
                        len(samples),
                        tokens,
                        num_tokens,
                        tokens * per_token,
                        time.monotonic() - self.t0,
                    )
                )

    def run(self, window: int, on_progress) -> dict[str, Any]:
        """The shard written -> its manifest; on any failure the sequences in flight are stopped
        and no file is left behind."""
        ex = concurrent.futures.ThreadPoolExecutor(
            window, thread_name_prefix=f"eyas-{self.plan.name}"
        )
        try:
            self.send_all(ex, window, on_progress)
        except BaseException as error:
            # a stalled pool fails every request in flight at once: after a follower, the sequences
            # in flight end with their own errors first, so the one naming the stall is not hidden
            # behind a cancel
            if not is_follower(error):
                self.cancel.set()
            ex.shutdown(wait=True, cancel_futures=True)
            self.cancel.set()
            if self.writer is not None:
                self.writer.abort()
            # a stall fails every sequence in flight: the shard fails with the one naming it
            cause = naming_the_cause(error, (f.exception() for f in self.sent if _failed(f)))
            if cause is error:
                raise
            raise cause from cause.__cause__  # its own chain, not the follower it was raised beside
        ex.shutdown(wait=True)
        return self.writer.close({"seconds": round(time.monotonic() - self.t0, 3)})


def _failed(future: concurrent.futures.Future) -> bool:
    return future.done() and not future.cancelled() and future.exception() is not None


def _wait_records(store: DumpStore, rid: str, num_tokens: int, timeout: float):
    """Wait briefly for the records (a network filesystem may lag), then return them sorted."""
    deadline = time.monotonic() + timeout
    have: dict = {}  # records already fetched through a host are not fetched again
    while True:
        records = store.read(rid, have)
        covered = sum(r.token_ids.shape[0] for r in records)
        if covered >= num_tokens or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _capture_ids(meta: dict) -> list[int]:
    return to_capture_before(meta["layer_ids"], meta["layer_convention"])
