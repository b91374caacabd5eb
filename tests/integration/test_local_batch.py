"""Continuous batching in the local server: concurrent requests decode in shared forwards and get
exactly the tokens they get one at a time (greedy, seeded sampling, stop tokens, uneven lengths)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from eyas.server.readiness import READY_LINE
from eyas.local.engine import Engine, load_model
from tests.integration.test_local_server import greedy_reference, prompt

PARAMS = dict(temperature=0.0, ignore_eos=False, stop_token_ids=[], sampling_seed=None, skip_special_tokens=True)


@pytest.fixture(scope="module")
def model(random_target):
    torch.set_num_threads(1)
    return load_model(random_target)


def _requests() -> list[tuple[list[int], dict]]:
    """Uneven prompts and lengths; two seeded sampled requests; one stops at a stop token."""
    reqs = [(prompt(n, seed), dict(PARAMS, max_new_tokens=m))
            for seed, (n, m) in enumerate([(40, 12), (7, 20), (90, 5), (3, 16), (61, 9), (25, 14)])]
    reqs[1][1].update(temperature=0.9, sampling_seed=11)
    reqs[4][1].update(temperature=1.3, sampling_seed=5)
    return reqs


def test_batched_decoding_gives_the_one_at_a_time_tokens(model):
    reqs = _requests()
    alone = Engine(model, None, chunk_size=16, writer=None, capture_ids=[2])
    want = [alone.generate(ids, f"a{i}", p)["output_ids"] for i, (ids, p) in enumerate(reqs)]
    # a request that stops early: its own greedy output's 3rd token made a stop token
    stop_req = (reqs[0][0], dict(PARAMS, max_new_tokens=12, stop_token_ids=[want[0][2]]))
    reqs.append(stop_req)
    want.append(alone.generate(*stop_req[:1], "stop", stop_req[1])["output_ids"])
    assert want[-1] == want[0][:3]

    batched = Engine(model, None, chunk_size=16, writer=None, capture_ids=[2], max_running=4)
    with ThreadPoolExecutor(len(reqs)) as ex:
        got = list(ex.map(lambda ir: batched.generate(ir[1][0], f"b{ir[0]}", ir[1][1]), enumerate(reqs)))
    assert [g["output_ids"] for g in got] == want
    assert got[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": want[0][2]}
    assert got[2]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    b = batched.batch
    # every token after a request's first came from a shared step; with 7 requests on 4 rows the
    # steps must have held several rows at once
    assert b.tokens == sum(len(w) - 1 for w in want)
    assert b.steps < b.tokens / 2
    assert batched.num_completion_tokens == sum(len(w) for w in want)


def test_a_failing_step_fails_its_requests_and_the_batch_goes_on(model):
    engine = Engine(model, None, chunk_size=16, writer=None, capture_ids=[2], max_running=2)
    forward, calls = engine.batch.model, []

    def broken_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom in a decode step")
        return forward(*args, **kwargs)

    engine.batch.model = broken_once
    with pytest.raises(RuntimeError, match="boom in a decode step"):
        engine.generate(prompt(10, 1), "x", dict(PARAMS, max_new_tokens=4))
    ok = engine.generate(prompt(10, 1), "y", dict(PARAMS, max_new_tokens=4))["output_ids"]
    assert ok == Engine(model, None, chunk_size=16, writer=None, capture_ids=[2]).generate(
        prompt(10, 1), "z", dict(PARAMS, max_new_tokens=4))["output_ids"]


def test_server_with_max_running_requests_matches_greedy_reference(start_server, random_target):
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(random_target, dtype=torch.float32).eval()
    proc = start_server("--max-running-requests", "4", "--skip-server-warmup", name="batched-server")
    proc.wait_for(READY_LINE)
    prompts = [prompt(n, 100 + n) for n in (5, 33, 12, 48, 20)]
    with httpx.Client(base_url=proc.url, timeout=60) as c, ThreadPoolExecutor(5) as ex:
        replies = list(ex.map(lambda p: c.post("/generate", json={
            "input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 10}}).json(), prompts))
    for p, r in zip(prompts, replies):
        assert r["output_ids"] == greedy_reference(ref_model, p, 10)


def test_dp_replicas_share_the_requests_and_answer_as_one_model(start_server, random_target):
    """--dp-size 2: requests in flight spread over both replicas (their /server_info states), each
    answering exactly what the one model would (greedy reference)."""
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(random_target, dtype=torch.float32).eval()
    proc = start_server("--dp-size", "2", "--max-running-requests", "2", "--skip-server-warmup", name="dp-server")
    proc.wait_for(READY_LINE)
    prompts = [prompt(n, 200 + n) for n in (7, 30, 14, 41, 22, 9)]
    with httpx.Client(base_url=proc.url, timeout=60) as c, ThreadPoolExecutor(6) as ex:
        replies = list(ex.map(lambda p: c.post("/generate", json={
            "input_ids": p, "sampling_params": {"temperature": 0, "max_new_tokens": 12}}).json(), prompts))
        states = c.get("/server_info").json()["internal_states"]
    for p, r in zip(prompts, replies):
        assert r["output_ids"] == greedy_reference(ref_model, p, 12)
    assert len(states) == 2 and all(s["num_completion_tokens"] > 0 for s in states)  # both served
    assert sum(s["num_completion_tokens"] for s in states) == 12 * len(prompts)
    from eyas.local.replicas import worker_argv
    from eyas.local.arguments import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "x", "--dp-size", "0"])
    # a worker: its own loopback port, one replica, no warm-up, and no injected fault (the front's fires)
    w = parse_args(worker_argv(["--model-path", "x", "--port", "1", "--dp-size", "2", "--fault", "oom-at-shard"], 5))
    assert (w.port, w.host, w.dp_size, w.fault, w.skip_server_warmup, w.dp_worker) == (
        5, "127.0.0.1", 1, "none", True, True)
    # A replica that dies takes the server with it: a crash the sensor and the extraction see
    import os
    import re
    import time
    worker = int(re.search(r"\(pids \[(\d+)\]", proc.log_text()).group(1))
    os.kill(worker, 9)
    deadline = time.monotonic() + 20
    while proc.host.is_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not proc.host.is_alive(proc.pid)
    assert f"dp replica 1 (pid {worker}) exited with code -9: stopping the server" in proc.log_text()


def _prefilled(engine: Engine, ids: list[int], max_new: int, cls=None):
    from eyas.local.batch import Sequence

    logits, cache = engine.prefill(ids, "p")
    return (cls or Sequence)(logits, cache, len(ids), max_new, 0.0, set(), torch.Generator())


def test_a_request_that_cannot_join_fails_instead_of_hanging(model):
    engine = Engine(model, None, chunk_size=16, writer=None, capture_ids=[2], max_running=2)
    bad = _prefilled(engine, prompt(8, 2), 5)
    bad.cache = object()  # no KV layers: laying out the batch cache fails
    with ThreadPoolExecutor(1) as ex:
        with pytest.raises(AttributeError):
            ex.submit(engine.batch.decode, bad).result(timeout=60)
        good = ex.submit(engine.batch.decode, _prefilled(engine, prompt(8, 2), 5)).result(timeout=60)
    assert good[0] == Engine(model, None, chunk_size=16, writer=None, capture_ids=[2]).generate(
        prompt(8, 2), "z", dict(PARAMS, max_new_tokens=5))["output_ids"]


def test_one_requests_sampling_error_fails_that_request_only(model):
    from eyas.local.batch import Sequence

    class FailsOnThirdToken(Sequence):
        def take(self, logits):
            if len(self.output) == 2:
                raise ValueError("bad sampling")
            return super().take(logits)

    engine = Engine(model, None, chunk_size=16, writer=None, capture_ids=[2], max_running=2)
    bad, good = _prefilled(engine, prompt(9, 3), 6, FailsOnThirdToken), _prefilled(engine, prompt(12, 4), 6)
    with ThreadPoolExecutor(2) as ex:
        fb, fg = ex.submit(engine.batch.decode, bad), ex.submit(engine.batch.decode, good)
        with pytest.raises(ValueError, match="bad sampling"):
            fb.result(timeout=60)
        assert len(fg.result(timeout=60)[0]) == 6
