"""Continuous batching in the local server as a subprocess: concurrent requests, and --dp-size
replicas, answer as the one model does (the engine's batching in process:
tests/unit/local/test_batch.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from eyas.server.readiness import READY_LINE
from tests.local_reference import greedy_reference, prompt


def test_server_with_max_running_requests_matches_greedy_reference(start_server, random_target):
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(random_target, dtype=torch.float32).eval()
    proc = start_server(
        "--max-running-requests", "4", "--skip-server-warmup", name="batched-server"
    )
    proc.wait_for(READY_LINE)
    prompts = [prompt(n, 100 + n) for n in (5, 33, 12, 48, 20)]
    with httpx.Client(base_url=proc.url, timeout=60) as c, ThreadPoolExecutor(5) as ex:
        replies = list(
            ex.map(
                lambda p: c.post(
                    "/generate",
                    json={
                        "input_ids": p,
                        "sampling_params": {"temperature": 0, "max_new_tokens": 10},
                    },
                ).json(),
                prompts,
            )
        )
    for p, r in zip(prompts, replies):
        assert r["output_ids"] == greedy_reference(ref_model, p, 10)


def test_dp_replicas_share_the_requests_and_answer_as_one_model(start_server, random_target):
    """--dp-size 2: requests in flight spread over both replicas (their /server_info states), each
    answering exactly what the one model would (greedy reference)."""
    from transformers import AutoModelForCausalLM

    ref_model = AutoModelForCausalLM.from_pretrained(random_target, dtype=torch.float32).eval()
    proc = start_server(
        "--dp-size", "2", "--max-running-requests", "2", "--skip-server-warmup", name="dp-server"
    )
    proc.wait_for(READY_LINE)
    prompts = [prompt(n, 200 + n) for n in (7, 30, 14, 41, 22, 9)]
    with httpx.Client(base_url=proc.url, timeout=60) as c, ThreadPoolExecutor(6) as ex:
        replies = list(
            ex.map(
                lambda p: c.post(
                    "/generate",
                    json={
                        "input_ids": p,
                        "sampling_params": {"temperature": 0, "max_new_tokens": 12},
                    },
                ).json(),
                prompts,
            )
        )
        states = c.get("/server_info").json()["internal_states"]
    for p, r in zip(prompts, replies):
        assert r["output_ids"] == greedy_reference(ref_model, p, 12)
    assert len(states) == 2 and all(s["num_completion_tokens"] > 0 for s in states)  # both served
    assert sum(s["num_completion_tokens"] for s in states) == 12 * len(prompts)
    from eyas.local.arguments import parse_args
    from eyas.local.replicas import worker_argv

    with pytest.raises(SystemExit):
        parse_args(["--model-path", "x", "--dp-size", "0"])
    # a worker: its own loopback port, one replica, no warm-up, and no injected fault (the front's
    # fires)
    w = parse_args(
        worker_argv(
            ["--model-path", "x", "--port", "1", "--dp-size", "2", "--fault", "oom-at-shard"], 5, 1
        )
    )
    assert (w.port, w.host, w.dp_size, w.fault, w.skip_server_warmup, w.dp_worker, w.dp_rank) == (
        5,
        "127.0.0.1",
        1,
        "none",
        True,
        True,
        1,
    )
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
    assert (
        f"dp replica 1 (pid {worker}) exited with code -9: stopping the server" in proc.log_text()
    )
