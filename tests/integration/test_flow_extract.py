"""flows/extract.py with regeneration: the shards hold the target's own answers, and a re-run needs
no server at all (regenerated parts and shards are both found intact)."""

import json
import logging
import re
import time

import pytest
from eyas_prefect.flows.extract import extract

from eyas.extraction.dataset import dataset_path
from eyas.extraction.shards import ShardReader, verify_shard
from tests.eyas_run import small_data
from tests.stage_config import ROOT, stage_config

pytestmark = pytest.mark.slow


def test_extraction_trains_on_the_targets_answers_and_a_rerun_launches_nothing(
    prefect_harness, tmp_path, monkeypatch
):
    """Also: regeneration dies after its first part (any error), and its task's retry answers only
    the second, in the same flow run."""
    from eyas.extraction import regenerate as regen

    real, calls = regen.regenerate, []

    def dies_after_the_first_part(*args, on_part=None, **kw):
        calls.append(1)

        def part_done(k, n, m):
            on_part(k, n, m)
            if len(calls) == 1:
                raise ConnectionResetError(
                    "injected: the first attempt loses its server after part 1"
                )

        return real(*args, on_part=part_done, **kw)

    monkeypatch.setattr(regen, "regenerate", dies_after_the_first_part)
    data = small_data(tmp_path, 10)
    cfg = stage_config(
        tmp_path,
        ROOT / "fixtures" / "tiny-target",
        **{
            "data.path": str(data),
            "data.num_heldout": 2,
            "data.max_length": 384,
            "data.regenerate.enabled": True,
            "data.regenerate.max_new_tokens": 12,
            "data.regenerate.num_parts": 2,
            "extraction.num_shards": 2,
            "server.chunked_prefill_size": 128,
        },
    )

    first = extract(cfg)
    assert set(first.stages) >= {"prepare", "regenerate", "extract", "stop"}
    regenerated = tmp_path / "shards" / "regenerated" / "regenerated.jsonl"
    summary = json.loads((regenerated.parent / "regenerate.json").read_text())
    assert (
        summary["conversations"] == 8
        and summary["regenerated_turns"] >= 8
        and summary["passed_through"] == 2
    )
    assert (
        len(calls) == 2 and summary["parts_reused"] == 1
    )  # the retry kept the first attempt's part
    assert json.loads(dataset_path(cfg.extraction.output_dir).read_text())["data"][
        "data_path"
    ] == str(regenerated)
    # The shards hold the regenerated conversations, token for token.
    from eyas.extraction.data import load_records, prepare
    from eyas.target import load_tokenizer

    records, _ = load_records(regenerated)
    ours = prepare(
        records,
        load_tokenizer(cfg.target.checkpoint),
        cfg.data.model_copy(update={"path": regenerated}),
        vocab_size=10**9,
    ).train
    stored = sorted(
        s.input_ids.tolist()
        for m in first.manifests
        for s in ShardReader(tmp_path / "shards" / m.file)
    )
    assert stored == sorted(t.input_ids for t in ours) and len(stored) == 8
    original, _ = load_records(data)
    assert [r.messages for r in records[-2:]] == [
        r.messages for r in original[-2:]
    ]  # held out: as they were
    assert records[0].messages != original[0].messages
    # Its progress in the UI: the regenerate-NAME artifact, complete.
    from tests.integration.test_progress_artifacts import artifacts

    bar = artifacts(f"regenerate-{cfg.name}")[-1]
    assert bar.data == 100.0 and "2/2 parts, 8/8 conversations (4 reused)" in bar.description

    second = extract(cfg)
    assert "regenerate" not in second.stages and "stop" not in second.stages  # no server launched
    assert second.ready is None
    assert [m.sha256 for m in second.manifests] == [m.sha256 for m in first.manifests]


def test_a_layer_id_out_of_range_fails_at_preflight_before_anything_is_written(
    prefect_harness, tmp_path
):
    cfg = stage_config(
        tmp_path, ROOT / "fixtures" / "tiny-target", **{"target.layer_ids": [2, 4, 50]}
    )
    state = extract(cfg, return_state=True)
    assert state.is_failed()
    with pytest.raises(ValueError, match=r"target\.layer_ids.*50"):
        state.result()
    assert (
        not (tmp_path / "shards").exists() and not (tmp_path / "server").exists()
    )  # no plan, no launch


def _kill_the_server(cfg) -> int:
    import os
    import signal

    pid = json.loads(cfg.server.pid_path.read_text())["pid"]
    os.killpg(pid, signal.SIGKILL)
    return pid


def test_a_stalled_server_fails_the_stage_within_its_stall_timeout_with_one_error(
    prefect_harness, tmp_path, monkeypatch
):
    """The server freezes (SIGSTOP) under the second shard: the stall is declared within
    extraction.stall_timeout_s of its last reply, the server is stopped at once, the stage fails
    `failed at TASK: ... server stalled: ...`, one error names the stall (the other shards in
    flight fail pointing at it), and no request is retried after it."""
    import os
    import signal

    from eyas.extraction import stage
    from eyas.extraction.extract import ExtractionError
    from eyas.server.hosts import LocalHost

    real, frozen = stage.run_shard, []

    def freezes_the_server(ctx, cfg, plan, patch_version, **kw):
        if plan.index == 1 and not frozen:
            pid = json.loads(cfg.server.pid_path.read_text())["pid"]
            os.killpg(pid, signal.SIGSTOP)
            frozen.append((pid, time.monotonic()))
        return real(ctx, cfg, plan, patch_version, **kw)

    monkeypatch.setattr(stage, "run_shard", freezes_the_server)
    data = small_data(tmp_path, 12)
    cfg = stage_config(
        tmp_path,
        ROOT / "fixtures" / "tiny-target",
        **{
            "data.path": str(data),
            "data.num_heldout": 2,
            "data.max_length": 256,
            "extraction.num_shards": 4,
            "extraction.stall_timeout_s": 10,
            "extraction.request_retries": 5,
            "extraction.retry_backoff_s": 1.0,
        },
    )
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    loggers = [logging.getLogger(n) for n in ("prefect", "eyas")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        state = extract(cfg, return_state=True)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    assert isinstance(state.result(raise_on_failure=False), ExtractionError), state
    assert re.match(r"failed at extract-\S+: .*server stalled: no reply for \d+ s", state.message)
    pid, t_frozen = frozen[0]
    assert time.monotonic() - t_frozen < 10 + 8  # the stall timeout, a tick, the stop
    assert not LocalHost().is_alive(pid)  # stopped at once (a zombie not yet reaped is gone too)
    lines = [(r.levelno, r.getMessage()) for r in records]
    errors = [m for level, m in lines if level >= logging.ERROR and "server stalled" in m]
    assert len(errors) == 1, errors
    after = lines[[m for _, m in lines].index(errors[0]) :]
    assert not [m for _, m in after if "retrying" in m], after


def test_a_killed_server_is_relaunched_once_and_a_second_death_fails_with_both_reasons(
    prefect_harness, tmp_path, monkeypatch
):
    """The server dies under the second shard: no request or task retry against the dead process;
    the flow relaunches it once, the first shard stays, the second resumes. Dying on every launch
    fails the run naming both deaths."""
    from eyas.extraction import stage
    from eyas.server.launch import ServerDied

    real, killed = stage.run_shard, []

    def kills_the_server_once(ctx, cfg, plan, patch_version, **kw):
        if plan.index == 1 and len(killed) < limit:
            killed.append(_kill_the_server(cfg))
        return real(ctx, cfg, plan, patch_version, **kw)

    monkeypatch.setattr(stage, "run_shard", kills_the_server_once)
    data = small_data(tmp_path, 8)
    cfg = stage_config(
        tmp_path,
        ROOT / "fixtures" / "tiny-target",
        **{
            "data.path": str(data),
            "data.num_heldout": 2,
            "data.max_length": 256,
            "extraction.num_shards": 2,
            "extraction.request_retries": 5,
            "extraction.retry_backoff_s": 5.0,
        },
    )

    limit = 1
    done = extract(cfg)
    assert len(killed) == 1 and len(done.manifests) == 2
    for m in done.manifests:
        verify_shard(tmp_path / "shards" / m.file)  # raises on a damaged shard
    log = cfg.server.log_path.read_text()
    assert (
        log.count("The server is fired up and ready to roll!") == 2
    )  # launched, then relaunched once
    assert len(done.relaunches) == 1 and re.match(r"pid \d+ exited", done.relaunches[0]), (
        done.relaunches
    )  # report.json's extraction.relaunches

    limit = 3
    for m in done.manifests:  # everything to do again, so the shard tasks talk to the server
        (tmp_path / "shards" / m.file).unlink()
    with pytest.raises(
        ServerDied,
        match=r"died during extraction \(pid \d+ exited: .*\), was "
        r"relaunched, and "
        r"died again \(pid \d+ exited",
    ):
        extract(cfg)
    assert len(killed) == 3
