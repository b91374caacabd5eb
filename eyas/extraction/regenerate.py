"""Regenerate the assistant turns of the training conversations with the target itself.

    with ServerPool([Endpoint(url, dump_dir, 4)]) as pool:
        path, summary = regenerate(records, tokenizer, pool, out_dir, RegenerateConfig(enabled=True),
                                   target="/models/Kimi-K2.5@main", max_length=4096)
    records, _ = load_records(path)         # then prepare and extract as usual

Training on the target's own responses is the largest lever on acceptance (docs/training.md, Quality): the drafter
learns the distribution it will be asked to predict. Each assistant turn is replaced, in order, by
the target's answer to the conversation so far (earlier turns already regenerated), through
/generate with the configured sampling (greedy by default; a seed per conversation and turn when
sampling, so a rerun asks the same). Requests are never dumped (rid prefix `WARMUP_regen-`: the
dump hook skips it), so a server launched for extraction serves them as they are.

A thinking (reasoning) target (`data.regenerate.thinking` true or false): the chat template's
switch (`thinking_kwarg`, Kimi-K2.5's `thinking`) is passed on or off as the target is served, and
each reply is kept as the token ids the server emitted, its `<think>...</think>` span included:
the output is pre-tokenized records `{"input_ids", "loss_mask"}`, the prompt sent (loss 0) then the
reply (loss 1), never decoded and encoded again. Later turns are asked with the earlier answers in
the history, rendered by the template as it renders history (Kimi-K2.5 keeps an earlier turn's
answer and drops its reasoning to an empty `<think></think>`), so a turn whose prompt no longer
starts with the ids of the turn before starts a new record: every generated token is trained once,
after exactly the ids the target saw. Where the history does extend the earlier record (thinking
off: the answer renders as it was emitted), the turns share one record, as a conversation does
without thinking. `thinking: null` (a model that does not think) keeps replies as text.

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

from eyas.extraction.client import ServerPool
from eyas.config import RegenerateConfig
from eyas.extraction.data import Record, _render
from eyas.extraction.shards import write_json_atomic

FORMAT = "eyas-regen/1"
RID_PREFIX = "WARMUP_regen-"  # the dump writer skips WARMUP* rids: nothing is dumped for these
# A thinking target's reasoning span, as Kimi-K2.5, DeepSeek-R1/V3.1 and Qwen3 spell it; each must be
# one token (SGLang's reasoning parser finds the end by its single id too).
THINK_START, THINK_END = "<think>", "</think>"


class RegenerationError(RuntimeError):
    """A conversation could not be regenerated; names the part and the input line."""


@dataclass(frozen=True)
class RegenerationProgress:
    """Figures of one regeneration so far."""

    parts_done: int
    num_parts: int
    done: int        # conversations (records) answered, or found in finished parts
    total: int
    reused: int      # of `done`: in parts an earlier run finished
    tokens: int      # tokens the target generated in this run
    seconds: float   # since this run began

    @property
    def percent(self) -> float:
        return round(100.0 * self.done / max(self.total, 1), 2)

    @property
    def tokens_per_s(self) -> float | None:
        return round(self.tokens / self.seconds, 1) if self.seconds >= 1.0 and self.tokens else None

    @property
    def eta_s(self) -> float | None:
        new = self.done - self.reused  # none before a rate is known (the tokens' rate, as shown beside it)
        return round((self.total - self.done) * self.seconds / new, 1) if new > 0 and self.tokens_per_s else None

    def describe(self) -> str:
        rate = f"{self.tokens_per_s:,.0f} tok/s" if self.tokens_per_s else "- tok/s"
        eta = f"ETA {self.eta_s:.0f}s" if self.eta_s is not None else "ETA -"
        return (f"{self.parts_done}/{self.num_parts} parts, {self.done}/{self.total} conversations "
                f"({self.reused} reused), {self.tokens:,} tokens generated, {rate}, {eta}")


class _Progress:
    """Counts RegenerationProgress from the worker threads and hands each snapshot to on_progress."""

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
        return RegenerationProgress(self.parts, self.num_parts, self.done, self.total, self.reused, self.tokens,
                                    time.monotonic() - self.t0)

    def _tell(self, snapshot: RegenerationProgress) -> None:
        if self.on_progress is not None:
            self.on_progress(snapshot)


def _record_json(r: Record) -> str:
    if r.messages is not None:
        return json.dumps({"messages": r.messages}, ensure_ascii=False, separators=(",", ":"))
    return json.dumps({"input_ids": r.tokens.input_ids, "loss_mask": r.tokens.loss_mask}, separators=(",", ":"))


def part_bounds(n: int, num_parts: int) -> list[tuple[int, int]]:
    num_parts = max(1, min(num_parts, n))
    b = [round(k * n / num_parts) for k in range(num_parts + 1)]
    return list(zip(b, b[1:]))


def turn_end_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: the template's closing special token, and EOS."""
    probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    full = _render(tokenizer, probe, add_generation_prompt=False)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    # all_special_ids holds only the named ones (bos/eos/pad...): a chat token such as <|end|> is an
    # added token marked special, and is the turn's end all the same (else a reply runs past it).
    special |= {i for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                if getattr(t, "special", False)}
    ids = [full[-1]] if full and full[-1] in special else []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return sorted(set(ids))


def _seed(conv_index: int, turn: int, base: int) -> int:
    return int(hashlib.sha256(f"{base}:{conv_index}:{turn}".encode()).hexdigest()[:8], 16)


# ---------------------------------------------------------------------------------------------
# A thinking target: the template's switch, the reasoning span, records of the server's own ids
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Thinking:
    """How a thinking target is asked: the template keyword and its value, and the span's token ids."""

    kwargs: dict[str, bool]  # passed to the chat template, e.g. {"thinking": False}
    start_id: int            # <think>
    end_id: int              # </think>


def thinking_for(tokenizer, cfg: RegenerateConfig) -> Thinking | None:
    """The thinking switch as `cfg` sets it, checked against the template; None for `thinking: null`.

    Refused with a RegenerationError naming the setting: a template that renders the same generation
    prompt with the switch on and off (it has no such switch: the wrong `thinking_kwarg`, or not a
    thinking model), or a tokenizer without <think> and </think> as single tokens.
    """
    if cfg.thinking is None:
        return None
    name = cfg.thinking_kwarg
    probe = [{"role": "user", "content": "a"}]
    try:
        on = _render_kw(tokenizer, probe, True, {name: True})
        off = _render_kw(tokenizer, probe, True, {name: False})
    except Exception as e:  # noqa: BLE001 - the template's own error, with the setting that led to it
        raise RegenerationError(f"data.regenerate.thinking: the chat template fails with {name}=True/False "
                                f"({type(e).__name__}: {e})") from e
    if on == off:
        raise RegenerationError(
            f"data.regenerate.thinking is {cfg.thinking}, but the chat template renders the same generation "
            f"prompt with {name}=True and {name}=False: it has no switch named {name!r} (set "
            f"data.regenerate.thinking_kwarg to the template's name for it, or thinking to null for a target "
            f"that does not think)")
    ids = []
    for tag in (THINK_START, THINK_END):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise RegenerationError(f"data.regenerate.thinking: the tokenizer spells {tag} as {len(encoded)} "
                                    f"tokens {encoded}, not one: eyas finds the reasoning span by its tags' ids")
        ids.append(int(encoded[0]))
    return Thinking({name: bool(cfg.thinking)}, ids[0], ids[1])


def _render_kw(tokenizer, messages, add_generation_prompt: bool, kwargs: dict) -> list[int]:
    """eyas.extraction.data._render with the template keywords (the thinking switch) passed on."""
    if not kwargs:
        return _render(tokenizer, messages, add_generation_prompt=add_generation_prompt)
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                        **kwargs)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def split_reasoning(prompt: list[int], output: list[int], th: Thinking) -> tuple[list[int] | None, list[int], bool]:
    """(reasoning ids or None, answer ids, reasoning finished) of one reply.

    The reply reasons when the prompt ends inside an open <think> (the template opened it, as
    Kimi-K2.5's does with thinking on) or the reply opens one itself; the reasoning runs to the
    first </think>, and the tags belong to neither part. A reply cut before </think> is all
    reasoning, unfinished. A prompt ending in </think> (thinking off) is answered without reasoning.
    """
    last = max((i for i, t in enumerate(prompt) if t in (th.start_id, th.end_id)), default=-1)
    start = 0
    if not (last >= 0 and prompt[last] == th.start_id):
        if not output or output[0] != th.start_id:
            return None, list(output), True
        start = 1
    if th.end_id not in output[start:]:
        return list(output[start:]), [], False
    end = output.index(th.end_id, start)
    return list(output[start:end]), list(output[end + 1:]), True


def _ask(pool: ServerPool, prompt: list[int], conv_index: int, j: int, cfg: RegenerateConfig,
         stop_ids: list[int], max_length: int, where: str):
    """The target's reply to turn j of conversation conv_index (a Reply), within max_length."""
    params = {"max_new_tokens": min(cfg.max_new_tokens, max_length - len(prompt)),
              "temperature": cfg.temperature, "stop_token_ids": stop_ids}
    if cfg.temperature > 0:
        params["sampling_seed"] = _seed(conv_index, j, cfg.seed)
    try:
        return pool.generate(prompt, f"{RID_PREFIX}{conv_index:07d}-{j:03d}", params).result()
    except Exception as e:  # noqa: BLE001 - named with the line it came from
        raise RegenerationError(f"{where}: turn {j}: {e}") from e


def regenerate_conversation_ids(messages: list[dict], conv_index: int, tokenizer, pool: ServerPool,
                                cfg: RegenerateConfig, th: Thinking, stop_ids: list[int], max_length: int,
                                where: str) -> tuple[list[dict], dict[str, int]]:
    """Each assistant turn answered again by a thinking target, kept as the server's token ids.

    Returns the records ({"input_ids", "loss_mask"}: the prompt sent, loss 0, then the reply as
    emitted, loss 1) and the counts. A turn whose prompt starts with the current record's ids
    extends that record; otherwise the record is closed and the turn starts the next one.
    """
    history: list[dict] = []
    records: list[dict] = []
    ids: list[int] = []
    mask: list[int] = []
    counts = {"regenerated_turns": 0, "kept_original_turns": 0, "dropped_turns": 0, "generated_tokens": 0,
              "reasoning_tokens": 0, "unfinished_reasoning_turns": 0, "server_reasoning_tokens": 0,
              "server_reasoning_replies": 0}

    def close() -> None:
        if any(mask):
            records.append({"input_ids": list(ids), "loss_mask": list(mask)})

    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            history.append(dict(m))
            continue
        prompt = _render_kw(tokenizer, history, True, th.kwargs)
        if len(prompt) >= max_length:  # nothing of this turn would fit
            counts["dropped_turns"] += sum(x["role"] == "assistant" for x in messages[j:])
            break
        reply = _ask(pool, prompt, conv_index, j, cfg, stop_ids, max_length, where)
        output = [int(t) for t in reply.body.get("output_ids") or []]
        served = (reply.body.get("meta_info") or {}).get("reasoning_tokens")
        if isinstance(served, int) and not isinstance(served, bool):  # SGLang with a reasoning parser
            counts["server_reasoning_tokens"] += served
            counts["server_reasoning_replies"] += 1
        if not output:  # nothing to train on; the dataset's answer stands in the history
            history.append(dict(m))
            counts["kept_original_turns"] += 1
            continue
        if ids and prompt[:len(ids)] == ids:  # the history renders the record so far as it was emitted
            mask += [0] * (len(prompt) - len(ids))
        else:
            close()
            mask = [0] * len(prompt)
        ids = prompt + output
        mask += [1] * len(output)
        counts["regenerated_turns"] += 1
        counts["generated_tokens"] += len(output)
        reasoning, answer, finished = split_reasoning(prompt, output, th)
        counts["reasoning_tokens"] += len(reasoning or [])
        counts["unfinished_reasoning_turns"] += not finished
        text = tokenizer.decode(answer, skip_special_tokens=True)
        if not text.strip():  # cut inside its reasoning: the dataset's answer stands in later turns' history
            history.append(dict(m))
            continue
        turn = {"role": "assistant", "content": text}
        if reasoning is not None:  # as a chat client sends it back; the template decides what to keep
            turn["reasoning_content"] = tokenizer.decode(reasoning, skip_special_tokens=True)
        history.append(turn)
    close()
    return records, counts


def regenerate_conversation(messages: list[dict], conv_index: int, tokenizer, pool: ServerPool,
                            cfg: RegenerateConfig, stop_ids: list[int], max_length: int,
                            where: str) -> tuple[list[dict], dict[str, int]]:
    """The conversation with each assistant turn answered again by the target, in order."""
    out: list[dict] = []
    counts = {"regenerated_turns": 0, "kept_original_turns": 0, "dropped_turns": 0, "generated_tokens": 0}
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            out.append(dict(m))
            continue
        prompt = _render(tokenizer, out, add_generation_prompt=True)
        if len(prompt) >= max_length:  # nothing of this turn would survive truncation
            counts["dropped_turns"] += sum(x["role"] == "assistant" for x in messages[j:])
            break
        reply = _ask(pool, prompt, conv_index, j, cfg, stop_ids, max_length, where)
        output_ids = reply.body.get("output_ids") or []
        counts["generated_tokens"] += len(output_ids)
        text = tokenizer.decode(output_ids, skip_special_tokens=True)
        if text.strip():
            out.append({"role": "assistant", "content": text})
            counts["regenerated_turns"] += 1
        else:  # an empty answer would make an empty (untrainable) turn
            out.append(dict(m))
            counts["kept_original_turns"] += 1
    if not any(x["role"] == "assistant" for x in out):
        out = [dict(m) for m in messages]  # not even the first turn fits: keep it for truncation
        counts["kept_original_turns"] += 1
    return out, counts


def regenerate(records: list[Record], tokenizer, pool: ServerPool, out_dir: str | Path, cfg: RegenerateConfig, *,
               target: str, max_length: int, passthrough: list[Record] = (),
               on_part: Callable[[int, int, dict], None] | None = None,
               on_progress: Callable[[RegenerationProgress], None] | None = None) -> tuple[Path, dict[str, Any]]:
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
    manifests = []
    for k, (a, b) in enumerate(bounds):
        input_hash = _input_hash(records[a:b])
        path, mpath = out_dir / f"part-{k:05d}.jsonl", out_dir / f"part-{k:05d}.json"
        done = _finished_part(out_dir, k, input_hash, params)
        if done is not None:
            manifests.append({**done, "reused": True})
            progress.part(b - a, reused=True)
            if on_part:
                on_part(k, len(bounds), manifests[-1])
            continue
        manifests.append(_regenerate_part(records, a, b, k, len(bounds), tokenizer, pool, cfg, stop_ids, max_length,
                                          params, input_hash, path, mpath, progress, th))
        progress.part(b - a, reused=False)
        if on_part:
            on_part(k, len(bounds), manifests[-1])
    combined = out_dir / "regenerated.jsonl"
    tmp = combined.with_name(f".{combined.name}.tmp")
    with open(tmp, "wb") as f:
        for k in range(len(bounds)):
            f.write((out_dir / f"part-{k:05d}.jsonl").read_bytes())
        for r in passthrough:
            f.write((_record_json(r) + "\n").encode())
    tmp.replace(combined)
    summary = {"format": FORMAT, "parts": len(bounds), "params": params,
               **{key: sum(m[key] for m in manifests) for key in
                  ("records", "conversations", "regenerated_turns", "kept_original_turns", "dropped_turns",
                   "output_tokens")},
               "parts_reused": sum(bool(m.get("reused")) for m in manifests), "passed_through": len(passthrough),
               **_thinking_summary(cfg, manifests)}
    write_json_atomic(out_dir / "regenerate.json", summary)
    return combined, summary


def pending_parts(records: list[Record], tokenizer, out_dir: str | Path, cfg: RegenerateConfig, *, target: str,
                  max_length: int) -> list[int]:
    """The parts `regenerate` would still ask the target for (empty: no server needed).

    A thinking switch the template does not have is refused here, before a server is launched."""
    thinking_for(tokenizer, cfg)
    params = _params(cfg, turn_end_ids(tokenizer), max_length, target)
    return [k for k, (a, b) in enumerate(part_bounds(len(records), cfg.num_parts))
            if _finished_part(Path(out_dir), k, _input_hash(records[a:b]), params) is None]


def _params(cfg: RegenerateConfig, stop_ids: list[int], max_length: int, target: str) -> dict:
    params = {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "seed": cfg.seed,
              "stop_token_ids": stop_ids, "max_length": max_length, "target": target}
    if cfg.thinking is not None:  # only then: parts a target without thinking finished stay reusable
        params["thinking"] = {cfg.thinking_kwarg: cfg.thinking}
    return params


def _thinking_summary(cfg: RegenerateConfig, manifests: list[dict]) -> dict[str, Any]:
    """The reasoning figures of a regeneration (report.json's `regeneration`): reasoning tokens are
    counted from the replies' ids (between <think> and </think>); server_reasoning_tokens is SGLang's own
    meta_info figure where the server reported one (a --reasoning-parser launch), else None."""
    if cfg.thinking is None:
        return {"thinking": None, "reasoning_tokens": 0}
    total = {key: sum(m.get(key, 0) for m in manifests) for key in
             ("sequences", "reasoning_tokens", "unfinished_reasoning_turns", "server_reasoning_tokens",
              "server_reasoning_replies")}
    return {"thinking": cfg.thinking, "sequences": total["sequences"], "reasoning_tokens": total["reasoning_tokens"],
            "unfinished_reasoning_turns": total["unfinished_reasoning_turns"],
            "server_reasoning_tokens": total["server_reasoning_tokens"] if total["server_reasoning_replies"] else None}


def _input_hash(records: list[Record]) -> str:
    return hashlib.sha256("\n".join(_record_json(r) for r in records).encode()).hexdigest()


def _finished_part(out_dir: Path, k: int, input_hash: str, params: dict) -> dict | None:
    """Part k's manifest when it was made from these inputs and its file is intact, else None."""
    path, done = out_dir / f"part-{k:05d}.jsonl", _read_json(out_dir / f"part-{k:05d}.json")
    if (done and done.get("input_sha256") == input_hash and done.get("params") == params and path.exists()
            and hashlib.sha256(path.read_bytes()).hexdigest() == done.get("output_sha256")):
        return done
    return None


def _regenerate_part(records, a, b, k, num_parts, tokenizer, pool, cfg, stop_ids, max_length, params, input_hash,
                     path: Path, mpath: Path, progress: _Progress, th: Thinking | None = None) -> dict:
    t0 = time.monotonic()
    counts = {"regenerated_turns": 0, "kept_original_turns": 0, "dropped_turns": 0}
    if th is not None:
        counts.update(reasoning_tokens=0, unfinished_reasoning_turns=0, server_reasoning_tokens=0,
                      server_reasoning_replies=0)
    lock = threading.Lock()
    generated = [0]  # thinking: the replies' tokens written (the loss-1 ids of the records)

    def one(i: int) -> list[str]:
        r = records[i]
        if r.messages is None:
            progress.conversation(0)
            return [_record_json(r)]
        if th is not None:
            out, c = regenerate_conversation_ids(r.messages, i, tokenizer, pool, cfg, th, stop_ids, max_length,
                                                 f"part {k} ({r.where})")
            lines = [json.dumps(x, separators=(",", ":")) for x in out]
        else:
            messages, c = regenerate_conversation(r.messages, i, tokenizer, pool, cfg, stop_ids, max_length,
                                                  f"part {k} ({r.where})")
            lines = [json.dumps({"messages": messages}, ensure_ascii=False, separators=(",", ":"))]
        made = c.pop("generated_tokens")
        progress.conversation(made)
        with lock:
            for key, v in c.items():
                counts[key] += v
            generated[0] += made
        return lines

    # Turns of one conversation are sequential; conversations run side by side up to the pool's width.
    with ThreadPoolExecutor(max(1, pool.capacity)) as ex:
        lines = [line for out in ex.map(one, range(a, b)) for line in out]
    text = ("\n".join(lines) + "\n").encode() if lines else b""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(text)
    tmp.replace(path)
    if th is not None:
        output_tokens = generated[0]
        counts["sequences"] = len(lines)
    else:
        output_tokens = 0
        for line in lines:
            for m in json.loads(line).get("messages", []):
                if m["role"] == "assistant":
                    output_tokens += len(tokenizer.encode(m["content"], add_special_tokens=False))
    manifest = {"format": FORMAT, "part": k, "num_parts": num_parts, "records": b - a,
                "conversations": sum(records[i].messages is not None for i in range(a, b)),
                "input_sha256": input_hash, "output_sha256": hashlib.sha256(text).hexdigest(), "params": params,
                "output_tokens": output_tokens, "seconds": round(time.monotonic() - t0, 3), **counts}
    write_json_atomic(mpath, manifest)
    return manifest


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
