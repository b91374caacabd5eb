"""Input records to token ids and loss masks, and the deterministic shard plan.

    records, skipped = load_records(cfg.data.path, vocab_size=4096, bad_lines="error")
    prepared = prepare(records, tokenizer, cfg.data, vocab_size=4096)
    plans = write_shard_plans(prepared.train, cfg.extraction.num_shards, plan_dir, info={...})

Two kinds of JSONL lines, mixed freely: conversations `{"messages": [{"role", "content"}, ...]}`,
tokenized here with the target's tokenizer and chat template, and pre-tokenized records
`{"input_ids": [...], "loss_mask": [...]}`, taken as they are. The loss mask covers the assistant's
tokens: each assistant turn is found by rendering the conversation up to that turn with and
without it, so the mask follows the chat template exactly.

A bad line (bytes that are not UTF-8, malformed JSON, missing or empty messages, an empty assistant
turn, text the tokenizer cannot take, token ids outside the target's vocabulary, more tokens than
the target's context, ...) is an error naming `file:line`, or with `bad_lines: skip` a counted skip
that names the line in the stats. Lines are decoded one by one, so one bad byte costs one line; a
UTF-8 byte order mark at the start of the file is dropped. Nothing is written until every line has
been read.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.config import DataConfig
from eyas.errors import EyasError
from eyas.files import sha256_file, write_json_atomic, write_text_atomic

ROLES = {"system", "user", "assistant"}
PLAN_FORMAT = "eyas-plan/1"
MAX_NAMED_SKIPS = 50  # the stats name at most this many skipped lines (and count all)
UTF8_BOM = b"\xef\xbb\xbf"
_PLAN_FILE = re.compile(r"shard-(\d{5,})\.plan\.jsonl")  # write_shard_plans's own files
_UNSET_MAX_LENGTH = 10**9  # Hugging Face's "no limit" is int(1e30)


class DataError(EyasError, ValueError):
    """Input data that cannot be used; names the file and line."""


@dataclass
class TokenizedSample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens


@dataclass
class Record:
    """One usable input line: a conversation, or a pre-tokenized sample."""

    where: str  # "file:line"
    messages: list[dict[str, str]] | None = None
    tokens: TokenizedSample | None = None


@dataclass
class Tokenized:
    """The training sequences after the length policy, the held-out prompts, and the counts."""

    train: list[TokenizedSample]
    heldout_prompts: list[list[int]]  # rendered up to the first assistant turn
    stats: dict[str, Any] = field(default_factory=dict)


def _check_messages(record: Any, where: str) -> list[dict[str, str]]:
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: missing or empty 'messages'")
    for j, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or m.get("role") not in ROLES
            or not isinstance(m.get("content"), str)
        ):
            raise DataError(
                f"{where}: message {j} needs a role in {sorted(ROLES)} and string content"
            )
        if m["role"] == "assistant" and not m["content"].strip():
            raise DataError(f"{where}: message {j} is an empty assistant turn")
        try:
            m["content"].encode("utf-8")
        except (
            UnicodeEncodeError
        ) as e:  # JSON can spell half a UTF-16 pair ("\\ud800"); no tokenizer takes it
            raise DataError(
                f"{where}: message {j} ({m['role']}): lone surrogate "
                f"U+{ord(m['content'][e.start]):04X} "
                f"at character {e.start} is not Unicode text (half of a UTF-16 pair in a JSON \\u "
                f"escape)"
            ) from None
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant turn, so nothing to train on")
    return messages


def check_ids(ids: list[int], vocab_size: int | None, where: str) -> None:
    """Token ids must be ints in 0..vocab_size-1 (the target's embedding has no row for others)."""
    for i, tok in enumerate(ids):
        if (
            not isinstance(tok, int)
            or isinstance(tok, bool)
            or tok < 0
            or (vocab_size is not None and tok >= vocab_size)
        ):
            bound = f"0..{vocab_size - 1}" if vocab_size is not None else ">= 0"
            raise DataError(
                f"{where}: token id {tok!r} at position {i} is outside the vocabulary ({bound})"
            )


def _check_tokenized(record: dict, where: str, vocab_size: int | None) -> TokenizedSample:
    ids, mask = record.get("input_ids"), record.get("loss_mask")
    if not isinstance(ids, list) or not ids:
        raise DataError(f"{where}: 'input_ids' must be a non-empty list of token ids")
    if not isinstance(mask, list) or len(mask) != len(ids):
        raise DataError(
            f"{where}: 'loss_mask' must be a list as long as input_ids ({len(ids)}), "
            f"got {type(mask).__name__} of length {len(mask) if isinstance(mask, list) else '-'}"
        )
    if any(m not in (0, 1) or isinstance(m, bool) for m in mask):
        raise DataError(f"{where}: 'loss_mask' must hold only 0 and 1")
    if not any(mask):
        raise DataError(f"{where}: 'loss_mask' is all zero, so nothing to train on")
    check_ids(ids, vocab_size, where)
    return TokenizedSample(list(ids), list(mask))


def load_records(
    path: str | Path, *, vocab_size: int | None = None, bad_lines: str = "error"
) -> tuple[list[Record], list[str]]:
    """Read and check every line; returns (records, skipped "file:line: reason" messages).

    bad_lines "error" raises DataError on the first bad line; "skip" skips it and names it.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: data file not found")
    records, skipped = [], []
    with open(path, "rb") as f:
        for lineno, raw_line in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = _decode_line(
                    raw_line.removeprefix(UTF8_BOM) if lineno == 1 else raw_line, where
                )
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as e:
                    # json's own message ends "... at" for some faults ("Invalid control character
                    # at")
                    raise DataError(
                        f"{where}:{e.colno}: malformed JSON ({e.msg.removesuffix(' at')} at column "
                        f"{e.colno})"
                    ) from None
                if isinstance(raw, dict) and "input_ids" in raw and "messages" not in raw:
                    records.append(Record(where, tokens=_check_tokenized(raw, where, vocab_size)))
                else:
                    records.append(Record(where, messages=_check_messages(raw, where)))
            except DataError as e:
                if bad_lines != "skip":
                    raise
                skipped.append(str(e))
    if not records:
        if skipped:
            raise DataError(
                f"{path}: no usable conversations in the file ({len(skipped)} bad line(s) "
                f"skipped, e.g. {skipped[:3]})"
            )
        raise DataError(f"{path}: no conversations in the file (it is empty)")
    return records, skipped


def _decode_line(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{where}:{e.start + 1}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at "
            f"column {e.start + 1}: {e.reason}); data files are UTF-8 JSONL"
        ) from None


def load_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    """Read JSONL conversations ({"messages": [{"role", "content"}, ...]}), checking every line."""
    records, _ = load_records(path)
    for r in records:
        if r.messages is None:
            raise DataError(
                f"{r.where}: missing or empty 'messages' (a pre-tokenized record; use load_records)"
            )
    return [r.messages for r in records]


def render_chat(tokenizer, messages, add_generation_prompt: bool, **template_kwargs) -> list[int]:
    """The token ids of messages through the tokenizer's chat template; template_kwargs reach the
    template (a thinking target's switch, prompt_kwargs)."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, **template_kwargs
    )
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def prompt_kwargs(cfg: DataConfig) -> dict[str, bool]:
    """The chat template's keywords for a prompt the target answers as it is served: a thinking
    target's switch (data.regenerate.thinking, by its thinking_kwarg); none for other targets."""
    r = cfg.regenerate
    return {} if r.thinking is None else {r.thinking_kwarg: r.thinking}


def tokenize_conversation(tokenizer, messages: list[dict[str, str]]) -> TokenizedSample:
    """Token ids of the whole conversation, with the assistant turns masked in."""
    ids = render_chat(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(ids)
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render_chat(tokenizer, messages[:j], add_generation_prompt=True))
        end = len(render_chat(tokenizer, messages[: j + 1], add_generation_prompt=False))
        mask[start:end] = [1] * (end - start)
    return TokenizedSample(ids, mask)


def _render_error(tokenizer, messages: list[dict[str, str]], where: str, error: Exception) -> str:
    """Name the first message the tokenizer or chat template fails on (rendering longer and longer
    prefixes, as tokenize_conversation does); called only once rendering has failed."""
    for j in range(len(messages)):
        try:
            render_chat(tokenizer, messages[: j + 1], add_generation_prompt=False)
        except Exception as e:  # noqa: BLE001 - any failure is the data's, reported with its line
            return (
                f"{where}: message {j} ({messages[j].get('role')}): the tokenizer or chat "
                f"template fails on it ({type(e).__name__}: {e})"
            )
    return (
        f"{where}: the tokenizer or chat template fails on this conversation "
        f"({type(error).__name__}: {error})"
    )


def context_limit(tokenizer) -> int | None:
    """The target's context in tokens as its tokenizer states it (model_max_length), if it does."""
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < _UNSET_MAX_LENGTH else None


def prepare(
    records: list,
    tokenizer,
    cfg: DataConfig,
    *,
    vocab_size: int | None = None,
    skipped: list[str] | None = None,
) -> Tokenized:
    """Tokenize, apply the length policy, and hold out the last records for evaluation.

    `records` are Records (load_records) or bare message lists (load_conversations). Every drop is
    counted in the stats, and the first MAX_NAMED_SKIPS are named with their line.
    """
    records = [
        r if isinstance(r, Record) else Record(f"{cfg.path}:#{k + 1}", messages=r)
        for k, r in enumerate(records)
    ]
    num_heldout = min(cfg.num_heldout, len(records) - 1)
    train_recs, heldout = (
        records[: len(records) - num_heldout],
        records[len(records) - num_heldout :],
    )
    policy = _LengthPolicy(tokenizer, cfg, vocab_size, list(skipped or []), len(train_recs))
    warned = getattr(tokenizer, "deprecation_warnings", None)
    if isinstance(
        warned, dict
    ):  # Hugging Face's "longer than the maximum" warning names no line; eyas does
        warned["sequence-length-is-longer-than-the-specified-maximum"] = True
    train = [s for s in map(policy.sequence, train_recs) if s is not None]
    stats = policy.stats
    if not train:
        raise DataError(f"{cfg.path}: no trainable sequence left after the length policy ({stats})")
    prompts = [p for p in map(policy.prompt, heldout) if p is not None]
    stats["sequences"] = len(train)
    stats["tokens"] = sum(len(s.input_ids) for s in train)
    stats["loss_tokens"] = sum(sum(s.loss_mask) for s in train)
    stats["skipped_lines"] = policy.skipped[:MAX_NAMED_SKIPS]
    return Tokenized(train, prompts, stats)


class _LengthPolicy:
    """data.max_length, data.overlong and data.bad_lines applied record by record, counting and
    naming every record left out."""

    def __init__(
        self,
        tokenizer,
        cfg: DataConfig,
        vocab_size: int | None,
        skipped: list[str],
        conversations: int,
    ):
        self.tokenizer, self.cfg, self.vocab_size, self.skipped = (
            tokenizer,
            cfg,
            vocab_size,
            skipped,
        )
        self.limit = context_limit(tokenizer)
        self.stats: dict[str, Any] = {
            "conversations": conversations,
            "truncated": 0,
            "dropped_overlong": 0,
            "dropped_no_loss": 0,
            "skipped_bad_lines": len(skipped),
        }

    def skip(self, reason: str) -> None:
        if self.cfg.bad_lines != "skip":
            raise DataError(reason)
        self.stats["skipped_bad_lines"] += 1
        self.skipped.append(reason)

    def sequence(self, r: Record) -> TokenizedSample | None:
        """The record's training sequence within the length policy, or None where it is left out."""
        cfg, stats = self.cfg, self.stats
        try:
            s = r.tokens or tokenize_conversation(self.tokenizer, r.messages)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation: name the line
            return self.skip(_render_error(self.tokenizer, r.messages, r.where, e))
        if r.messages is not None:
            try:
                check_ids(s.input_ids, self.vocab_size, f"{r.where} (after tokenizing)")
            except DataError as e:
                return self.skip(str(e))
        if len(s.input_ids) > cfg.max_length:
            if cfg.overlong == "drop":
                stats["dropped_overlong"] += 1
                self.skipped.append(
                    f"{r.where}: {len(s.input_ids)} tokens > data.max_length "
                    f"{cfg.max_length}, dropped"
                )
                return None
            s = TokenizedSample(s.input_ids[: cfg.max_length], s.loss_mask[: cfg.max_length])
            stats["truncated"] += 1
        if not any(s.loss_mask):
            stats["dropped_no_loss"] += 1  # truncation cut every assistant token
            self.skipped.append(
                f"{r.where}: no assistant token left within data.max_length, dropped"
            )
            return None
        if (
            self.limit is not None and len(s.input_ids) >= self.limit
        ):  # the server would refuse it (SGLang: >=)
            return self.skip(
                f"{r.where}: {len(s.input_ids)} tokens (after data.overlong {cfg.overlong} at "
                f"data.max_length {cfg.max_length}) are too many for the target (its tokenizer's "
                f"model_max_length is {self.limit}; a server takes fewer); set data.max_length "
                f"below {self.limit}"
            )
        return s

    def prompt(self, r: Record) -> list[int] | None:
        """A held-out record's prompt: its conversation up to the first assistant turn."""
        if r.messages is None:
            prompt = r.tokens.input_ids[: r.tokens.loss_mask.index(1)] or r.tokens.input_ids[:1]
            return prompt[-self.cfg.max_length :]
        first = next(j for j, m in enumerate(r.messages) if m["role"] == "assistant")
        try:
            prompt = render_chat(
                self.tokenizer,
                r.messages[:first],
                add_generation_prompt=True,
                **prompt_kwargs(self.cfg),
            )
        except Exception as e:  # noqa: BLE001 - as for training records: name the line and message
            return self.skip(
                _render_error(self.tokenizer, r.messages[:first], r.where, e)
                + " (a held-out prompt)"
            )
        return prompt[-self.cfg.max_length :]


# ---------------------------------------------------------------------------------------------
# Provenance: what the token ids depend on
# ---------------------------------------------------------------------------------------------


def tokenizer_hashes(tokenizer, folder: str | Path | None = None) -> dict[str, str | None]:
    """sha256 of the tokenizer (its tokenizer.json, else its vocabulary) and of its chat
    template."""
    tok_hash = None
    if folder is not None and (Path(folder) / "tokenizer.json").exists():
        tok_hash = sha256_file(Path(folder) / "tokenizer.json")
    elif hasattr(tokenizer, "get_vocab"):
        tok_hash = hashlib.sha256(
            json.dumps(sorted(tokenizer.get_vocab().items())).encode()
        ).hexdigest()
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = json.dumps(template, sort_keys=True)
    return {
        "tokenizer_sha256": tok_hash,
        "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
    }


# ---------------------------------------------------------------------------------------------
# The shard plan
# ---------------------------------------------------------------------------------------------


@dataclass
class ShardPlan:
    index: int
    num_shards: int
    path: Path  # the plan file: the shard's sequences, one JSON line each
    content_hash: str  # sha256 over the shard's ids and masks
    num_sequences: int
    num_tokens: int
    provenance: dict[str, Any] = field(default_factory=dict)  # tokenizer hashes etc., for manifests

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}"


def write_shard_plans(
    samples: list[TokenizedSample],
    num_shards: int,
    plan_dir: str | Path,
    info: dict[str, Any] | None = None,
) -> list[ShardPlan]:
    """Split samples into contiguous shards by index and write one plan file per shard.

    plan.json (written after the shard files) lists the shards and carries `info` (provenance, data
    stats); plan files of an earlier, larger plan in the folder are deleted after it.
    """
    plan_dir = Path(plan_dir)
    num_shards = max(1, min(num_shards, len(samples)))
    bounds = [round(k * len(samples) / num_shards) for k in range(num_shards + 1)]
    info = dict(info or {})
    plans = []
    for k in range(num_shards):
        chunk = samples[bounds[k] : bounds[k + 1]]
        lines = [
            json.dumps({"input_ids": s.input_ids, "loss_mask": s.loss_mask}, separators=(",", ":"))
            for s in chunk
        ]
        digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
        path = plan_dir / f"shard-{k:05d}.plan.jsonl"
        if not path.exists() or plan_file_hash(path) != digest:
            write_text_atomic(path, "\n".join(lines) + "\n")
        plans.append(
            ShardPlan(
                k,
                num_shards,
                path,
                digest,
                len(chunk),
                sum(len(s.input_ids) for s in chunk),
                info.get("provenance", {}),
            )
        )
    write_json_atomic(
        plan_dir / "plan.json",
        {"format": PLAN_FORMAT, **info, "shards": [_plan_json(p) for p in plans]},
    )
    # A plan of fewer shards into the same folder: the index (replaced above) no longer names the
    # old plan's higher shards; delete their files, and only eyas's own plan files.
    for old in plan_dir.glob("shard-*.plan.jsonl"):
        m = _PLAN_FILE.fullmatch(old.name)
        if m and int(m.group(1)) >= num_shards:
            old.unlink(missing_ok=True)
    return plans


def read_shard_plan(path: str | Path) -> list[TokenizedSample]:
    return [
        TokenizedSample(**json.loads(line)) for line in Path(path).read_text().splitlines() if line
    ]


def read_plan_index(plan_dir: str | Path) -> dict[str, Any]:
    """plan.json: {"format", "shards": [...], provenance, stats}; a list in plans before
    eyas-plan/1."""
    raw = json.loads((Path(plan_dir) / "plan.json").read_text())
    return {"format": None, "shards": raw} if isinstance(raw, list) else raw


def plan_file_hash(path: str | Path) -> str:
    """The content hash of a plan file, as write_shard_plans computes it."""
    return hashlib.sha256(Path(path).read_text().rstrip("\n").encode()).hexdigest()


def _plan_json(p: ShardPlan) -> dict[str, Any]:
    return {
        "index": p.index,
        "name": p.name,
        "path": str(p.path),
        "content_hash": p.content_hash,
        "num_sequences": p.num_sequences,
        "num_tokens": p.num_tokens,
    }
