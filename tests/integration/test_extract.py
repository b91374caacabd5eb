import json
import random
import socket
import time

import pytest
import torch

from eyas.extraction.client import Endpoint, ServerPool
from eyas.extraction.data import TokenizedSample, write_shard_plans
from eyas.extraction.extract import (
    ExtractionError,
    check_shard,
    extract_shard,
    shard_path,
)
from eyas.extraction.shards import ShardReader, bytes_per_token, partial_path, verify_shard
from eyas.server import readiness
from eyas.server.hosts import LocalHost, wait_dead
from eyas.server.launch import capture_launch, start_server, stop_server
from tests.stage_config import stage_config

CAPTURE = [2, 4, 5]
META = {"cache_key": "k1", "layer_ids": CAPTURE, "layer_convention": "capture-before"}


def _launch(tmp, target):
    host, cfg = LocalHost(), stage_config(tmp, target, **{"server.env": {"OMP_NUM_THREADS": "1"}})
    handle = start_server(host, capture_launch(cfg))
    readiness.wait_until_ready(
        host,
        log_path=handle.log_path,
        pid=handle.pid,
        url=handle.url,
        start_offset=handle.log_offset,
        poll_interval_s=0.1,
        stall_timeout_s=30,
        deadline_s=120,
        http_timeout_s=5,
    )
    return host, cfg, handle


@pytest.fixture(scope="module")
def server(tmp_path_factory, random_target):
    host, cfg, handle = _launch(tmp_path_factory.mktemp("extract"), random_target)
    yield cfg, handle
    stop_server(host, capture_launch(cfg), handle)


def _plans(tmp, n=6, seed=0, num_shards=2):
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        length = rng.randint(5, 40)  # chunked-prefill-size is 16: most are 2-3 chunks
        samples.append(
            TokenizedSample(
                [rng.randrange(3, 512) for _ in range(length)],
                [0] * (length // 2) + [1] * (length - length // 2),
            )
        )
    return samples, write_shard_plans(samples, num_shards, tmp / "plan")


def _extract(cfg, plan, out, **kw):
    args = dict(
        server_url=cfg.server.url,
        dump_dir=cfg.server.dump_dir,
        capture_ids=CAPTURE,
        dtype="bfloat16",
        concurrency=3,
        request_timeout_s=60,
        record_timeout_s=10,
        meta=META,
    )
    return extract_shard(plan, out, **{**args, **kw})


def _endpoint(cfg, n=2):
    return Endpoint(cfg.server.url, cfg.server.dump_dir, n)


def test_shard_holds_the_targets_hidden_states(server, tmp_path, random_target):
    import transformers

    cfg, _ = server
    samples, plans = _plans(tmp_path)
    seen = []
    manifests = [_extract(cfg, p, tmp_path / "out", on_progress=seen.append) for p in plans]
    assert sum(m["num_samples"] for m in manifests) == len(samples)
    assert manifests[0]["last_hidden_norm"] == "post"
    # Progress: a report whenever sequences finish (two finishing together share one), rising within
    # each shard and ending at its totals.
    last = seen[-1]
    per_shard = [[p.samples_done for p in seen if p.shard == plan.name] for plan in plans]
    for done, plan in zip(per_shard, plans):
        assert done == sorted(set(done)) and done[-1] == plan.num_sequences and done[0] >= 1
    assert len(per_shard[0]) + len(per_shard[1]) == len(seen)
    assert last.tokens_done == last.num_tokens == plans[1].num_tokens
    assert last.bytes_done == last.num_tokens * bytes_per_token(64, 3)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        random_target, dtype=torch.float32
    ).eval()
    reader = ShardReader(shard_path(tmp_path / "out", plans[0]))
    for planned, got in zip(samples, reader):
        assert got.input_ids.tolist() == planned.input_ids
        assert got.loss_mask.long().tolist() == planned.loss_mask
        with torch.no_grad():
            hs = model(torch.tensor([planned.input_ids]), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[2][0], hs[4][0], hs[5][0]], dim=-1)
        torch.testing.assert_close(got.aux_hidden_states.float(), aux, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(got.last_hidden_state.float(), hs[-1][0], atol=2e-2, rtol=2e-2)
    assert [p.name for p in cfg.server.dump_dir.iterdir()] == [
        ".eyas-owned"
    ]  # records are removed once collected


def test_one_check_says_intact_missing_stale_or_damaged_and_a_redone_shard_is_identical(
    server, tmp_path
):
    cfg, _ = server
    _, plans = _plans(tmp_path, seed=1)
    out = tmp_path / "out"
    kw = dict(
        server_url=cfg.server.url,
        dump_dir=cfg.server.dump_dir,
        capture_ids=CAPTURE,
        dtype="bfloat16",
        meta={"layer_ids": CAPTURE, "cache_key": "k1"},
    )
    assert check_shard(out, plans[0], "k1").state == "missing"
    m = extract_shard(plans[0], out, **kw)
    found = check_shard(out, plans[0], "k1")
    assert found.intact and found.manifest["sha256"] == m["sha256"]
    stale = check_shard(out, plans[0], "other-key")
    assert stale.state == "stale" and "cache key" in stale.reason
    path = shard_path(out, plans[0])
    path.write_bytes(path.read_bytes()[:-64])  # truncated on disk
    damaged = check_shard(out, plans[0], "k1")
    assert damaged.state == "damaged" and damaged.reason.startswith("damaged: ")
    redone = extract_shard(plans[0], out, **kw)
    assert (
        redone["sha256"] == m["sha256"]
        and verify_shard(path)
        and check_shard(out, plans[0], "k1").intact
    )


def test_wrong_capture_layers_are_refused_and_nothing_is_written(server, tmp_path):
    cfg, _ = server
    _, plans = _plans(tmp_path, seed=2)
    with pytest.raises(ExtractionError, match=r"captured layers \[2, 4, 5\]"):
        _extract(cfg, plans[0], tmp_path / "out", capture_ids=[1, 4, 6])
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_ids_outside_the_vocabulary_fail_at_once_naming_the_sequence(server, tmp_path):
    cfg, _ = server
    samples = [TokenizedSample([5, 6, 7], [0, 1, 1]), TokenizedSample([5, 600, 7], [0, 1, 1])]
    plan = write_shard_plans(samples, 1, tmp_path / "plan")[0]
    with pytest.raises(
        ExtractionError,
        match=r"shard-00000 sequence 1 .*400.*input_ids\[1\] = 600 "
        r"is "
        r"outside the vocabulary \(0\.\.511\)",
    ) as e:
        _extract(cfg, plan, tmp_path / "out", retries=3)
    assert "-a0" in str(e.value.__cause__) or "answered 400" in str(
        e.value
    )  # one attempt: not retried
    assert not any((tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else True


def test_server_gone_is_an_error_naming_the_shard(tmp_path, free_port):
    samples = [TokenizedSample([5, 6, 7], [0, 1, 1])]
    plan = write_shard_plans(samples, 1, tmp_path / "plan")[0]
    with pytest.raises(ExtractionError, match=r"shard-00000 sequence 0 .*failed after 2 attempts"):
        extract_shard(
            plan,
            tmp_path / "out",
            server_url=f"http://127.0.0.1:{free_port}",
            dump_dir=tmp_path / "d",
            capture_ids=CAPTURE,
            dtype="bfloat16",
            concurrency=1,
            request_timeout_s=2,
            retries=1,
            backoff_s=0.05,
            meta={},
        )
    assert not any((tmp_path / "out").glob("*")) if (tmp_path / "out").exists() else True


def test_fp8_shard_reads_back_as_bf16_close_to_the_bf16_shard_at_half_the_bytes(server, tmp_path):
    cfg, _ = server
    _, plans = _plans(tmp_path, n=4, seed=3, num_shards=1)
    ref = _extract(cfg, plans[0], tmp_path / "bf16")
    m = _extract(cfg, plans[0], tmp_path / "fp8", encoding="fp8_e4m3")
    assert m["encoding"] == "fp8_e4m3" and m["dtype"] == "bfloat16"
    err = m["fp8_error"]
    assert max(err["aux"]["rel_rms"]) < 0.04 and err["last"]["rel_rms"][0] < 0.04
    assert err["aux"]["min_cosine"] > 0.998 and err["aux"]["tokens"] == m["num_tokens"]
    a, b = (
        ShardReader(shard_path(tmp_path / "bf16", plans[0])),
        ShardReader(shard_path(tmp_path / "fp8", plans[0])),
    )
    for x, y in zip(a, b):
        assert y.aux_hidden_states.dtype == torch.bfloat16 and torch.equal(x.input_ids, y.input_ids)
        rel = (
            x.aux_hidden_states.float() - y.aux_hidden_states.float()
        ).norm() / x.aux_hidden_states.float().norm()
        assert rel < 0.04
    # Bytes: e4m3 values plus one float32 scale per token and layer (H=64 here, so scales weigh more
    # than at H=7168, where (4*(7168+4)+5)/(4*7168*2+5) = 0.5003).
    n, T = m["num_samples"], m["num_tokens"]
    assert m["bytes"] - T * bytes_per_token(64, 3, encoding="fp8_e4m3") - 8 * (n + 1) < 4096
    assert ref["bytes"] - T * bytes_per_token(64, 3) - 8 * (n + 1) < 4096


def _kill(host, handle, port):
    host.kill_group(handle.pid, 9)
    assert wait_dead(host, handle.pid, 10)
    # /proc shows the main thread as a zombie while the other threads still hold the socket.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"port {port} still taken 15 s after the server died")


def test_server_killed_mid_shard_retries_or_fails_over_with_identical_output(
    server, tmp_path, tmp_path_factory, random_target
):
    """The only server killed mid-shard and started again: the retries finish the shard. Then one of
    two servers killed mid-shard: the shard finishes on the other. Both equal an undisturbed run."""
    cfg, _ = server
    _, plans = _plans(tmp_path, n=14, seed=4, num_shards=1)
    ref = _extract(cfg, plans[0], tmp_path / "ref")
    host, cfg_b, handle_b = _launch(tmp_path_factory.mktemp("server-b"), random_target)
    try:
        # 1. One endpoint, killed after the first sequence is in and started again on the same port:
        #    requests fail while it loads, and the retries with backoff wait it out.
        restarted = []

        def kill_and_restart(p):
            if not restarted:
                _kill(host, handle_b, cfg_b.server.port)
                restarted.append(start_server(host, capture_launch(cfg_b)))

        with ServerPool(
            [_endpoint(cfg_b, 2)], retries=30, backoff_s=0.2, backoff_max_s=1.0
        ) as pool:
            m = extract_shard(
                plans[0],
                tmp_path / "restart",
                capture_ids=CAPTURE,
                dtype="bfloat16",
                meta=META,
                pool=pool,
                on_progress=kill_and_restart,
            )
            stats = pool.stats()
        handle_b = restarted[0]
        assert stats[cfg_b.server.url]["failures"] >= 1, stats
        assert m["sha256"] == ref["sha256"]
        assert not partial_path(shard_path(tmp_path / "restart", plans[0])).exists()

        # 2. Two endpoints; B dies after the first sequence is in: the rest go to A.
        killed = []

        def kill_b(p):
            if not killed:
                killed.append(p.samples_done)
                _kill(host, handle_b, cfg_b.server.port)

        with ServerPool([_endpoint(cfg, 1), _endpoint(cfg_b, 3)], retries=3, backoff_s=30) as pool:
            m = extract_shard(
                plans[0],
                tmp_path / "failover",
                capture_ids=CAPTURE,
                dtype="bfloat16",
                meta=META,
                pool=pool,
                on_progress=kill_b,
            )
            stats = pool.stats()
        assert len(killed) == 1 and 1 <= killed[0] < 14, (
            killed
        )  # mid-shard: some sequences in, most not
        assert stats[cfg_b.server.url]["failures"] >= 1
        assert m["sha256"] == ref["sha256"]
    finally:
        stop_server(host, capture_launch(cfg_b), handle_b)


def test_a_dead_server_fails_the_shard_at_once_instead_of_backing_off(
    tmp_path, tmp_path_factory, random_target
):
    """With the launched server's liveness check (what the extract task passes), its death is
    recognised at the first failed request: seconds, where 30 retries of 30 s backoff would take
    hours."""
    from functools import partial

    from eyas.server.launch import capture_launch, server_alive

    _, plans = _plans(tmp_path, n=10, seed=6, num_shards=1)
    host, cfg_b, handle_b = _launch(tmp_path_factory.mktemp("server-dead"), random_target)
    killed = []

    def kill_b(p):
        if not killed:
            killed.append(time.monotonic())
            _kill(host, handle_b, cfg_b.server.port)

    endpoint = Endpoint(
        cfg_b.server.url,
        cfg_b.server.dump_dir,
        2,
        alive=partial(server_alive, capture_launch(cfg_b)),
    )
    try:
        assert server_alive(capture_launch(cfg_b))
        with ServerPool([endpoint], retries=30, backoff_s=30) as pool:
            with pytest.raises(ExtractionError, match="process is gone"):
                extract_shard(
                    plans[0],
                    tmp_path / "out",
                    capture_ids=CAPTURE,
                    dtype="bfloat16",
                    meta=META,
                    pool=pool,
                    on_progress=kill_b,
                )
            assert pool.stats()[cfg_b.server.url]["dead"] is True
        assert time.monotonic() - killed[0] < 30
        assert not server_alive(capture_launch(cfg_b))
        assert not shard_path(tmp_path / "out", plans[0]).exists()
        assert not partial_path(shard_path(tmp_path / "out", plans[0])).exists()
    finally:
        stop_server(host, capture_launch(cfg_b), handle_b)


# ---------------------------------------------------------------------------------------------
# Regeneration of the assistant turns, through the same server
# ---------------------------------------------------------------------------------------------

CHAT = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def _conversations(tmp_path):
    rng = random.Random(5)

    def words(n):
        return " ".join(f"w{rng.randrange(3, 512)}" for _ in range(n))

    convs = [
        [{"role": "user", "content": words(6)}, {"role": "assistant", "content": words(5)}]
        for _ in range(4)
    ]
    convs.append(
        convs[0]
        + [{"role": "user", "content": words(3)}, {"role": "assistant", "content": words(4)}]
    )
    lines = [json.dumps({"messages": c}) for c in convs] + [
        json.dumps({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]})
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_regenerated_turns_are_the_targets_answers_and_parts_resume(
    server, tmp_path, random_target
):
    from transformers import AutoTokenizer

    from eyas.config import DataConfig, RegenerateConfig
    from eyas.extraction.data import load_records, prepare, render_chat
    from eyas.extraction.regenerate import regenerate
    from eyas.extraction.regenerate_turns import turn_end_ids

    cfg, _ = server
    tok = AutoTokenizer.from_pretrained(str(random_target))
    tok.chat_template = CHAT
    records, _ = load_records(_conversations(tmp_path), vocab_size=512)
    rcfg, kw = (
        RegenerateConfig(enabled=True, max_new_tokens=6, num_parts=3),
        dict(target="random", max_length=64),
    )

    def regenerated(pool):
        """regenerate() -> (path, summary, its progress figures); each part's own line (on_part)
        comes before the progress figure that counts it."""
        events = []
        path, summary = regenerate(
            records[:-1],
            tok,
            pool,
            tmp_path / "regen",
            rcfg,
            passthrough=records[-1:],
            on_progress=lambda p: events.append(("progress", p)),
            on_part=lambda k, n, m: events.append(("part", k)),
            **kw,
        )
        parts = [i for i, (kind, _) in enumerate(events) if kind == "part"]
        assert [events[i][1] for i in parts] == [0, 1, 2]
        assert [events[i + 1][1].parts_done for i in parts] == [1, 2, 3]
        return path, summary, [p for kind, p in events if kind == "progress"]

    with ServerPool([_endpoint(cfg)], retries=1, backoff_s=0.2) as pool:
        path, summary, seen = regenerated(pool)
        assert (
            summary["parts"] == 3 and summary["parts_reused"] == 0 and summary["conversations"] == 5
        )
        # Progress: a figure per conversation and part; at the end every part and conversation done.
        assert len(seen) == 5 + 3 and [p.done for p in seen] == sorted(p.done for p in seen)
        assert (seen[-1].parts_done, seen[-1].num_parts, seen[-1].done, seen[-1].total) == (
            3,
            3,
            5,
            5,
        )
        assert seen[-1].percent == 100.0 and seen[-1].reused == 0 and seen[-1].tokens > 0
        assert summary["regenerated_turns"] + summary["kept_original_turns"] == 6
        out = [json.loads(line) for line in path.read_text().splitlines()]
        assert out[-1] == {
            "input_ids": [5, 6, 7],
            "loss_mask": [0, 1, 1],
        }  # passed through unchanged
        for before, after in zip(records[:-1], out[:-1]):
            assert [
                (m["role"], m["content"]) for m in after["messages"] if m["role"] == "user"
            ] == [(m["role"], m["content"]) for m in before.messages if m["role"] == "user"]
        # Each answer is the target's greedy continuation of the conversation so far.
        first = out[4]["messages"]
        for j in (1, 3):  # the second turn answers the regenerated first one
            again = pool.generate(
                render_chat(tok, first[:j], add_generation_prompt=True),
                f"WARMUP_check-{j}",
                {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": turn_end_ids(tok)},
            ).result()
            assert first[j]["content"] == tok.decode(
                again.body["output_ids"], skip_special_tokens=True
            )
        assert out[0]["messages"][1]["content"] == first[1]["content"]  # same prompt, same answer
        assert [p.name for p in cfg.server.dump_dir.iterdir()] == [
            ".eyas-owned"
        ]  # regeneration requests are never dumped

        # Resume: finished parts are never asked again; a lost part is redone identically.
        before = path.read_bytes()
        (tmp_path / "regen" / "part-00001.jsonl").unlink()
        n0 = pool.stats()[cfg.server.url]["requests"]
        path, summary, seen = regenerated(pool)
        assert summary["parts_reused"] == 2 and path.read_bytes() == before
        assert (seen[-1].done, seen[-1].reused, seen[-1].parts_done) == (
            5,
            4,
            3,
        )  # parts of 2, 1, 2: the 1 redone
        assert 0 < pool.stats()[cfg.server.url]["requests"] - n0 <= 3  # only the lost part's turns
        recs, skipped = load_records(path, vocab_size=512)  # it prepares like any input
        assert (
            len(prepare(recs, tok, DataConfig(path=path, num_heldout=1), vocab_size=512).train) == 5
        )
        _, other = regenerate(
            records[:-1],
            tok,
            pool,
            tmp_path / "regen",
            rcfg.model_copy(update={"max_new_tokens": 3}),
            **kw,
        )
        assert other["parts_reused"] == 0  # other sampling: another dataset


def test_a_damaged_shard_on_disk_is_extracted_again_saying_why(server, tmp_path, monkeypatch):
    from eyas.extraction import stage

    cfg, _ = server
    cfg = cfg.model_copy(
        update={"extraction": cfg.extraction.model_copy(update={"output_dir": tmp_path / "out"})}
    )
    _, plans = _plans(tmp_path, seed=2, num_shards=1)
    lines = []

    def log(fmt, *args):
        lines.append(fmt % args)

    with stage.ExtractionContext() as ctx:  # no publisher: no Prefect artifacts outside a run
        first = stage.run_shard(ctx, cfg, plans[0], "local", log=log)
        path = shard_path(tmp_path / "out", plans[0])
        path.write_bytes(path.read_bytes()[:-64])  # damaged on disk after it was finished
        again = stage.run_shard(ctx, cfg, plans[0], "local", log=log)
    assert again.sha256 == first.sha256 and not again.reused
    [why] = [line for line in lines if "on disk is damaged" in line]
    assert why.startswith(f"{plans[0].name} on disk is damaged: ") and why.endswith(
        ": extracting it again"
    )
