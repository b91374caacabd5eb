"""Conversations to token ids and loss masks, and the deterministic shard plan.

    convs = load_conversations(cfg.data.path)
    prepared = prepare(convs, tokenizer, cfg.data)
    plans = write_shard_plans(prepared.train, cfg.extraction.num_shards, plan_dir)

The loss mask covers the assistant's tokens: each assistant turn is found by rendering the
conversation up to that turn with and without it, so the mask follows the chat template exactly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.config import DataConfig
from eyas.shards import write_json_atomic

ROLES = {"system", "user", "assistant"}


class DataError(ValueError):
    """Input data that cannot be used; names the file and line."""


@dataclass
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens


@dataclass
class Prepared:
    train: list[TokenizedSample]
    heldout_prompts: list[list[int]]  # rendered up to the first assistant turn
    stats: dict[str, int] = field(default_factory=dict)


def load_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    """Read JSONL conversations ({"messages": [{"role", "content"}, ...]}), checking every line."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: data file not found")
    convs = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: malformed JSON ({e.msg})") from None
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not messages:
            raise DataError(f"{where}: missing or empty 'messages'")
        for j, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise DataError(f"{where}: message {j} needs a role in {sorted(ROLES)} and string content")
            if m["role"] == "assistant" and not m["content"].strip():
                raise DataError(f"{where}: message {j} is an empty assistant turn")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where}: no assistant turn, so nothing to train on")
        convs.append(messages)
    if not convs:
        raise DataError(f"{path}: no conversations in the file")
    return convs


def _render(tokenizer, messages, add_generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def tokenize_conversation(tokenizer, messages: list[dict[str, str]]) -> TokenizedSample:
    """Token ids of the whole conversation, with the assistant turns masked in."""
    ids = _render(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(_render(tokenizer, messages[:j], add_generation_prompt=True))
        end = len(_render(tokenizer, messages[: j + 1], add_generation_prompt=False))
        mask[start:end] = [1] * (end - start)
    return TokenizedSample(ids, mask)


def prepare(convs: list[list[dict[str, str]]], tokenizer, cfg: DataConfig) -> Prepared:
    """Tokenize, apply the length policy, and hold out the last conversations for evaluation."""
    num_heldout = min(cfg.num_heldout, len(convs) - 1)
    train_convs, heldout = convs[: len(convs) - num_heldout], convs[len(convs) - num_heldout:]
    stats = {"conversations": len(train_convs), "truncated": 0, "dropped_overlong": 0,
             "dropped_no_loss": 0}
    train = []
    for messages in train_convs:
        s = tokenize_conversation(tokenizer, messages)
        if len(s.input_ids) > cfg.max_length:
            if cfg.overlong == "drop":
                stats["dropped_overlong"] += 1
                continue
            s = TokenizedSample(s.input_ids[: cfg.max_length], s.loss_mask[: cfg.max_length])
            stats["truncated"] += 1
        if not any(s.loss_mask):
            stats["dropped_no_loss"] += 1  # truncation cut every assistant token
            continue
        train.append(s)
    if not train:
        raise DataError(f"{cfg.path}: no trainable sequence left after the length policy ({stats})")
    prompts = []
    for messages in heldout:
        first = next(j for j, m in enumerate(messages) if m["role"] == "assistant")
        prompts.append(_render(tokenizer, messages[:first], add_generation_prompt=True)[-cfg.max_length:])
    stats["sequences"] = len(train)
    stats["tokens"] = sum(len(s.input_ids) for s in train)
    stats["loss_tokens"] = sum(sum(s.loss_mask) for s in train)
    return Prepared(train, prompts, stats)


@dataclass
class ShardPlan:
    index: int
    num_shards: int
    path: Path  # the plan file: the shard's sequences, one JSON line each
    content_hash: str  # sha256 over the shard's ids and masks
    num_sequences: int
    num_tokens: int

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}"


def write_shard_plans(samples: list[TokenizedSample], num_shards: int, plan_dir: str | Path) -> list[ShardPlan]:
    """Split samples into contiguous shards by index and write one plan file per shard."""
    plan_dir = Path(plan_dir)
    num_shards = max(1, min(num_shards, len(samples)))
    bounds = [round(k * len(samples) / num_shards) for k in range(num_shards + 1)]
    plans = []
    for k in range(num_shards):
        chunk = samples[bounds[k]: bounds[k + 1]]
        lines = [json.dumps({"input_ids": s.input_ids, "loss_mask": s.loss_mask}, separators=(",", ":"))
                 for s in chunk]
        digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
        path = plan_dir / f"shard-{k:05d}.plan.jsonl"
        if not path.exists() or _sha256_lines(path) != digest:
            _write_text_atomic(path, "\n".join(lines) + "\n")
        plans.append(ShardPlan(k, num_shards, path, digest, len(chunk),
                               sum(len(s.input_ids) for s in chunk)))
    write_json_atomic(plan_dir / "plan.json", [_plan_json(p) for p in plans])
    return plans


def read_shard_plan(path: str | Path) -> list[TokenizedSample]:
    return [TokenizedSample(**json.loads(line)) for line in Path(path).read_text().splitlines() if line]


def _plan_json(p: ShardPlan) -> dict[str, Any]:
    return {"index": p.index, "path": str(p.path), "content_hash": p.content_hash,
            "num_sequences": p.num_sequences, "num_tokens": p.num_tokens}


def _sha256_lines(path: Path) -> str:
    return hashlib.sha256(path.read_text().rstrip("\n").encode()).hexdigest()


def _write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)
