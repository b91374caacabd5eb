"""Regenerate the assistant turns of the training conversations with the target itself.

    with ServerPool([Endpoint(url, dump_dir, 4)]) as pool:
        path, summary = regenerate(records, tokenizer, pool, out_dir,
        RegenerateConfig(enabled=True),
                                   target="/models/Kimi-K2.5@main", max_length=4096)
    records, _ = load_records(path)         # then prepare and extract as usual

Training on the target's own responses is the largest lever on acceptance (docs/training.md,
Quality): the drafter learns the distribution it will be asked to predict. How one conversation is
asked, and a thinking target's records of the server's own ids: regenerate_turns.py.

Sharded and resumable: the conversations are split into contiguous parts; each part is written to
`part-{k:05d}.jsonl` with a manifest naming its input hash, target and sampling, and a part whose
manifest matches is never regenerated again. `regenerated.jsonl` (all parts, in order) is written
atomically once every part is done. Pre-tokenized records pass through unchanged.

Progress: `on_progress(RegenerationProgress)` after every conversation and part (from the worker
threads); the caller throttles (tasks/progress.py).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eyas.config import RegenerateConfig
from eyas.extraction.client import ServerPool
from eyas.extraction.data import Record
from eyas.extraction.regenerate_turns import (
    Thinking,
    regenerate_conversation,
    regenerate_conversation_ids,
    thinking_for,
    turn_end_ids,
)
from eyas.files import atomic_file, write_bytes_atomic, write_json_atomic

FORMAT = "eyas-regen/1"


@dataclass(frozen=True)
class RegenerationProgress:
    """Figures of one regeneration so far."""

    parts_done: int
    num_parts: int
    done: int  # conversations (records) answered, or found in finished parts
    total: int
    reused: int  # of `done`: in parts an earlier run finished
    tokens: int  # tokens the target generated in this run
    seconds: float  # since this run began

    @property
    def percent(self) -> float:
        return round(100.0 * self.done / max(self.total, 1), 2)

    @property
    def tokens_per_s(self) -> float | None:
        return round(self.tokens / self.seconds, 1) if self.seconds >= 1.0 and self.tokens else None

    @property
    def eta_s(self) -> float | None:
        new = (
            self.done - self.reused
        )  # none before a rate is known (the tokens' rate, as shown beside it)
        return (
            round((self.total - self.done) * self.seconds / new, 1)
            if new > 0 and self.tokens_per_s
            else None
        )

    def describe(self) -> str:
        rate = f"{self.tokens_per_s:,.0f} tok/s" if self.tokens_per_s else "- tok/s"
        eta = f"ETA {self.eta_s:.0f}s" if self.eta_s is not None else "ETA -"
        return (
            f"{self.parts_done}/{self.num_parts} parts, {self.done}/{self.total} conversations "
            f"({self.reused} reused), {self.tokens:,} tokens generated, {rate}, {eta}"
        )


class _Progress:
    """Counts RegenerationProgress from the worker threads and hands each snapshot to
    on_progress."""

    def __init__(self, num_parts: int, total: int, on_progress):
        self.num_parts, self.total, self.on_progress = num_parts, total, on_progress
        self.parts = self.done = self.reused = self.tokens = 0
        self.t0, self.lock = time.monotonic(), threading.Lock()

    def conversation(self, tokens: int) -> None:
        with self.lock:
            self.done, self.tokens = self.done + 1, self.tokens + tokens
            snapshot = self._snapshot()
        self._tell(snapshot)

    def part(self, records: int, reused: bool) -> None:
        with self.lock:
            self.parts += 1
            if reused:
                self.done, self.reused = self.done + records, self.reused + records
            snapshot = self._snapshot()
        self._tell(snapshot)

    def _snapshot(self) -> RegenerationProgress:
        return RegenerationProgress(
            self.parts,
            self.num_parts,
            self.done,
            self.total,
            self.reused,
            self.tokens,
            time.monotonic() - self.t0,
        )

    def _tell(self, snapshot: RegenerationProgress) -> None:
        if self.on_progress is not None:
            self.on_progress(snapshot)


def _record_json(r: Record) -> str:
    if r.messages is not None:
        return json.dumps({"messages": r.messages}, ensure_ascii=False, separators=(",", ":"))
    return json.dumps(
        {"input_ids": r.tokens.input_ids, "loss_mask": r.tokens.loss_mask}, separators=(",", ":")
    )


def part_bounds(n: int, num_parts: int) -> list[tuple[int, int]]:
    num_parts = max(1, min(num_parts, n))
    b = [round(k * n / num_parts) for k in range(num_parts + 1)]
    return list(zip(b, b[1:]))


@dataclass
class _Run:
    """What every part of one regeneration asks with."""

    records: list[Record]
    tokenizer: Any
    pool: ServerPool
    cfg: RegenerateConfig
    th: Thinking | None  # a thinking target: its records are the server's own ids
    stop_ids: list[int]
    max_length: int
    params: dict  # what a finished part's manifest must name to be reused
    progress: _Progress
    num_parts: int


def regenerate(
    records: list[Record],
    tokenizer,
    pool: ServerPool,
    out_dir: str | Path,
    cfg: RegenerateConfig,
    *,
    target: str,
    max_length: int,
    passthrough: list[Record] = (),
    on_part: Callable[[int, int, dict], None] | None = None,
    on_progress: Callable[[RegenerationProgress], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Regenerate every part not already done; returns (regenerated.jsonl, summary).

    `passthrough` records (the held-out ones, say) are appended to regenerated.jsonl unchanged.
    on_part(k, num_parts, manifest) after each part; on_progress after each conversation and part.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stop_ids = turn_end_ids(tokenizer)
    th = thinking_for(tokenizer, cfg)  # a wrong switch is refused before the first request
    params = _params(cfg, stop_ids, max_length, target)
    bounds = part_bounds(len(records), cfg.num_parts)
    progress = _Progress(len(bounds), len(records), on_progress)
    run = _Run(
        records, tokenizer, pool, cfg, th, stop_ids, max_length, params, progress, len(bounds)
    )
    manifests = []
    for k, (a, b) in enumerate(bounds):
        input_hash = _input_hash(records[a:b])
        done = _finished_part(out_dir, k, input_hash, params)
        if done is not None:
            manifests.append({**done, "reused": True})
        else:
            manifests.append(_regenerate_part(run, k, a, b, input_hash, out_dir))
        if on_part:  # the part's own line before the progress that counts it
            on_part(k, len(bounds), manifests[-1])
        progress.part(b - a, reused=done is not None)
    combined = _write_combined(out_dir, len(bounds), passthrough)
    summary = _summary(cfg, params, manifests, passthrough)
    write_json_atomic(out_dir / "regenerate.json", summary)
    return combined, summary


def _write_combined(out_dir: Path, num_parts: int, passthrough: list[Record]) -> Path:
    """regenerated.jsonl: every part in order, then the passthrough records."""
    combined = out_dir / "regenerated.jsonl"
    with atomic_file(combined) as f:
        for k in range(num_parts):
            f.write((out_dir / f"part-{k:05d}.jsonl").read_bytes())
        for r in passthrough:
            f.write((_record_json(r) + "\n").encode())
    return combined


def _summary(
    cfg: RegenerateConfig, params: dict, manifests: list[dict], passthrough: list[Record]
) -> dict[str, Any]:
    """regenerate.json: the parts' manifests added up."""
    return {
        "format": FORMAT,
        "parts": len(manifests),
        "params": params,
        **{
            key: sum(m[key] for m in manifests)
            for key in (
                "records",
                "conversations",
                "regenerated_turns",
                "kept_original_turns",
                "dropped_turns",
                "output_tokens",
            )
        },
        "parts_reused": sum(bool(m.get("reused")) for m in manifests),
        "passed_through": len(passthrough),
        **_thinking_summary(cfg, manifests),
    }


def pending_parts(
    records: list[Record],
    tokenizer,
    out_dir: str | Path,
    cfg: RegenerateConfig,
    *,
    target: str,
    max_length: int,
) -> list[int]:
    """The parts `regenerate` would still ask the target for (empty: no server needed).

    A thinking switch the template does not have is refused here, before a server is launched."""
    thinking_for(tokenizer, cfg)
    params = _params(cfg, turn_end_ids(tokenizer), max_length, target)
    return [
        k
        for k, (a, b) in enumerate(part_bounds(len(records), cfg.num_parts))
        if _finished_part(Path(out_dir), k, _input_hash(records[a:b]), params) is None
    ]


def _params(cfg: RegenerateConfig, stop_ids: list[int], max_length: int, target: str) -> dict:
    params = {
        "max_new_tokens": cfg.max_new_tokens,
        **cfg.sampling(),
        "seed": cfg.seed,
        "stop_token_ids": stop_ids,
        "max_length": max_length,
        "target": target,
    }
    if (
        cfg.thinking is not None
    ):  # only then: parts a target without thinking finished stay reusable
        params["thinking"] = {cfg.thinking_kwarg: cfg.thinking}
    return params


def _thinking_summary(cfg: RegenerateConfig, manifests: list[dict]) -> dict[str, Any]:
    """The reasoning figures of a regeneration (report.json's `regeneration`): reasoning tokens are
    counted from the replies' ids (between <think> and </think>); server_reasoning_tokens is
    SGLang's own meta_info figure where the server reported one (a --reasoning-parser launch), else
    None."""
    if cfg.thinking is None:
        return {"thinking": None, "reasoning_tokens": 0}
    total = {
        key: sum(m.get(key, 0) for m in manifests)
        for key in (
            "sequences",
            "reasoning_tokens",
            "unfinished_reasoning_turns",
            "server_reasoning_tokens",
            "server_reasoning_replies",
        )
    }
    return {
        "thinking": cfg.thinking,
        "sequences": total["sequences"],
        "reasoning_tokens": total["reasoning_tokens"],
        "unfinished_reasoning_turns": total["unfinished_reasoning_turns"],
        "server_reasoning_tokens": total["server_reasoning_tokens"]
        if total["server_reasoning_replies"]
        else None,
    }


def _input_hash(records: list[Record]) -> str:
    return hashlib.sha256("\n".join(_record_json(r) for r in records).encode()).hexdigest()


def _finished_part(out_dir: Path, k: int, input_hash: str, params: dict) -> dict | None:
    """Part k's manifest when it was made from these inputs and its file is intact, else None."""
    path, done = out_dir / f"part-{k:05d}.jsonl", _read_json(out_dir / f"part-{k:05d}.json")
    if (
        done
        and done.get("input_sha256") == input_hash
        and done.get("params") == params
        and path.exists()
        and hashlib.sha256(path.read_bytes()).hexdigest() == done.get("output_sha256")
    ):
        return done
    return None


def _conversation_lines(run: _Run, i: int, k: int) -> tuple[list[str], dict]:
    """Record i as its lines of part k's file, and the counts of its regeneration (a pre-tokenized
    record passes through)."""
    r = run.records[i]
    if r.messages is None:
        return [_record_json(r)], {"generated_tokens": 0}
    where = f"part {k} ({r.where})"
    if run.th is not None:
        out, c = regenerate_conversation_ids(
            r.messages,
            i,
            run.tokenizer,
            run.pool,
            run.cfg,
            run.th,
            run.stop_ids,
            run.max_length,
            where,
        )
        return [json.dumps(x, separators=(",", ":")) for x in out], c
    messages, c = regenerate_conversation(
        r.messages, i, run.tokenizer, run.pool, run.cfg, run.stop_ids, run.max_length, where
    )
    return [json.dumps({"messages": messages}, ensure_ascii=False, separators=(",", ":"))], c


def _reply_tokens(tokenizer, lines: list[str]) -> int:
    """The assistant replies' tokens in a part's chat records."""
    output_tokens = 0
    for line in lines:
        for m in json.loads(line).get("messages", []):
            if m["role"] == "assistant":
                output_tokens += len(tokenizer.encode(m["content"], add_special_tokens=False))
    return output_tokens


def _regenerate_part(run: _Run, k: int, a: int, b: int, input_hash: str, out_dir: Path) -> dict:
    """Records a..b asked of the target, written to part k's file, then its manifest."""
    t0 = time.monotonic()
    counts = {"regenerated_turns": 0, "kept_original_turns": 0, "dropped_turns": 0}
    if run.th is not None:
        counts.update(
            reasoning_tokens=0,
            unfinished_reasoning_turns=0,
            server_reasoning_tokens=0,
            server_reasoning_replies=0,
        )
    lock = threading.Lock()
    generated = [0]  # thinking: the replies' tokens written (the loss-1 ids of the records)

    def one(i: int) -> list[str]:
        lines, c = _conversation_lines(run, i, k)
        made = c.pop("generated_tokens")
        run.progress.conversation(made)
        with lock:
            for key, v in c.items():
                counts[key] += v
            generated[0] += made
        return lines

    # Turns of one conversation are sequential; conversations run side by side up to the pool's
    # width.
    with ThreadPoolExecutor(max(1, run.pool.capacity)) as ex:
        lines = [line for out in ex.map(one, range(a, b)) for line in out]
    text = ("\n".join(lines) + "\n").encode() if lines else b""
    write_bytes_atomic(out_dir / f"part-{k:05d}.jsonl", text)
    if run.th is not None:
        output_tokens = generated[0]
        counts["sequences"] = len(lines)
    else:
        output_tokens = _reply_tokens(run.tokenizer, lines)
    manifest = {
        "format": FORMAT,
        "part": k,
        "num_parts": run.num_parts,
        "records": b - a,
        "conversations": sum(run.records[i].messages is not None for i in range(a, b)),
        "input_sha256": input_hash,
        "output_sha256": hashlib.sha256(text).hexdigest(),
        "params": run.params,
        "output_tokens": output_tokens,
        "seconds": round(time.monotonic() - t0, 3),
        **counts,
    }
    write_json_atomic(out_dir / f"part-{k:05d}.json", manifest)
    return manifest


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
