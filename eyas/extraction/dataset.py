"""The extraction as a whole: target sizes, the disk-space estimate, progress, and dataset.json.

    hidden, vocab = target_dims(cfg.target.checkpoint)
    check_disk_space(out_dir, estimate_bytes(plans, hidden, 3, "bfloat16", "plain", out_dir), keep_free_gb=1)
    run = ExtractionRun(out_dir, plans, on_change=...)     # one per flow run and output dir
    run.shard_progress(p); run.shard_done(plan, manifest, reused=False)   # from the shard tasks

dataset.json (eyas-dataset/1) is written when every planned shard is on disk and confirmed in
this run, and removed when a new plan starts, so it exists exactly when the dataset is complete.
Prefect-free: the task layer turns the figures into artifacts and log lines.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

from eyas import __version__
from eyas.extraction.data import ShardPlan
from eyas.extraction.shards import ShardError, bytes_per_token, read_manifest, write_json_atomic

DATASET_FORMAT = "eyas-dataset/1"
HEADER_BYTES = 64 * 1024  # a generous bound on a shard's safetensors header


class DiskSpaceError(RuntimeError):
    """The output disk cannot hold the extraction; says how much is needed and how much is free."""


def dataset_path(output_dir: str | Path) -> Path:
    return Path(output_dir) / "dataset.json"


def target_dims(*folders: str | Path | None) -> tuple[int, int]:
    """(hidden_size, vocab_size) from the first config.json among folders (text_config if nested)."""
    tried = []
    for folder in folders:
        if folder is None:
            continue
        path = Path(folder) / "config.json"
        tried.append(str(path))
        if path.exists():
            cfg = json.loads(path.read_text())
            cfg = cfg.get("text_config", cfg) if "hidden_size" not in cfg else cfg
            try:
                return int(cfg["hidden_size"]), int(cfg["vocab_size"])
            except KeyError as e:
                raise ValueError(f"{path}: no {e.args[0]} in the target config") from None
    raise ValueError(f"no target config.json found (tried {tried}); the vocabulary check and the "
                     f"disk estimate need hidden_size and vocab_size")


def estimate_bytes(plans: list[ShardPlan], hidden_size: int, num_aux: int, dtype: str, encoding: str,
                   output_dir: str | Path | None = None) -> int:
    """Bytes the shards still to be written will take (shards already on disk for the same plan,
    dtype and encoding are not counted)."""
    per_token = bytes_per_token(hidden_size, num_aux, dtype, encoding)
    total = 0
    for p in plans:
        if output_dir is not None and _on_disk(Path(output_dir) / f"{p.name}.safetensors", p, dtype, encoding):
            continue
        total += p.num_tokens * per_token + 8 * (p.num_sequences + 1) + HEADER_BYTES
    return total


def _on_disk(path: Path, plan: ShardPlan, dtype: str, encoding: str) -> bool:
    try:
        m = read_manifest(path)
        return (path.stat().st_size == m["bytes"] and m.get("content_hash") == plan.content_hash
                and m.get("dtype") == dtype and m.get("encoding", "plain") == encoding)
    except (ShardError, OSError, KeyError):
        return False


def check_disk_space(output_dir: str | Path, needed_bytes: int, *, keep_free_gb: float) -> dict[str, int]:
    """Refuse (DiskSpaceError) when the output disk lacks needed_bytes + keep_free_gb."""
    output_dir = Path(output_dir)
    probe = output_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    reserve = int(keep_free_gb * 1e9)
    if free < needed_bytes + reserve:
        raise DiskSpaceError(
            f"{output_dir}: extraction needs {needed_bytes / 1e9:.2f} GB more and must leave "
            f"extraction.keep_free_gb={keep_free_gb} GB free, but the disk has {free / 1e9:.2f} GB free "
            f"(short by {(needed_bytes + reserve - free) / 1e9:.2f} GB); free space, point "
            f"extraction.output_dir elsewhere, or use extraction.encoding: fp8_e4m3 (about half the bytes)")
    return {"needed_bytes": needed_bytes, "free_bytes": free, "reserve_bytes": reserve}


# ---------------------------------------------------------------------------------------------
# dataset.json
# ---------------------------------------------------------------------------------------------

# Fields every shard of one dataset must agree on; dataset.json carries them once.
_SHARED = ("format", "dtype", "encoding", "hidden_size", "num_aux_layers", "layer_ids", "layer_convention",
           "capture_ids", "layer_ids_capture_before", "layer_ids_output_of", "last_hidden_norm",
           "target_checkpoint", "target_revision", "backend", "patch_version", "tokenizer_sha256",
           "chat_template_sha256", "eyas_version")


def build_dataset_manifest(manifests: list[dict[str, Any]], plan_info: dict[str, Any] | None = None) -> dict[str, Any]:
    """dataset.json from the shard manifests (in shard order); refuses shards that disagree."""
    if not manifests:
        raise ValueError("dataset manifest: no shards")
    shared = {}
    for key in _SHARED:
        values = {json.dumps(m.get(key), sort_keys=True) for m in manifests}
        if len(values) > 1:
            raise ValueError(f"dataset manifest: shards disagree on {key}: {sorted(values)}")
        shared[key] = manifests[0].get(key)
    out = {**shared, "format": DATASET_FORMAT, "shard_format": shared["format"],
           "eyas_version": shared.get("eyas_version") or __version__,
           "num_shards": len(manifests), "num_samples": sum(m["num_samples"] for m in manifests),
           "num_tokens": sum(m["num_tokens"] for m in manifests), "bytes": sum(m["bytes"] for m in manifests),
           "shards": [{k: m.get(k) for k in ("file", "sha256", "bytes", "num_samples", "num_tokens",
                                              "content_hash", "cache_key")} for m in manifests]}
    out["bytes_per_token"] = round(out["bytes"] / max(out["num_tokens"], 1), 3)
    if any("fp8_error" in m for m in manifests):
        out["fp8_error"] = _merge_fp8([m["fp8_error"] for m in manifests if "fp8_error" in m])
    if plan_info:
        out["data"] = {k: plan_info.get(k) for k in ("data_path", "data_sha256", "stats") if k in plan_info}
    return out


def _merge_fp8(errors: list[dict]) -> dict:
    """Token-weighted RMS over shards, worst case of the maxima."""
    out = {}
    for part in ("aux", "last"):
        items = [e[part] for e in errors]
        tokens = sum(i["tokens"] for i in items) or 1
        rms = [(sum(i["rel_rms"][g] ** 2 * i["tokens"] for i in items) / tokens) ** 0.5
               for g in range(len(items[0]["rel_rms"]))]
        out[part] = {"rel_rms": [round(v, 6) for v in rms], "max_token_rel": max(i["max_token_rel"] for i in items),
                     "min_cosine": min(i["min_cosine"] for i in items), "tokens": tokens}
    return out


def write_dataset_manifest(output_dir: str | Path, manifests: list[dict[str, Any]],
                           plan_info: dict[str, Any] | None = None) -> dict[str, Any]:
    obj = build_dataset_manifest(manifests, plan_info)
    write_json_atomic(dataset_path(output_dir), obj)
    return obj


# ---------------------------------------------------------------------------------------------
# Progress of one extraction run
# ---------------------------------------------------------------------------------------------

class ExtractionRun:
    """Figures of one extraction over all its shards, fed by the shard tasks (thread-safe).

    `on_change(run, event)` is called after every update (event "progress", "shard", "complete");
    the callback decides how often to publish. When the last planned shard is done, dataset.json is
    written (with `plan_info`) and `dataset` holds it.
    """

    def __init__(self, output_dir: str | Path, plans: list[ShardPlan], *, plan_info: dict | None = None,
                 on_change: Callable[["ExtractionRun", str], None] | None = None):
        self.output_dir, self.plan_info, self.on_change = Path(output_dir), plan_info or {}, on_change
        self.plans = {p.name: p for p in plans}
        self.num_tokens = sum(p.num_tokens for p in plans)
        self.rows: dict[str, dict[str, Any]] = {
            p.name: {"shard": p.name, "status": "pending", "sequences": p.num_sequences, "tokens": p.num_tokens,
                     "done": 0, "MB": 0.0, "seconds": None, "tok_per_s": None, "sha256": None} for p in plans}
        self.manifests: dict[str, dict] = {}
        self.dataset: dict | None = None
        self._live: dict[str, tuple[int, int]] = {}  # shard -> (tokens, bytes) written so far
        self._t0: float | None = None
        self._extracted_tokens = self._extracted_bytes = 0
        self._lock = threading.Lock()
        dataset_path(self.output_dir).unlink(missing_ok=True)  # a new plan: complete only when confirmed

    # ---- events
    def shard_started(self, shard: str) -> None:
        """A shard task began extracting (rates count from the first such moment)."""
        with self._lock:
            if self._t0 is None:
                self._t0 = time.monotonic()
            self._live.setdefault(shard, (0, 0))
            self.rows[shard].update(status="running")
        self._notify("shard")

    def shard_progress(self, shard: str, tokens: int, bytes_: int, samples_done: int) -> None:
        with self._lock:
            if self._t0 is None:
                self._t0 = time.monotonic()
            self._live[shard] = (tokens, bytes_)
            self.rows[shard].update(status="running", done=samples_done)
        self._notify("progress")

    def shard_done(self, plan: ShardPlan, manifest: dict[str, Any], *, reused: bool) -> dict | None:
        with self._lock:
            if plan.name in self.manifests:
                return self.dataset
            self._live.pop(plan.name, None)
            self.manifests[plan.name] = manifest
            secs = manifest.get("seconds")
            self.rows[plan.name].update(
                status="reused" if reused else "done", done=manifest["num_samples"],
                MB=round(manifest["bytes"] / 1e6, 2), seconds=secs, sha256=manifest["sha256"][:12],
                tok_per_s=round(manifest["num_tokens"] / secs) if secs and not reused else None)
            if not reused:
                self._extracted_tokens += manifest["num_tokens"]
                self._extracted_bytes += manifest["bytes"]
            complete = len(self.manifests) == len(self.plans)
            if complete:
                ordered = [self.manifests[n] for n in sorted(self.plans, key=lambda n: self.plans[n].index)]
                self.dataset = write_dataset_manifest(self.output_dir, ordered, self.plan_info)
        self._notify("complete" if complete else "shard")
        return self.dataset

    def shard_failed(self, shard: str, error: str) -> None:
        with self._lock:
            self._live.pop(shard, None)
            self.rows[shard].update(status=f"failed: {error[:80]}")
        self._notify("shard")

    # ---- figures
    def figures(self) -> dict[str, Any]:
        with self._lock:
            live_tokens = sum(t for t, _ in self._live.values())
            live_bytes = sum(b for _, b in self._live.values())
            done_tokens = sum(m["num_tokens"] for m in self.manifests.values())
            elapsed = time.monotonic() - self._t0 if self._t0 is not None else 0.0
            extracted = self._extracted_tokens + live_tokens
            rate = extracted / elapsed if elapsed >= 1.0 and extracted else None  # no rate from a blink
            remaining = self.num_tokens - done_tokens - live_tokens
            return {"shards_done": len(self.manifests), "num_shards": len(self.plans),
                    "shards_reused": sum(r["status"] == "reused" for r in self.rows.values()),
                    "tokens_done": done_tokens + live_tokens, "num_tokens": self.num_tokens,
                    "tokens_per_s": round(rate, 1) if rate else None,
                    "gb_written": round((self._extracted_bytes + live_bytes) / 1e9, 4),
                    "eta_s": round(remaining / rate, 1) if rate else None,
                    "elapsed_s": round(elapsed, 1),
                    "percent": round(100.0 * (done_tokens + live_tokens) / max(self.num_tokens, 1), 2)}

    def table(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(self.rows[n]) for n in sorted(self.plans, key=lambda n: self.plans[n].index)]

    def describe(self) -> str:
        f = self.figures()
        rate = f"{f['tokens_per_s']:.0f} tok/s" if f["tokens_per_s"] else "- tok/s"
        eta = f"ETA {f['eta_s']:.0f}s" if f["eta_s"] is not None else "ETA -"
        return (f"{f['shards_done']}/{f['num_shards']} shards ({f['shards_reused']} reused), "
                f"{f['tokens_done']}/{f['num_tokens']} tokens, {rate}, {f['gb_written']:.3f} GB written, {eta}")

    def _notify(self, event: str) -> None:
        if self.on_change is not None:
            self.on_change(self, event)

