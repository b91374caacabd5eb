"""Regeneration of the assistant turns by the target, through a real local server on the tiny target."""

import json

import pytest

from eyas import readiness
from eyas.client import Endpoint, ServerPool
from eyas.config import DataConfig, RegenerateConfig
from eyas.data import _render, load_records, prepare
from eyas.hosts import LocalHost
from eyas.launch import start_server, stop_server
from eyas.regenerate import regenerate, turn_end_ids
from eyas.target import load_tokenizer
from tests.stage_config import ROOT, stage_config

TARGET = ROOT / "fixtures" / "tiny-target"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    host, cfg = LocalHost(), stage_config(tmp_path_factory.mktemp("regen"), TARGET,
                                          **{"server.env": {"OMP_NUM_THREADS": "1"}})
    handle = start_server(host, cfg)
    try:
        readiness.wait_until_ready(host, log_path=handle.log_path, pid=handle.pid, url=handle.url,
                                   start_offset=handle.log_offset, poll_interval_s=0.1, stall_timeout_s=60,
                                   deadline_s=180, http_timeout_s=5)
        with ServerPool([Endpoint(cfg.server.url, cfg.server.dump_dir, 2)], retries=1, backoff_s=0.5) as p:
            yield p, cfg
    finally:
        stop_server(host, cfg, handle.pid)


def _data(tmp_path, n=5):
    lines = (ROOT / "fixtures" / "data" / "conversations.jsonl").read_text().splitlines()[:n]
    two_turns = json.loads(lines[0])["messages"] + [{"role": "user", "content": "Go on."},
                                                    {"role": "assistant", "content": "def f():\n    return 1"}]
    lines.append(json.dumps({"messages": two_turns}))
    lines.append(json.dumps({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}))
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_assistant_turns_are_the_targets_answers_and_parts_resume(pool, tmp_path):
    pool, cfg = pool
    tok = load_tokenizer(TARGET)
    records, _ = load_records(_data(tmp_path))
    rcfg = RegenerateConfig(enabled=True, max_new_tokens=12, num_parts=3)
    kw = dict(target="tiny@fixture-v1", max_length=384)
    path, summary = regenerate(records[:-1], tok, pool, tmp_path / "regen", rcfg, passthrough=records[-1:], **kw)
    assert summary["parts"] == 3 and summary["parts_reused"] == 0 and summary["conversations"] == 6
    turns = sum(m["role"] == "assistant" for r in records[:-1] for m in r.messages)
    assert summary["regenerated_turns"] + summary["kept_original_turns"] == turns
    out = [json.loads(line) for line in path.read_text().splitlines()]
    assert out[-1] == {"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}  # passed through
    for before, after in zip(records[:-1], out[:-1]):
        assert [m["role"] for m in after["messages"]] == [m["role"] for m in before.messages]
        assert [m["content"] for m in after["messages"] if m["role"] != "assistant"] == \
            [m["content"] for m in before.messages if m["role"] != "assistant"]
    # The first answer is exactly the target's greedy continuation of the prompt (asked again here).
    first = out[0]["messages"]
    prompt = _render(tok, first[:1], add_generation_prompt=True)
    again = pool.generate(prompt, "WARMUP_check", {"max_new_tokens": 12, "temperature": 0,
                                                   "stop_token_ids": turn_end_ids(tok)}).result()
    assert first[1]["content"] == tok.decode(again.body["output_ids"], skip_special_tokens=True)
    assert first[1]["content"] != records[0].messages[1]["content"]
    # The second turn of the two-turn conversation answers the regenerated first turn.
    assert len(out[5]["messages"]) == 4 and out[5]["messages"][2]["content"] == "Go on."

    # Resume: finished parts are never asked again; a lost part is redone identically.
    before = path.read_bytes()
    (tmp_path / "regen" / "part-00001.jsonl").unlink()
    n0 = pool.stats()[cfg.server.url]["requests"]
    path, summary = regenerate(records[:-1], tok, pool, tmp_path / "regen", rcfg, passthrough=records[-1:], **kw)
    assert summary["parts_reused"] == 2 and path.read_bytes() == before
    asked = pool.stats()[cfg.server.url]["requests"] - n0
    assert 0 < asked <= 3  # only the lost part's turns
    # Other sampling is another dataset: nothing reused.
    _, other = regenerate(records[:2], tok, pool, tmp_path / "regen2", rcfg, **kw)
    _, other = regenerate(records[:2], tok, pool, tmp_path / "regen2",
                          rcfg.model_copy(update={"max_new_tokens": 4}), **kw)
    assert other["parts_reused"] == 0

    # The regenerated file prepares like any input.
    recs, skipped = load_records(path, vocab_size=4096)
    prepared = prepare(recs, tok, DataConfig(path=path, num_heldout=1), vocab_size=4096)
    assert len(prepared.train) == 6 and not skipped
