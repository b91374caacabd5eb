"""Regeneration for a thinking target, end to end against eyas's local server on loopback playing a
thinking model (`--think-tokens 4`), with Kimi-K2.5's chat template (tests/thinking_target.py).

Thinking on: one record per answer, its reasoning span exactly as the server emitted it, the earlier
answers in its prompt as the template renders history. Thinking off: the answers extend each other,
so a conversation is one record, the template's own rendering of it."""

import json
import random

import pytest

from eyas.config import DataConfig, RegenerateConfig
from eyas.extraction import stage
from eyas.extraction.client import Endpoint, ServerPool
from eyas.extraction.data import load_records, prepare, render_chat
from eyas.extraction.regenerate import regenerate
from eyas.extraction.regenerate_turns import turn_end_ids
from eyas.report import regeneration_section
from eyas.server.readiness import READY_LINE
from tests.stage_config import stage_config
from tests.thinking_target import thinking_target

BUDGET, MAX_NEW, START, END, IM_END = 4, 10, 8, 9, 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return thinking_target(tmp_path_factory.mktemp("thinking-target"))


@pytest.fixture(scope="module")
def server(start_server, target):
    proc = start_server(
        "--think-tokens",
        str(BUDGET),
        "--max-running-requests",
        "4",
        model=target,
        name="thinking-server",
    )
    proc.wait_for(READY_LINE)
    return proc


@pytest.fixture(scope="module")
def tok(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target))


def _data(tmp_path):
    rng = random.Random(7)

    def words(n):
        return " ".join(f"w{rng.randrange(10, 512)}" for _ in range(n))

    def conv(turns, system=False):
        msgs = [{"role": "system", "content": words(3)}] if system else []
        for _ in range(turns):
            msgs += [
                {"role": "user", "content": words(5)},
                {"role": "assistant", "content": words(4)},
            ]
        return msgs

    convs = [conv(1), conv(2, system=True), conv(3), conv(1)]  # the last one is held out
    lines = [json.dumps({"messages": c}) for c in convs[:3]]
    lines += [
        json.dumps({"input_ids": [10, 11, 12], "loss_mask": [0, 1, 1]}),
        json.dumps({"messages": convs[3]}),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    records, _ = load_records(path, vocab_size=512)
    return records[:-1], records[-1:]


def _spans(mask):
    """(start, end) of each run of 1s."""
    out, start = [], None
    for i, m in enumerate(mask + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def _ask(pool, tok, prompt, rid):
    reply = pool.generate(
        prompt,
        f"WARMUP_check-{rid}",
        {"max_new_tokens": MAX_NEW, "temperature": 0, "stop_token_ids": turn_end_ids(tok)},
    ).result()
    return reply.body["output_ids"]


def test_thinking_on_keeps_each_reasoning_reply_as_emitted_after_the_templates_history(
    server, tok, tmp_path, target
):
    records, heldout = _data(tmp_path)
    # greedy, so that each reply can be asked again and compared (thinking's default samples)
    rcfg = RegenerateConfig(
        enabled=True, max_new_tokens=MAX_NEW, num_parts=2, thinking=True, temperature=0.0
    )
    with ServerPool(
        [Endpoint(server.url, tmp_path / "no-dump", 4)], retries=1, backoff_s=0.2
    ) as pool:
        path, summary = regenerate(
            records,
            tok,
            pool,
            tmp_path / "regen",
            rcfg,
            passthrough=heldout,
            target="thinking",
            max_length=512,
        )
        assert summary["thinking"] is True and summary["regenerated_turns"] == 6
        assert summary["reasoning_tokens"] == 6 * BUDGET == summary["server_reasoning_tokens"]
        assert summary["unfinished_reasoning_turns"] == 0
        assert summary["sequences"] == 6 + 1  # one record per answer, and the pre-tokenized one
        assert summary["output_tokens"] == 6 * MAX_NEW
        out = [json.loads(line) for line in path.read_text().splitlines()]
        assert out[6] == {
            "input_ids": [10, 11, 12],
            "loss_mask": [0, 1, 1],
        }  # passed through unchanged
        assert out[7] == {"messages": heldout[0].messages}  # held out: as it was
        answers = []
        for k, rec in enumerate(out[:6]):
            ids, mask = rec["input_ids"], rec["loss_mask"]
            [(a, b)] = _spans(mask)
            assert b == len(ids)  # the prompt, then the reply
            prompt, reply = ids[:a], ids[a:]
            assert prompt[-1] == START  # the template opened the reasoning (thinking on)
            assert reply[BUDGET] == END and START not in reply and reply.count(END) == 1
            assert (
                _ask(pool, tok, prompt, k) == reply
            )  # the server's own ids, not decoded and encoded again
            answers.append((prompt, reply))
        # The third conversation's last turn: both earlier answers in its prompt as the template
        # renders history (reasoning dropped to <think></think>), the reasoning of neither.
        conv = records[2].messages
        history = []
        for j, (_, reply) in zip((1, 3), answers[3:5]):
            history += [
                conv[j - 1],
                {
                    "role": "assistant",
                    "content": tok.decode(reply[BUDGET + 1 :]),
                    "reasoning_content": tok.decode(reply[:BUDGET]),
                },
            ]
        expected = render_chat(tok, history + [conv[4]], add_generation_prompt=True, thinking=True)
        assert answers[5][0] == expected
        assert (
            expected.count(START) == 3 and expected.count(END) == 2
        )  # two histories closed, one open
        assert all(
            expected[i - 1] == START for i, t in enumerate(expected) if t == END
        )  # both empty
        # Prepared like any input: every record trains, on exactly the generated tokens.
        recs, _ = load_records(path, vocab_size=512)
        prepared = prepare(
            recs, tok, DataConfig(path=path, num_heldout=1, max_length=512), vocab_size=512
        )
        assert prepared.stats["sequences"] == 7 and prepared.stats["loss_tokens"] == 6 * MAX_NEW + 2
        # The extraction stage prepares them, and report.json counts their reasoning tokens.
        cfg = stage_config(
            tmp_path,
            target,
            **{
                "data.path": str(path),
                "data.num_heldout": 1,
                "data.max_length": 512,
                "data.regenerate.thinking": True,
                "data.regenerate.temperature": 0.0,
            },
        )
        staged = stage.prepare(
            stage.ExtractionContext(), cfg, str(path), take_dir=False, log=lambda *a: None
        )
        section = regeneration_section(staged.stats)
        assert (section["thinking"], section["reasoning_tokens"], section["output_tokens"]) == (
            True,
            24,
            60,
        )
        assert section["server_reasoning_tokens"] == 24 and section["sequences"] == 7

        # Resume: every part found finished; another switch is another dataset.
        before = path.read_bytes()
        _, again = regenerate(
            records,
            tok,
            pool,
            tmp_path / "regen",
            rcfg,
            passthrough=heldout,
            target="thinking",
            max_length=512,
        )
        assert again["parts_reused"] == 2 and path.read_bytes() == before
        _, other = regenerate(
            records,
            tok,
            pool,
            tmp_path / "regen",
            rcfg.model_copy(update={"thinking": False}),
            passthrough=heldout,
            target="thinking",
            max_length=512,
        )
        assert other["parts_reused"] == 0 and other["reasoning_tokens"] == 0


def test_thinking_off_answers_extend_each_other_into_the_templates_rendering(server, tok, tmp_path):
    records, heldout = _data(tmp_path)
    rcfg = RegenerateConfig(enabled=True, max_new_tokens=MAX_NEW, num_parts=3, thinking=False)
    with ServerPool(
        [Endpoint(server.url, tmp_path / "no-dump", 4)], retries=1, backoff_s=0.2
    ) as pool:
        path, summary = regenerate(
            records,
            tok,
            pool,
            tmp_path / "regen",
            rcfg,
            passthrough=heldout,
            target="thinking",
            max_length=512,
        )
        assert (
            summary["regenerated_turns"] == 6 and summary["sequences"] == 3 + 1
        )  # a record per conversation
        assert summary["reasoning_tokens"] == 0 == summary["server_reasoning_tokens"]
        out = [json.loads(line) for line in path.read_text().splitlines()]
        for k, (rec, original) in enumerate(zip(out[:3], records)):
            ids, mask = rec["input_ids"], rec["loss_mask"]
            spans = _spans(mask)
            assert len(spans) == sum(m["role"] == "assistant" for m in original.messages)
            conv = []
            for j, (a, b) in enumerate(spans):
                assert ids[a - 2 : a] == [START, END]  # thinking off: the prompt closed the span
                assert _ask(pool, tok, ids[:a], f"off-{k}-{j}") == ids[a:b]
                conv.append(tok.decode(ids[a:b]))
            # The record is the template's rendering of the regenerated conversation, up to the last
            # answer's end (the closing <|im_end|> the target did not generate is not there).
            messages, answers = [], iter(conv)
            for m in original.messages:
                messages.append(
                    {"role": "assistant", "content": next(answers)}
                    if m["role"] == "assistant"
                    else m
                )
            full = render_chat(tok, messages, add_generation_prompt=False, thinking=False)
            assert full[: len(ids)] == ids and full[len(ids) :] == [IM_END]
