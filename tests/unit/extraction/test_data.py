"""Reading and preparing the training data: JSONL lines checked and named, conversations tokenized
with the assistant turns masked, held-out prompts, shard plans."""

from __future__ import annotations

import json

import pytest

from eyas.config import DataConfig, RegenerateConfig
from eyas.extraction.data import (
    DataError,
    load_conversations,
    load_records,
    prepare,
    prompt_kwargs,
    read_plan_index,
    read_shard_plan,
    tokenize_conversation,
    write_shard_plans,
)
from eyas.target import load_tokenizer
from tests.stage_config import ROOT
from tests.thinking_target import write_tokenizer

TARGET = ROOT / "fixtures" / "tiny-target"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TARGET)


def _write(tmp_path, lines):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def conv(*turns):
    return json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]})


def test_loss_mask_covers_exactly_the_assistant_turns(tok):
    messages = [
        {"role": "user", "content": "Continue:\nx = 1"},
        {"role": "assistant", "content": "y = 2"},
        {"role": "user", "content": "More"},
        {"role": "assistant", "content": "z = 3"},
    ]
    s = tokenize_conversation(tok, messages)
    assert len(s.input_ids) == len(s.loss_mask)
    masked = tok.decode([i for i, m in zip(s.input_ids, s.loss_mask) if m])
    assert "y = 2" in masked and "z = 3" in masked
    assert "x = 1" not in masked and "More" not in masked
    # Two separate spans: one per assistant turn.
    starts = sum(1 for a, b in zip([0] + s.loss_mask, s.loss_mask) if b and not a)
    assert starts == 2


@pytest.mark.parametrize(
    "line, needle",
    [
        ("{not json", "malformed JSON"),
        (json.dumps({"text": "hi"}), "missing or empty 'messages'"),
        (json.dumps({"messages": []}), "missing or empty 'messages'"),
        (conv(("user", "hi"), ("assistant", "  ")), "empty assistant turn"),
        (conv(("user", "hi")), "no assistant turn"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "needs a role"),
    ],
)
def test_bad_lines_are_named(tmp_path, line, needle):
    path = _write(tmp_path, [conv(("user", "a"), ("assistant", "b")), line])
    with pytest.raises(DataError, match=f"{path}:2:(\\d+:)? .*{needle}"):
        load_conversations(path)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(DataError, match="no conversations"):
        load_conversations(_write(tmp_path, [""]))
    with pytest.raises(DataError, match="not found"):
        load_conversations(tmp_path / "none.jsonl")


def test_length_policy_truncates_or_drops_and_counts(tmp_path, tok):
    long = conv(("user", "word " * 10), ("assistant", "answer " * 200))
    short = conv(("user", "q"), ("assistant", "a b c"))
    convs = load_conversations(_write(tmp_path, [long, short, short]))
    cut = prepare(
        convs, tok, DataConfig(path=tmp_path, max_length=64, overlong="truncate", num_heldout=1)
    )
    assert cut.stats["truncated"] == 1 and max(len(s.input_ids) for s in cut.train) == 64
    dropped = prepare(
        convs, tok, DataConfig(path=tmp_path, max_length=64, overlong="drop", num_heldout=1)
    )
    assert dropped.stats["dropped_overlong"] == 1 and len(dropped.train) == 1
    assert len(cut.heldout_prompts) == 1


def test_heldout_prompts_end_where_the_assistant_begins(tmp_path, tok):
    convs = load_conversations(_write(tmp_path, [conv(("user", "a"), ("assistant", "b"))] * 3))
    p = prepare(convs, tok, DataConfig(path=tmp_path, num_heldout=2))
    full = tokenize_conversation(tok, convs[-1])
    first_loss = full.loss_mask.index(1)
    assert p.heldout_prompts[0] == full.input_ids[:first_loss]
    assert len(p.train) == 1


def test_shard_plans_are_deterministic_and_complete(tmp_path, tok):
    convs = load_conversations(ROOT / "fixtures" / "data" / "conversations.jsonl")[:40]
    samples = prepare(convs, tok, DataConfig(path=tmp_path, num_heldout=0)).train
    plans = write_shard_plans(samples, 3, tmp_path / "plan")
    again = write_shard_plans(samples, 3, tmp_path / "plan2")
    assert [p.content_hash for p in plans] == [p.content_hash for p in again]
    assert sum(p.num_sequences for p in plans) == len(samples)
    assert [s.input_ids for p in plans for s in read_shard_plan(p.path)] == [
        s.input_ids for s in samples
    ]
    changed = write_shard_plans(samples[1:], 3, tmp_path / "plan")
    assert changed[0].content_hash != plans[0].content_hash


def tokd(ids, mask):
    return json.dumps({"input_ids": ids, "loss_mask": mask})


@pytest.mark.parametrize(
    "line, needle",
    [
        (
            tokd([5, 4096, 7], [0, 1, 1]),
            r"token id 4096 at position 1 is outside the vocabulary "
            r"\(0\.\.4095\)",
        ),
        (tokd([5, -1], [0, 1]), "token id -1 at position 1 is outside the vocabulary"),
        (tokd([5, 6], [0, 1, 1]), "'loss_mask' must be a list as long as input_ids"),
        (tokd([5, 6], [0, 0]), "'loss_mask' is all zero"),
        (tokd([], []), "'input_ids' must be a non-empty list"),
        (tokd([5, 6], [0, 2]), "only 0 and 1"),
    ],
)
def test_bad_pretokenized_records_are_named(tmp_path, line, needle):
    path = _write(tmp_path, [tokd([5, 6, 7], [0, 1, 1]), line])
    with pytest.raises(DataError, match=f"{path}:2:(\\d+:)? .*{needle}"):
        load_records(path, vocab_size=4096)


def test_pretokenized_and_conversation_records_mix(tmp_path, tok):
    path = _write(
        tmp_path,
        [
            tokd([5, 6, 7, 8], [0, 0, 1, 1]),
            conv(("user", "q"), ("assistant", "a b c")),
            tokd([9, 10, 11], [0, 1, 1]),
        ],
    )
    records, skipped = load_records(path, vocab_size=4096)
    p = prepare(records, tok, DataConfig(path=path, num_heldout=1), vocab_size=4096)
    assert p.train[0].input_ids == [5, 6, 7, 8] and p.train[0].loss_mask == [0, 0, 1, 1]
    assert p.train[1] == tokenize_conversation(
        tok, json.loads(conv(("user", "q"), ("assistant", "a b c")))["messages"]
    )
    assert p.heldout_prompts == [[9]]  # the ids before the first loss token
    assert skipped == [] and p.stats["skipped_bad_lines"] == 0


def test_bad_lines_can_be_skipped_counted_and_named(tmp_path, tok):
    good = conv(("user", "q"), ("assistant", "a b c"))
    path = _write(
        tmp_path,
        [
            good,
            "{oops",
            tokd([1, 99999], [0, 1]),
            conv(("user", "x"), ("assistant", " ")),
            tokd([3] * 40, [1] * 40),
            good,
            good,
        ],
    )
    records, skipped = load_records(path, vocab_size=4096, bad_lines="skip")
    cfg = DataConfig(path=path, num_heldout=1, max_length=32, overlong="drop", bad_lines="skip")
    p = prepare(records, tok, cfg, vocab_size=4096, skipped=skipped)
    assert (
        p.stats["skipped_bad_lines"] == 3 and p.stats["dropped_overlong"] == 1 and len(p.train) == 2
    )
    named = "\n".join(p.stats["skipped_lines"])
    for needle in (
        f"{path}:2:2: malformed JSON",
        f"{path}:3: token id 99999",
        f"{path}:4: message 1 is an empty",
        f"{path}:5: 40 tokens > data.max_length 32, dropped",
    ):
        assert needle in named
    with pytest.raises(DataError, match="no usable conversations .*3 bad line"):
        load_records(_write(tmp_path, ["{oops", "[]", tokd([1], [0])]), bad_lines="skip")


def test_tokenizer_ids_beyond_the_target_vocabulary_are_caught(tmp_path, tok):
    # The tokenizer knows 4096 ids; a target with a smaller embedding cannot take them all.
    path = _write(
        tmp_path,
        [
            conv(("user", "zebra " * 5), ("assistant", "quantum flux")),
            conv(("user", "a"), ("assistant", "b")),
        ],
    )
    records, _ = load_records(path)
    with pytest.raises(
        DataError,
        match=rf"{path}:1 \(after tokenizing\): token id \d+ at position "
        rf"\d+ is outside "
        r"the vocabulary \(0\.\.9\)",
    ):
        prepare(records, tok, DataConfig(path=path, num_heldout=0), vocab_size=10)


def test_a_bad_file_writes_no_plan(tmp_path, tok):
    path = _write(tmp_path, [conv(("user", "a"), ("assistant", "b")), "{oops"])
    with pytest.raises(DataError):
        records, _ = load_records(path)
        write_shard_plans(
            prepare(records, tok, DataConfig(path=path, num_heldout=0)).train, 2, tmp_path / "plan"
        )
    assert not (tmp_path / "plan").exists()


# --- issue 16 (6): bad bytes, a BOM, text the tokenizer cannot take, over-long lines, stale plans -

GOOD = conv(("user", "q"), ("assistant", "a b c"))


def _write_bytes(tmp_path, lines: list[bytes], name="b.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize(
    "bad", [b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', b"\xff\xfe{", b"ok \xc3"]
)
def test_a_line_that_is_not_utf8_is_named_and_skippable(tmp_path, tok, bad):
    path = _write_bytes(tmp_path, [GOOD.encode(), bad, GOOD.encode(), GOOD.encode()])
    with pytest.raises(
        DataError,
        match=rf"{path}:2:\d+: not valid UTF-8 \(byte 0x.. at column "
        rf"\d+",
    ):
        load_records(path)
    records, skipped = load_records(
        path, bad_lines="skip"
    )  # one bad byte loses one line, not the file
    assert [r.where for r in records] == [f"{path}:1", f"{path}:3", f"{path}:4"]
    p = prepare(
        records, tok, DataConfig(path=path, num_heldout=1, bad_lines="skip"), skipped=skipped
    )
    assert p.stats["skipped_bad_lines"] == 1 and p.stats["skipped_lines"][0].startswith(
        f"{path}:2:"
    )


def test_a_leading_utf8_bom_is_not_a_bad_line(tmp_path):
    path = _write_bytes(tmp_path, [b"\xef\xbb\xbf" + GOOD.encode(), GOOD.encode()])
    records, skipped = load_records(path)
    assert skipped == [] and [r.where for r in records] == [f"{path}:1", f"{path}:2"]
    # a BOM anywhere else is still bad JSON, and named
    path = _write_bytes(
        tmp_path, [GOOD.encode(), b"\xef\xbb\xbf" + GOOD.encode()], name="mid.jsonl"
    )
    with pytest.raises(DataError, match=f"{path}:2:1: malformed JSON"):
        load_records(path)


def test_a_lone_surrogate_is_named_as_text_not_a_tokenizer_typeerror(tmp_path, tok):
    bad = conv(("system", "s"), ("user", "x \ud800 y"), ("assistant", "b"))
    assert "\\ud800" in bad  # valid JSON, but not a Unicode text
    path = _write(tmp_path, [GOOD, bad, GOOD, bad])  # the last record is held out: rendered too
    with pytest.raises(
        DataError,
        match=rf"{path}:2: message 1 \(user\): lone surrogate U\+D800 at "
        rf"character 2",
    ):
        load_records(path)
    records, skipped = load_records(path, bad_lines="skip")
    p = prepare(
        records, tok, DataConfig(path=path, num_heldout=1, bad_lines="skip"), skipped=skipped
    )
    assert len(p.train) == 1 and len(p.heldout_prompts) == 1
    assert [s.split(": ")[0] for s in p.stats["skipped_lines"]] == [f"{path}:2", f"{path}:4"]
    assert not any("TypeError" in s or "TextEncodeInput" in s for s in p.stats["skipped_lines"])


class PickyTokenizer:
    """The real tokenizer, whose chat template refuses any message containing 'forbidden'."""

    def __init__(self, tok):
        self.tok = tok

    def apply_chat_template(self, messages, **kw):
        if any("forbidden" in m["content"] for m in messages):
            raise ValueError("the template does not allow that word")
        return self.tok.apply_chat_template(messages, **kw)


def test_tokenizer_errors_name_the_line_and_the_message(tmp_path, tok):
    bad = conv(("user", "q"), ("assistant", "a"), ("user", "a forbidden word"), ("assistant", "b"))
    bad_prompt = conv(("user", "forbidden"), ("assistant", "b"))
    path = _write(
        tmp_path, [GOOD, bad, GOOD, bad_prompt]
    )  # the last is held out: only its prompt is rendered
    records, _ = load_records(path)
    picky = PickyTokenizer(tok)
    with pytest.raises(
        DataError,
        match=rf"{path}:2: message 2 \(user\): the tokenizer or chat "
        rf"template fails on "
        r"it \(ValueError: the template does not allow that "
        r"word\)",
    ):
        prepare(records, picky, DataConfig(path=path, num_heldout=1))
    p = prepare(records, picky, DataConfig(path=path, num_heldout=1, bad_lines="skip"))
    assert len(p.train) == 2 and p.heldout_prompts == []
    assert p.stats["skipped_lines"][1].startswith(
        f"{path}:4: message 0 (user): the tokenizer or chat template"
    )
    assert [s.split(": ")[0] for s in p.stats["skipped_lines"]] == [f"{path}:2", f"{path}:4"]


def test_a_line_longer_than_the_model_context_is_named(tmp_path, capfd):
    from eyas.target import load_tokenizer

    fresh = load_tokenizer(TARGET)  # HF warns once per tokenizer object, naming no line
    assert fresh.model_max_length == 1024
    long = conv(("user", "q"), ("assistant", "word " * 1500))
    path = _write(tmp_path, [GOOD, long, GOOD, GOOD])
    records, _ = load_records(path)
    with pytest.raises(
        DataError,
        match=rf"{path}:2: 15\d\d tokens \(after data.overlong truncate "
        rf"at data.max_length "
        r"2048\) are too many for the target \(its tokenizer's "
        r"model_max_length "
        r"is 1024; .*set data.max_length below 1024",
    ):
        prepare(records, fresh, DataConfig(path=path, num_heldout=1, max_length=2048))
    p = prepare(
        records, fresh, DataConfig(path=path, num_heldout=1, max_length=2048, bad_lines="skip")
    )
    assert p.stats["skipped_bad_lines"] == 1 and p.stats["skipped_lines"][0].startswith(
        f"{path}:2: 15"
    )
    # within the context, data.max_length truncates as before
    p = prepare(records, fresh, DataConfig(path=path, num_heldout=1, max_length=1000))
    assert p.stats["truncated"] == 1 and len(p.train) == 3
    assert "Token indices sequence length" not in capfd.readouterr().err


def test_fewer_shards_into_the_same_folder_leave_no_stale_plans(tmp_path, tok):
    convs = load_conversations(ROOT / "fixtures" / "data" / "conversations.jsonl")[:12]
    samples = prepare(convs, tok, DataConfig(path=tmp_path, num_heldout=0)).train
    plan_dir = tmp_path / "plan"
    write_shard_plans(samples, 5, plan_dir)
    (plan_dir / "notes.txt").write_text("mine")
    (plan_dir / "shard-00004.plan.jsonl.bak").write_text("mine too")
    plans = write_shard_plans(samples, 2, plan_dir)
    left = sorted(p.name for p in plan_dir.iterdir())
    assert left == [
        "notes.txt",
        "plan.json",
        "shard-00000.plan.jsonl",
        "shard-00001.plan.jsonl",
        "shard-00004.plan.jsonl.bak",
    ]
    index = read_plan_index(plan_dir)
    assert [s["path"] for s in index["shards"]] == [str(p.path) for p in plans]
    assert [s.input_ids for p in plans for s in read_shard_plan(p.path)] == [
        s.input_ids for s in samples
    ]


@pytest.fixture(scope="module")
def thinking_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("thinking-tokenizer")
    write_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def test_held_out_and_suite_prompts_are_rendered_with_the_switch_as_the_target_is_served(
    thinking_tok, tmp_path
):
    """Evaluation asks the target as it is served: the held-out prompts end in an open <think> with
    thinking on, in an empty <think></think> with it off, and as before for a target that does not
    think."""
    from eyas.evaluation.suites import tokenize

    conversations = [
        {
            "messages": [
                {"role": "user", "content": f"w{20 + i}"},
                {"role": "assistant", "content": f"w{40 + i} w41"},
            ]
        }
        for i in range(4)
    ]

    def heldout(thinking):
        cfg = DataConfig(
            path=tmp_path / "d.jsonl",
            max_length=64,
            num_heldout=2,
            regenerate=RegenerateConfig(thinking=thinking),
        )
        prepared = prepare(
            [c["messages"] for c in conversations], thinking_tok, cfg, vocab_size=512
        )
        return prepared.heldout_prompts, cfg

    on, cfg_on = heldout(True)
    off, cfg_off = heldout(False)
    plain, cfg_plain = heldout(None)
    assert [p[-1] for p in on] == [8, 8] and [p[-2:] for p in off] == [[8, 9], [8, 9]]
    assert plain == on  # no keyword passed: the template's default, thinking
    assert prompt_kwargs(cfg_plain) == {} and prompt_kwargs(cfg_on) == {"thinking": True}
    assert tokenize(["w20"], thinking_tok, 64, **prompt_kwargs(cfg_off))[0][-2:] == [8, 9]
