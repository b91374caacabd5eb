"""The async client pool against real HTTP servers on loopback (stdlib servers that count and fail)."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from eyas.extraction.client import Endpoint, RequestFailed, ServerPool


class Counting(ThreadingHTTPServer):
    """Answers /generate after `delay` s; counts requests in flight; fails the first `fail` with `status`."""

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
        out = json.dumps({"error": "nope"} if failing else {"meta_info": {"id": body["rid"]}}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)


def test_in_flight_is_bounded_per_server_across_callers(tmp_path):
    a, b = Counting(), Counting()
    with ServerPool([Endpoint(a.url, tmp_path, 2), Endpoint(b.url, tmp_path, 3)], retries=0) as pool:
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
    with ServerPool([Endpoint(f"http://127.0.0.1:{free_port}", tmp_path, 2)], retries=2, backoff_s=0.05) as pool:
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
