"""Extraction of one shard: send its sequences through the server, collect the dumps, write the shard.

    manifest = extract_shard(plan, out_dir, server_url=..., dump_dir=..., meta=..., ...)

Each sequence is one /generate request with its own rid and max_new_tokens=1 (the prefill is what
we want). The server's hook writes one dump record per prefill chunk before it answers; the
collector then reassembles the chunks, checks them against the ids we sent (eyas.dump.assemble),
and streams the sample into the shard file. A shard that fails leaves no file behind.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable

import httpx
import torch

from eyas.data import ShardPlan, read_shard_plan
from eyas.dump import assemble, read_records, remove_records
from eyas.shards import DTYPES, Sample, ShardWriter, manifest_path, verify_shard


class ExtractionError(RuntimeError):
    """A shard could not be extracted; names the shard and the sequence."""


def shard_path(out_dir: str | Path, plan: ShardPlan) -> Path:
    return Path(out_dir) / f"{plan.name}.safetensors"


def existing_shard(out_dir: str | Path, plan: ShardPlan, cache_key: str) -> dict[str, Any] | None:
    """The manifest of an already extracted, intact shard for this exact key, else None."""
    path = shard_path(out_dir, plan)
    if not manifest_path(path).exists():
        return None
    try:
        manifest = verify_shard(path)
    except (ValueError, OSError):
        return None
    return manifest if manifest.get("cache_key") == cache_key else None


def _request(client: httpx.Client, url: str, ids: list[int], rid: str, timeout: float) -> dict:
    body = {"input_ids": ids, "rid": rid, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    r = client.post(f"{url}/generate", json=body, timeout=timeout)
    if r.status_code != 200:
        raise ExtractionError(f"server answered {r.status_code} for rid {rid}: {r.text[:500]}")
    return r.json()


def _collect(dump_dir: Path, rid: str, ids: list[int], timeout: float):
    """Wait briefly for the records (a network filesystem may lag), then reassemble them."""
    deadline = time.monotonic() + timeout
    while True:
        records = read_records(dump_dir, rid)
        covered = sum(r.token_ids.shape[0] for r in records)
        if covered >= len(ids) or time.monotonic() > deadline:
            return assemble(records, ids)
        time.sleep(0.05)


def extract_shard(plan: ShardPlan, out_dir: str | Path, *, server_url: str, dump_dir: str | Path,
                  capture_ids: list[int], dtype: str, concurrency: int, request_timeout_s: float,
                  record_timeout_s: float, meta: dict[str, Any],
                  on_sample: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Extract one planned shard into out_dir; returns its manifest."""
    samples = read_shard_plan(plan.path)
    dump_dir, path = Path(dump_dir), shard_path(out_dir, plan)
    nonce = uuid.uuid4().hex[:8]  # a retry never reads records left by an earlier attempt
    writer: ShardWriter | None = None
    t0 = time.monotonic()

    def one(i: int) -> tuple[int, Sample, dict]:
        s = samples[i]
        rid = f"eyas-{plan.name}-{i:06d}-{nonce}"
        try:
            _request(client, server_url, s.input_ids, rid, request_timeout_s)
            got = _collect(dump_dir, rid, s.input_ids, record_timeout_s)
        except (httpx.HTTPError, ValueError) as e:
            raise ExtractionError(f"{plan.name} sequence {i} (rid {rid}): {e}") from e
        finally:
            remove_records(dump_dir, rid)
        return i, Sample(torch.tensor(s.input_ids), torch.tensor(s.loss_mask, dtype=torch.bool),
                         got.aux_hidden_states, got.last_hidden_state), got.meta

    try:
        with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
            for n_done, (i, sample, got_meta) in enumerate(
                    _bounded(pool, one, len(samples), concurrency), start=1):
                # The server says which layers it captured; a mismatch must never pass silently.
                captured = _capture_ids(got_meta)
                if captured != list(capture_ids):
                    raise ExtractionError(f"{plan.name}: server captured layers {captured} "
                                          f"({got_meta.get('layer_convention')}), config expects "
                                          f"capture-before {list(capture_ids)}")
                if writer is None:
                    H = sample.last_hidden_state.shape[1]
                    writer = ShardWriter(path, [len(s.input_ids) for s in samples], hidden_size=H,
                                         num_aux=len(capture_ids), dtype=DTYPES[dtype],
                                         meta={**meta, "shard_index": plan.index,
                                               "num_shards": plan.num_shards,
                                               "content_hash": plan.content_hash,
                                               "last_hidden_norm": got_meta["last_hidden_norm"]})
                writer.put(i, sample)
                if on_sample:
                    on_sample(n_done, len(samples))
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    manifest = writer.close()
    manifest["seconds"] = round(time.monotonic() - t0, 3)
    return manifest


def _capture_ids(meta: dict) -> list[int]:
    ids = list(meta["layer_ids"])
    return [i + 1 for i in ids] if meta.get("layer_convention") == "output-of" else ids


def _bounded(pool: ThreadPoolExecutor, fn, n: int, width: int):
    """Yield fn(i) results as they finish, with at most `width` in flight (bounded memory)."""
    pending, nxt = set(), 0
    while nxt < n or pending:
        while nxt < n and len(pending) < width:
            pending.add(pool.submit(fn, nxt))
            nxt += 1
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for f in done:
            yield f.result()


def shard_cache_key(plan: ShardPlan, *, target_checkpoint: str, target_revision: str | None,
                    capture_ids: list[int], dtype: str, patch_version: str) -> str:
    """What a shard's content depends on: its sequences, the target, the layers, dtype, the hook."""
    import hashlib

    parts = [plan.content_hash, target_checkpoint, str(target_revision), ",".join(map(str, capture_ids)),
             dtype, patch_version, "eyas-shard/1"]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()
