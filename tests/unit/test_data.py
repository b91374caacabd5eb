import json

import pytest

from eyas.config import DataConfig
from eyas.extraction.data import (DataError, load_conversations, load_records, prepare, read_shard_plan, tokenize_conversation,
                       write_shard_plans)
from eyas.target import load_tokenizer
from tests.stage_config import ROOT

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
    messages = [{"role": "user", "content": "Continue:\nx = 1"}, {"role": "assistant", "content": "y = 2"},
                {"role": "user", "content": "More"}, {"role": "assistant", "content": "z = 3"}]
    s = tokenize_conversation(tok, messages)
    assert len(s.input_ids) == len(s.loss_mask)
    masked = tok.decode([i for i, m in zip(s.input_ids, s.loss_mask) if m])
    assert "y = 2" in masked and "z = 3" in masked
    assert "x = 1" not in masked and "More" not in masked
    # Two separate spans: one per assistant turn.
    starts = sum(1 for a, b in zip([0] + s.loss_mask, s.loss_mask) if b and not a)
    assert starts == 2


@pytest.mark.parametrize("line, needle", [
    ("{not json", "malformed JSON"),
    (json.dumps({"text": "hi"}), "missing or empty 'messages'"),
    (json.dumps({"messages": []}), "missing or empty 'messages'"),
    (conv(("user", "hi"), ("assistant", "  ")), "empty assistant turn"),
    (conv(("user", "hi")), "no assistant turn"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "needs a role"),
])
def test_bad_lines_are_named(tmp_path, line, needle):
    path = _write(tmp_path, [conv(("user", "a"), ("assistant", "b")), line])
    with pytest.raises(DataError, match=f"{path}:2: .*{needle}"):
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
    cut = prepare(convs, tok, DataConfig(path=tmp_path, max_length=64, overlong="truncate", num_heldout=1))
    assert cut.stats["truncated"] == 1 and max(len(s.input_ids) for s in cut.train) == 64
    dropped = prepare(convs, tok, DataConfig(path=tmp_path, max_length=64, overlong="drop", num_heldout=1))
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
    assert [s.input_ids for p in plans for s in read_shard_plan(p.path)] == [s.input_ids for s in samples]
    changed = write_shard_plans(samples[1:], 3, tmp_path / "plan")
    assert changed[0].content_hash != plans[0].content_hash


def tokd(ids, mask):
    return json.dumps({"input_ids": ids, "loss_mask": mask})


@pytest.mark.parametrize("line, needle", [
    (tokd([5, 4096, 7], [0, 1, 1]), r"token id 4096 at position 1 is outside the vocabulary \(0\.\.4095\)"),
    (tokd([5, -1], [0, 1]), "token id -1 at position 1 is outside the vocabulary"),
    (tokd([5, 6], [0, 1, 1]), "'loss_mask' must be a list as long as input_ids"),
    (tokd([5, 6], [0, 0]), "'loss_mask' is all zero"),
    (tokd([], []), "'input_ids' must be a non-empty list"),
    (tokd([5, 6], [0, 2]), "only 0 and 1"),
])
def test_bad_pretokenized_records_are_named(tmp_path, line, needle):
    path = _write(tmp_path, [tokd([5, 6, 7], [0, 1, 1]), line])
    with pytest.raises(DataError, match=f"{path}:2: .*{needle}"):
        load_records(path, vocab_size=4096)


def test_pretokenized_and_conversation_records_mix(tmp_path, tok):
    path = _write(tmp_path, [tokd([5, 6, 7, 8], [0, 0, 1, 1]), conv(("user", "q"), ("assistant", "a b c")),
                             tokd([9, 10, 11], [0, 1, 1])])
    records, skipped = load_records(path, vocab_size=4096)
    p = prepare(records, tok, DataConfig(path=path, num_heldout=1), vocab_size=4096)
    assert p.train[0].input_ids == [5, 6, 7, 8] and p.train[0].loss_mask == [0, 0, 1, 1]
    assert p.train[1] == tokenize_conversation(tok, json.loads(conv(("user", "q"), ("assistant", "a b c")))["messages"])
    assert p.heldout_prompts == [[9]]  # the ids before the first loss token
    assert skipped == [] and p.stats["skipped_bad_lines"] == 0


def test_bad_lines_can_be_skipped_counted_and_named(tmp_path, tok):
    good = conv(("user", "q"), ("assistant", "a b c"))
    path = _write(tmp_path, [good, "{oops", tokd([1, 99999], [0, 1]), conv(("user", "x"), ("assistant", " ")),
                             tokd([3] * 40, [1] * 40), good, good])
    records, skipped = load_records(path, vocab_size=4096, bad_lines="skip")
    cfg = DataConfig(path=path, num_heldout=1, max_length=32, overlong="drop", bad_lines="skip")
    p = prepare(records, tok, cfg, vocab_size=4096, skipped=skipped)
    assert p.stats["skipped_bad_lines"] == 3 and p.stats["dropped_overlong"] == 1 and len(p.train) == 2
    named = "\n".join(p.stats["skipped_lines"])
    for needle in (f"{path}:2: malformed JSON", f"{path}:3: token id 99999", f"{path}:4: message 1 is an empty",
                   f"{path}:5: 40 tokens > data.max_length 32, dropped"):
        assert needle in named
    with pytest.raises(DataError, match="no usable conversations .*3 bad line"):
        load_records(_write(tmp_path, ["{oops", "[]", tokd([1], [0])]), bad_lines="skip")


def test_tokenizer_ids_beyond_the_target_vocabulary_are_caught(tmp_path, tok):
    # The tokenizer knows 4096 ids; a target with a smaller embedding cannot take them all.
    path = _write(tmp_path, [conv(("user", "zebra " * 5), ("assistant", "quantum flux")), conv(("user", "a"), ("assistant", "b"))])
    records, _ = load_records(path)
    with pytest.raises(DataError, match=rf"{path}:1 \(after tokenizing\): token id \d+ at position \d+ is outside "
                                        r"the vocabulary \(0\.\.9\)"):
        prepare(records, tok, DataConfig(path=path, num_heldout=0), vocab_size=10)


def test_a_bad_file_writes_no_plan(tmp_path, tok):
    path = _write(tmp_path, [conv(("user", "a"), ("assistant", "b")), "{oops"])
    with pytest.raises(DataError):
        records, _ = load_records(path)
        write_shard_plans(prepare(records, tok, DataConfig(path=path, num_heldout=0)).train, 2, tmp_path / "plan")
    assert not (tmp_path / "plan").exists()
