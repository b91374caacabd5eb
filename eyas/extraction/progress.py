"""Progress of one extraction over all its shards: figures, a shard table, dataset.json at the end.

    run = ExtractionRun(out_dir, plans, on_change=...)     # one per flow run and output dir
    run.shard_progress(shard, tokens, bytes, samples); run.shard_done(plan, manifest, reused=False)

Prefect-free: the task layer turns the figures into artifacts and log lines.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

from eyas.extraction.data import ShardPlan
from eyas.extraction.dataset import dataset_path, write_dataset_manifest


class ExtractionRun:
    """Figures of one extraction over all its shards, fed by the shard tasks (thread-safe).

    `on_change(run, event)` is called after every update (event "progress", "shard", "complete");
    the callback decides how often to publish. When the last planned shard is done, dataset.json is
    written (with `plan_info`) and `dataset` holds it.
    """

    def __init__(
        self,
        output_dir: str | Path,
        plans: list[ShardPlan],
        *,
        plan_info: dict | None = None,
        on_change: Callable[["ExtractionRun", str], None] | None = None,
    ):
        self.output_dir, self.plan_info, self.on_change = (
            Path(output_dir),
            plan_info or {},
            on_change,
        )
        self.plans = {p.name: p for p in plans}
        self.num_tokens = sum(p.num_tokens for p in plans)
        self.rows: dict[str, dict[str, Any]] = {
            p.name: {
                "shard": p.name,
                "status": "pending",
                "sequences": p.num_sequences,
                "tokens": p.num_tokens,
                "done": 0,
                "MB": 0.0,
                "seconds": None,
                "tok_per_s": None,
                "sha256": None,
            }
            for p in plans
        }
        self.manifests: dict[str, dict] = {}
        self.dataset: dict | None = None
        self._live: dict[str, tuple[int, int]] = {}  # shard -> (tokens, bytes) written so far
        self._t0: float | None = None
        self._extracted_tokens = self._extracted_bytes = 0
        self._lock = threading.Lock()
        dataset_path(self.output_dir).unlink(
            missing_ok=True
        )  # a new plan: complete only when confirmed

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
        """Count the shard; the dataset manifest to the one call whose shard completed it, else None
        (read inside the lock: a shard finishing beside this one must not make both report it)."""
        with self._lock:
            if plan.name in self.manifests:
                return None
            self._live.pop(plan.name, None)
            self.manifests[plan.name] = manifest
            secs = manifest.get("seconds")
            self.rows[plan.name].update(
                status="reused" if reused else "done",
                done=manifest["num_samples"],
                MB=round(manifest["bytes"] / 1e6, 2),
                seconds=secs,
                sha256=manifest["sha256"][:12],
                tok_per_s=round(manifest["num_tokens"] / secs) if secs and not reused else None,
            )
            if not reused:
                self._extracted_tokens += manifest["num_tokens"]
                self._extracted_bytes += manifest["bytes"]
            complete = None
            if len(self.manifests) == len(self.plans):
                ordered = [
                    self.manifests[n] for n in sorted(self.plans, key=lambda n: self.plans[n].index)
                ]
                self.dataset = complete = write_dataset_manifest(
                    self.output_dir, ordered, self.plan_info
                )
        self._notify("complete" if complete else "shard")
        return complete

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
            rate = (
                extracted / elapsed if elapsed >= 1.0 and extracted else None
            )  # no rate from a blink
            remaining = self.num_tokens - done_tokens - live_tokens
            return {
                "shards_done": len(self.manifests),
                "num_shards": len(self.plans),
                "shards_reused": sum(r["status"] == "reused" for r in self.rows.values()),
                "tokens_done": done_tokens + live_tokens,
                "num_tokens": self.num_tokens,
                "tokens_per_s": round(rate, 1) if rate else None,
                "gb_written": round((self._extracted_bytes + live_bytes) / 1e9, 4),
                "eta_s": round(remaining / rate, 1) if rate else None,
                "elapsed_s": round(elapsed, 1),
                "percent": round(100.0 * (done_tokens + live_tokens) / max(self.num_tokens, 1), 2),
            }

    def table(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                dict(self.rows[n]) for n in sorted(self.plans, key=lambda n: self.plans[n].index)
            ]

    def describe(self) -> str:
        f = self.figures()
        rate = f"{f['tokens_per_s']:.0f} tok/s" if f["tokens_per_s"] else "- tok/s"
        eta = f"ETA {f['eta_s']:.0f}s" if f["eta_s"] is not None else "ETA -"
        return (
            f"{f['shards_done']}/{f['num_shards']} shards ({f['shards_reused']} reused), "
            f"{f['tokens_done']}/{f['num_tokens']} tokens, {rate}, {f['gb_written']:.3f} GB "
            f"written, {eta}"
        )

    def _notify(self, event: str) -> None:
        if self.on_change is not None:
            self.on_change(self, event)
