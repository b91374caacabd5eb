"""One conversation's assistant turns answered again by the target, in order (regenerate.py runs
them over resumable parts).

Each assistant turn is replaced by the target's answer to the conversation so far (earlier turns
already regenerated), through /generate with the configured sampling (greedy by default; a seed per
conversation and turn when sampling, so a rerun asks the same). Requests are never dumped (rid
prefix `WARMUP_regen-`: the dump hook skips it), so a server launched for extraction serves them as
they are.

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
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from eyas.config import RegenerateConfig
from eyas.errors import EyasError
from eyas.extraction.client import ServerPool
from eyas.extraction.data import render_chat

RID_PREFIX = "WARMUP_regen-"  # the dump writer skips WARMUP* rids: nothing is dumped for these
# A thinking target's reasoning span, as Kimi-K2.5, DeepSeek-R1/V3.1 and Qwen3 spell it; each must
# be one token (SGLang's reasoning parser finds the end by its single id too).
THINK_START, THINK_END = "<think>", "</think>"


class RegenerationError(EyasError, RuntimeError):
    """A conversation could not be regenerated; names the part and the input line."""

    retryable = True  # resumable by part: a retry asks only for the parts not yet on disk


def turn_end_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: the template's closing special token, and EOS."""
    probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    full = render_chat(tokenizer, probe, add_generation_prompt=False)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    # all_special_ids holds only the named ones (bos/eos/pad...): a chat token such as <|end|> is an
    # added token marked special, and is the turn's end all the same (else a reply runs past it).
    special |= {
        i
        for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
        if getattr(t, "special", False)
    }
    ids = [full[-1]] if full and full[-1] in special else []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    return sorted(set(ids))


def _seed(conv_index: int, turn: int, base: int) -> int:
    return int(hashlib.sha256(f"{base}:{conv_index}:{turn}".encode()).hexdigest()[:8], 16)


@dataclass(frozen=True)
class Thinking:
    """How a thinking target is asked: the template keyword and its value, and the span's token
    ids."""

    kwargs: dict[str, bool]  # passed to the chat template, e.g. {"thinking": False}
    start_id: int  # <think>
    end_id: int  # </think>


def thinking_for(tokenizer, cfg: RegenerateConfig) -> Thinking | None:
    """The thinking switch as `cfg` sets it, checked against the template; None for `thinking:
    null`.

    Refused with a RegenerationError naming the setting: a template that renders the same generation
    prompt with the switch on and off (it has no such switch: the wrong `thinking_kwarg`, or not a
    thinking model), or a tokenizer without <think> and </think> as single tokens.
    """
    if cfg.thinking is None:
        return None
    name = cfg.thinking_kwarg
    probe = [{"role": "user", "content": "a"}]
    try:
        on = render_chat(tokenizer, probe, add_generation_prompt=True, **{name: True})
        off = render_chat(tokenizer, probe, add_generation_prompt=True, **{name: False})
    except Exception as e:  # noqa: BLE001 - the template's own error, with the setting that led to it
        raise RegenerationError(
            f"data.regenerate.thinking: the chat template fails with {name}=True/False "
            f"({type(e).__name__}: {e})"
        ) from e
    if on == off:
        raise RegenerationError(
            f"data.regenerate.thinking is {cfg.thinking}, but the chat template renders the same "
            f"generation "
            f"prompt with {name}=True and {name}=False: it has no switch named {name!r} (set "
            f"data.regenerate.thinking_kwarg to the template's name for it, or thinking to null "
            f"for a target that does not think)"
        )
    ids = []
    for tag in (THINK_START, THINK_END):
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        if len(encoded) != 1:
            raise RegenerationError(
                f"data.regenerate.thinking: the tokenizer spells {tag} as {len(encoded)} "
                f"tokens {encoded}, not one: eyas finds the reasoning span by its tags' ids"
            )
        ids.append(int(encoded[0]))
    return Thinking({name: bool(cfg.thinking)}, ids[0], ids[1])


def split_reasoning(
    prompt: list[int], output: list[int], th: Thinking
) -> tuple[list[int] | None, list[int], bool]:
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
    return list(output[start:end]), list(output[end + 1 :]), True


def _ask(
    pool: ServerPool,
    prompt: list[int],
    conv_index: int,
    j: int,
    cfg: RegenerateConfig,
    stop_ids: list[int],
    max_length: int,
    where: str,
):
    """The target's reply to turn j of conversation conv_index (a Reply), within max_length."""
    params = {
        "max_new_tokens": min(cfg.max_new_tokens, max_length - len(prompt)),
        **cfg.sampling(),
        "stop_token_ids": stop_ids,
    }
    if params["temperature"] > 0:
        params["sampling_seed"] = _seed(conv_index, j, cfg.seed)
    try:
        return pool.generate(prompt, f"{RID_PREFIX}{conv_index:07d}-{j:03d}", params).result()
    except Exception as e:  # noqa: BLE001 - named with the line it came from
        raise RegenerationError(f"{where}: turn {j}: {e}") from e


class _Records:
    """A thinking conversation's records: a turn whose prompt starts with the current record's ids
    extends that record; otherwise the record is closed and the turn starts the next one."""

    def __init__(self):
        self.closed: list[dict] = []  # {"input_ids", "loss_mask"}
        self.ids: list[int] = []
        self.mask: list[int] = []

    def add(self, prompt: list[int], output: list[int]) -> None:
        """One turn: the prompt (loss 0) where the record lacks it, then the reply (loss 1)."""
        if self.ids and prompt[: len(self.ids)] == self.ids:  # the record so far, as emitted
            self.mask += [0] * (len(prompt) - len(self.ids))
        else:
            self.close()
            self.mask = [0] * len(prompt)
        self.ids = prompt + output
        self.mask += [1] * len(output)

    def close(self) -> None:
        if any(self.mask):
            self.closed.append({"input_ids": list(self.ids), "loss_mask": list(self.mask)})


def regenerate_conversation_ids(
    messages: list[dict],
    conv_index: int,
    tokenizer,
    pool: ServerPool,
    cfg: RegenerateConfig,
    th: Thinking,
    stop_ids: list[int],
    max_length: int,
    where: str,
) -> tuple[list[dict], dict[str, int]]:
    """Each assistant turn answered again by a thinking target, kept as the server's token ids.

    Returns the records ({"input_ids", "loss_mask"}: the prompt sent, loss 0, then the reply as
    emitted, loss 1) and the counts. A turn whose prompt starts with the current record's ids
    extends that record; otherwise the record is closed and the turn starts the next one.
    """
    history: list[dict] = []
    records = _Records()
    counts = {
        "regenerated_turns": 0,
        "kept_original_turns": 0,
        "dropped_turns": 0,
        "generated_tokens": 0,
        "reasoning_tokens": 0,
        "unfinished_reasoning_turns": 0,
        "server_reasoning_tokens": 0,
        "server_reasoning_replies": 0,
    }

    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            history.append(dict(m))
            continue
        prompt = render_chat(tokenizer, history, add_generation_prompt=True, **th.kwargs)
        if len(prompt) >= max_length:  # nothing of this turn would fit
            counts["dropped_turns"] += sum(x["role"] == "assistant" for x in messages[j:])
            break
        reply = _ask(pool, prompt, conv_index, j, cfg, stop_ids, max_length, where)
        output = [int(t) for t in reply.body.get("output_ids") or []]
        _count_server_reasoning(counts, reply.body)
        if not output:  # nothing to train on; the dataset's answer stands in the history
            history.append(dict(m))
            counts["kept_original_turns"] += 1
            continue
        records.add(prompt, output)
        counts["regenerated_turns"] += 1
        counts["generated_tokens"] += len(output)
        reasoning, answer, finished = split_reasoning(prompt, output, th)
        counts["reasoning_tokens"] += len(reasoning or [])
        counts["unfinished_reasoning_turns"] += not finished
        # cut inside its reasoning: the dataset's answer stands in later turns' history
        history.append(_history_turn(tokenizer, reasoning, answer) or dict(m))
    records.close()
    return records.closed, counts


def _count_server_reasoning(counts: dict[str, int], body: dict) -> None:
    served = (body.get("meta_info") or {}).get("reasoning_tokens")
    if isinstance(served, int) and not isinstance(served, bool):  # SGLang with a reasoning parser
        counts["server_reasoning_tokens"] += served
        counts["server_reasoning_replies"] += 1


def _history_turn(tokenizer, reasoning: list[int] | None, answer: list[int]) -> dict | None:
    """The reply as a chat client sends it back (the template decides what to keep of the
    reasoning); None where it has no answer text."""
    text = tokenizer.decode(answer, skip_special_tokens=True)
    if not text.strip():
        return None
    turn = {"role": "assistant", "content": text}
    if reasoning is not None:
        turn["reasoning_content"] = tokenizer.decode(reasoning, skip_special_tokens=True)
    return turn


def regenerate_conversation(
    messages: list[dict],
    conv_index: int,
    tokenizer,
    pool: ServerPool,
    cfg: RegenerateConfig,
    stop_ids: list[int],
    max_length: int,
    where: str,
) -> tuple[list[dict], dict[str, int]]:
    """The conversation with each assistant turn answered again by the target, in order."""
    out: list[dict] = []
    counts = {
        "regenerated_turns": 0,
        "kept_original_turns": 0,
        "dropped_turns": 0,
        "generated_tokens": 0,
    }
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            out.append(dict(m))
            continue
        prompt = render_chat(tokenizer, out, add_generation_prompt=True)
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
