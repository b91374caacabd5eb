"""Continuous batching for the local server's plain decoding, as SGLang batches running requests.

    batch = DecodeBatch(model, lock, max_running=8)
    output, finish = batch.decode(Sequence(logits, cache, length, max_new, temperature, stop_ids,
    gen))

Each request is prefilled on its own (so its hidden states are dumped exactly as before); the
sequence then joins the running batch and one forward per step decodes every running sequence.
On 2 CPU cores one step of 8 sequences costs about 1.5x a step of one, so a server with many
requests in flight (the regeneration of training replies) answers several times faster.

The batch keeps one KV cache, left-padded to its longest sequence; an attention mask hides the
padding and each row gets its own positions, so a row's logits match decoding it alone up to
floating-point rounding. The cache is laid out anew only when sequences join or leave.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache


@dataclass
class Think:
    """The reasoning span a reply carries when the server plays a thinking model (--think-tokens N).

    A reply that starts inside an open <think> (the chat template opened it) reasons for `budget`
    tokens, then </think> is forced and the answer follows, as a thinking budget ends reasoning; a
    reply whose prompt has not just closed one (thinking off) opens its own <think> first. Inside
    the span the stop tokens and <think> are never sampled, so every reply carries one, cut only by
    max_new_tokens.
    """

    start_id: int
    end_id: int
    budget: int
    state: str  # "open": <think> comes next; "in": reasoning; "done": answering
    count: int = 0  # reasoning tokens emitted (between the tags)

    @classmethod
    def plan(cls, prompt: list[int], start_id: int, end_id: int, budget: int) -> "Think | None":
        """How a reply to `prompt` reasons; None when the prompt ends in </think> (thinking off)."""
        last = max((i for i, t in enumerate(prompt) if t in (start_id, end_id)), default=-1)
        if last >= 0 and prompt[last] == start_id:
            return cls(start_id, end_id, budget, "in")
        if (
            last == len(prompt) - 1
        ):  # closed right before the reply: the template turned thinking off
            return None
        return cls(start_id, end_id, budget, "open")

    def forced(self) -> int | None:
        if self.state == "open":
            return self.start_id
        if self.state == "in" and self.count >= self.budget:
            return self.end_id
        return None

    def banned(self, stop_ids: set[int]) -> list[int]:
        return sorted(stop_ids | {self.start_id}) if self.state == "in" else []

    def advance(self, token: int) -> None:
        if self.state == "open":
            self.state = "in"
        elif self.state == "in":
            if token == self.end_id:
                self.state = "done"
            else:
                self.count += 1


@dataclass
class Sequence:
    """One request after its prefill: the logits of its last prompt token and its KV cache."""

    logits: torch.Tensor  # (V,) the next token's logits
    cache: Any  # DynamicCache of batch 1 over `length` tokens
    length: int  # prompt tokens in the cache
    max_new: int
    temperature: float
    stop_ids: set[int]
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    think: Think | None = None  # --think-tokens: the reply's reasoning span

    def take(self, logits: torch.Tensor) -> bool:
        """Append the token these logits choose; True when the sequence is finished."""
        token = self.think.forced() if self.think is not None else None
        if token is None:
            if self.think is not None and self.think.banned(self.stop_ids):
                logits = logits.clone()
                logits[self.think.banned(self.stop_ids)] = float("-inf")
            if self.temperature == 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits.float() / self.temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=self.generator))
        if self.think is not None:
            self.think.advance(token)
        self.output.append(token)
        if token in self.stop_ids:
            self.finish = {"type": "stop", "matched": token}
        elif len(self.output) >= self.max_new:
            self.finish = {"type": "length", "length": self.max_new}
        return self.finish is not None


def _layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_left(x: torch.Tensor, width: int) -> torch.Tensor:  # (B, h, S, d) -> (B, h, width, d)
    if x.shape[2] == width:
        return x
    pad = x.new_zeros(x.shape[0], x.shape[1], width - x.shape[2], x.shape[3])
    return torch.cat([pad, x], dim=2)


class DecodeBatch:
    """Runs decode steps for every joined sequence together, in one background thread."""

    def __init__(self, model: torch.nn.Module, lock: threading.Lock, max_running: int):
        self.model, self.lock, self.max_running = model, lock, max_running
        self.steps = self.tokens = (
            0  # forwards run, tokens they decoded (tokens / steps = mean batch)
        )
        self._waiting: list[Sequence] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="eyas-decode", daemon=True)
        self._thread.start()

    def decode(self, seq: Sequence) -> tuple[list[int], dict[str, Any]]:
        """The first token from the prefill's logits, the rest in the running batch."""
        with self.lock:  # the generator may be shared with rows the decode thread samples
            finished = seq.take(seq.logits)
        if not finished:
            with self._changed:
                self._waiting.append(seq)
                self._changed.notify()
            seq.done.wait()
            if seq.error is not None:
                raise seq.error
        return seq.output, seq.finish

    # ------------------------------------------------------------------ the decode thread

    def _loop(self) -> None:
        rows: list[Sequence] = []
        cache, mask = (
            None,
            _EMPTY,
        )  # one DynamicCache, rows left-padded; mask (B, S): 1 at real tokens
        while True:
            with self._changed:
                while not rows and not self._waiting:
                    self._changed.wait()
                joining = self._waiting[: self.max_running - len(rows)]
                del self._waiting[: len(joining)]
            try:
                with self.lock:  # prefills of new requests run between steps
                    if joining:
                        rows, cache, mask = _join(rows, cache, mask, joining)
                        joining = []
                    mask, finished = self._step(rows, cache, mask)
                if finished:
                    done = [rows[i] for i in finished]
                    rows, cache, mask = _keep(
                        rows, cache, mask, [i for i in range(len(rows)) if i not in finished]
                    )
                    for seq in done:
                        seq.done.set()
            except BaseException as e:  # noqa: BLE001 - every request in hand gets the error, none hangs
                for seq in rows + joining:
                    seq.error = e
                    seq.done.set()
                rows, cache, mask = [], None, _EMPTY

    @torch.no_grad()
    def _step(self, rows: list[Sequence], cache, mask):
        """One forward over every row's last token (the cache grows in place) -> (mask, finished
        rows)."""
        tokens = torch.tensor([[seq.output[-1]] for seq in rows])  # (B, 1)
        positions = torch.tensor([[seq.length + len(seq.output) - 1] for seq in rows])  # (B, 1)
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long)], dim=1)  # (B, S + 1)
        out = self.model(
            input_ids=tokens,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
        self.steps, self.tokens = self.steps + 1, self.tokens + len(rows)
        finished = set()
        for i, seq in enumerate(rows):
            try:
                if seq.take(out.logits[i, -1]):
                    finished.add(i)
            except Exception as e:  # noqa: BLE001 - one request's bad sampling fails that request only
                seq.error = e
                finished.add(i)
        return mask, finished


_EMPTY = torch.zeros(0, 0, dtype=torch.long)


def _cache(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache()
    for i, (k, v) in enumerate(layers):
        cache.update(k, v, i)
    return cache


def _join(rows, cache, mask, joining: list[Sequence]):
    """Lay the cache out again with the new sequences as extra rows, all left-padded to one
    width."""
    width = max([mask.shape[1]] + [seq.length for seq in joining])
    parts = ([_layers(cache)] if rows else []) + [_layers(seq.cache) for seq in joining]
    layers = [
        (
            torch.cat([_pad_left(p[i][0], width) for p in parts]),
            torch.cat([_pad_left(p[i][1], width) for p in parts]),
        )
        for i in range(len(parts[0]))
    ]
    masks = [F.pad(mask, (width - mask.shape[1], 0))] if rows else []
    masks += [
        F.pad(torch.ones(1, seq.length, dtype=torch.long), (width - seq.length, 0))
        for seq in joining
    ]
    for seq in joining:
        seq.cache = None  # the batch holds it now
    return rows + joining, _cache(layers), torch.cat(masks)


def _keep(rows, cache, mask, keep: list[int]):
    """Drop finished rows, and the leading columns that are padding in every row left."""
    if not keep:
        return [], None, _EMPTY
    index = torch.tensor(keep)
    mask = mask[index]
    start = int((mask.cumsum(1) == 0).sum(1).min())  # padding columns common to all rows
    layers = [(k[index, :, start:], v[index, :, start:]) for k, v in _layers(cache)]
    return [rows[i] for i in keep], _cache(layers), mask[:, start:]
