"""The async client pool against real HTTP servers on loopback (stdlib servers that count and
fail)."""

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eyas.extraction.client import (
    Endpoint,
    PoolStopped,
    RequestFailed,
    ServerPool,
    ServerStalled,
    is_follower,
)


class Counting(ThreadingHTTPServer):
    """Answers /generate after `delay` s; counts requests in flight; fails the first `fail` with
    `status`."""

    daemon_threads = True

    def __init__(self, delay=0.05, fail=0, status=503):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.delay, self.fail, self.status = delay, fail, status
        self.in_flight = self.max_in_flight = self.requests = 0
        self.rids = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_GET(self):  # /health answers at once, however slow /generate is
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with s.lock:
            s.in_flight += 1
            s.max_in_flight = max(s.max_in_flight, s.in_flight)
            s.requests += 1
            s.rids.append(body["rid"])
            failing = s.fail > 0
            s.fail -= failing
        time.sleep(s.delay)
        with s.lock:
            s.in_flight -= 1
        status = s.status if failing else 200
        out = json.dumps(
            {"error": "nope"} if failing else {"meta_info": {"id": body["rid"]}}
        ).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def test_in_flight_is_bounded_per_server_across_callers(tmp_path):
    a, b = Counting(), Counting()
    with ServerPool(
        [Endpoint(a.url, tmp_path, 2), Endpoint(b.url, tmp_path, 3)], retries=0
    ) as pool:
        # Two "shard tasks" (threads) submitting 20 requests each share the per-server bounds.
        def shard(k):
            futs = [pool.generate([1, 2], f"s{k}-{i}", {}) for i in range(20)]
            return [f.result(10) for f in futs]

        threads = [threading.Thread(target=shard, args=(k,)) for k in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    assert a.requests + b.requests == 40
    assert a.max_in_flight == 2 and b.max_in_flight == 3  # reached, never exceeded
    assert b.requests > a.requests  # the wider server takes more


def test_transient_errors_are_retried_with_a_new_rid_and_4xx_is_not(tmp_path):
    flaky = Counting(fail=2, status=503)
    with ServerPool([Endpoint(flaky.url, tmp_path, 1)], retries=3, backoff_s=0.05) as pool:
        reply = pool.generate([1], "r", {}).result(10)
    assert reply.attempts == 3 and reply.rid == "r-a2" and flaky.rids == ["r-a0", "r-a1", "r-a2"]

    bad = Counting(fail=5, status=400)
    with ServerPool([Endpoint(bad.url, tmp_path, 1)], retries=3, backoff_s=0.05) as pool:
        with pytest.raises(RequestFailed, match=r"rid q: .* answered 400") as e:
            pool.generate([1], "q", {}).result(10)
    assert bad.requests == 1 and not e.value.transient


def test_a_dead_server_fails_after_the_retries_naming_the_error(tmp_path, free_port):
    with ServerPool(
        [Endpoint(f"http://127.0.0.1:{free_port}", tmp_path, 2)], retries=2, backoff_s=0.05
    ) as pool:
        t0 = time.monotonic()
        with pytest.raises(RequestFailed, match=r"failed after 3 attempts.*ConnectError") as e:
            pool.generate([1], "x", {}).result(10)
    assert e.value.transient and time.monotonic() - t0 < 5


def test_requests_fail_over_to_the_live_server(tmp_path, free_port):
    live = Counting(delay=0.01)
    dead = Endpoint(f"http://127.0.0.1:{free_port}", tmp_path, 4)
    with ServerPool([dead, Endpoint(live.url, tmp_path, 1)], retries=2, backoff_s=5) as pool:
        replies = [f.result(10) for f in [pool.generate([1], f"r{i}", {}) for i in range(6)]]
    assert {r.endpoint.url for r in replies} == {live.url} and live.requests == 6


def test_every_retry_is_a_warning_naming_the_rid_the_attempt_and_the_error(tmp_path, caplog):
    server = Counting(fail=1, status=503)
    with ServerPool([Endpoint(server.url, tmp_path, 1)], retries=2, backoff_s=0.05) as pool:
        assert pool.generate([1, 2], "eyas-w", {}).result(10).attempts == 2
    [warning] = [
        r for r in caplog.records if r.levelname == "WARNING" and r.name == "eyas.extraction.client"
    ]
    assert (
        "rid eyas-w: attempt 1 of 3 failed" in warning.getMessage()
        and "answered 503" in warning.getMessage()
    )


def test_a_slow_server_that_answers_health_is_not_a_stall(tmp_path, caplog):
    server = Counting(delay=2.5)
    with ServerPool(
        [Endpoint(server.url, tmp_path, 1)], retries=0, stall_timeout_s=0.8, health_timeout_s=1
    ) as pool:
        assert pool.generate([1], "eyas-slow", {}).result(20).attempts == 1
        assert pool.stalled is None
    assert "slow, not stalled" in caplog.text


def test_a_stopped_server_is_a_stall_named_in_one_line_not_hours_of_retries(
    tmp_path, random_target
):
    """SIGSTOP: the kernel still accepts connections, nothing answers. The watchdog fails every
    request in flight and every later one, with the reason, within stall + health timeouts."""
    import os
    import signal

    from eyas.server.hosts import LocalHost
    from eyas.server.launch import capture_launch, start_server, stop_server
    from eyas.server.readiness import wait_until_ready
    from tests.stage_config import stage_config

    host, cfg = LocalHost(), stage_config(tmp_path, random_target)
    handle = start_server(host, capture_launch(cfg))
    try:
        wait_until_ready(
            host,
            log_path=handle.log_path,
            pid=handle.pid,
            url=handle.url,
            start_offset=handle.log_offset,
            poll_interval_s=0.2,
            stall_timeout_s=60,
            deadline_s=120,
            http_timeout_s=5,
        )
        os.killpg(handle.pid, signal.SIGSTOP)
        with ServerPool(
            [Endpoint(handle.url, cfg.server.dump_dir, 2)],
            request_timeout_s=600,
            retries=5,
            stall_timeout_s=2,
            health_timeout_s=1,
        ) as pool:
            t0 = time.monotonic()
            first = pool.generate([1, 2, 3], "eyas-stop-0", {"max_new_tokens": 1})
            second = pool.generate([4, 5, 6], "eyas-stop-1", {"max_new_tokens": 1})
            errors = []
            for future in (first, second):
                with pytest.raises(RequestFailed) as failed:
                    future.result(30)
                errors.append(failed.value)
            assert time.monotonic() - t0 < 15
            # the stall is named once: one request in flight carries the reason, the other (and
            # every later one) points at it
            named = [e for e in errors if isinstance(e, ServerStalled)]
            assert len(named) == 1, errors
            assert re.search(r"server stalled: no reply for \d+ s .*health", str(named[0]))
            assert [is_follower(e) for e in errors].count(True) == 1, errors
            with pytest.raises(PoolStopped) as later:  # later requests fail at once
                pool.generate([7], "eyas-stop-2", {}).result(1)
            assert is_follower(later.value) and not later.value.retryable
    finally:
        os.killpg(handle.pid, signal.SIGCONT)
        stop_server(host, capture_launch(cfg), handle)
