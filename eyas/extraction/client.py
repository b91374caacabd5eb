"""Async HTTP client for one or many target servers, shared by every shard of a process.

    with ServerPool([Endpoint("http://gpu-1:30000", "/dev/shm/eyas-dump", 8),
                     Endpoint("http://gpu-2:30000", "/dev/shm/eyas-dump", 8)],
                    request_timeout_s=900, retries=5, backoff_s=2.0) as pool:
        reply = pool.generate(ids, "eyas-shard-00003-000017-ab12", {"max_new_tokens": 1}).result()
        reply.endpoint.dump_dir, reply.rid     # where and under which rid the records were dumped

One event loop runs in a daemon thread; callers in any thread get a concurrent.futures.Future.
Each endpoint has a bounded number of requests in flight, across every shard task that shares the
pool (tasks/extract.py keeps one pool per process and endpoint set), and a request goes to the
endpoint with the most free slots. Transient failures (connection refused or reset, timeouts, 5xx,
429) are retried with exponential backoff, on whichever endpoint is free and not backing off; a
server answering 4xx (a bad request: ids outside the vocabulary, say) is never retried. An endpoint
with an `alive` check whose process is found gone after a failure is dropped at once: its requests
go to the others, or fail at once when none is left, instead of backing off for minutes.

Every attempt gets its own rid (`<rid>-a<k>`), so records a dying server half-wrote for an earlier
attempt can never be mixed into the sample: the collector reads only the attempt that answered,
and removes the others (`attempt_rids`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx


class RequestFailed(RuntimeError):
    """A request that failed for good; names the rid, the endpoints tried and the last error."""

    def __init__(self, rid: str, message: str, *, transient: bool):
        self.rid, self.transient = rid, transient
        super().__init__(f"rid {rid}: {message}")


@dataclass(frozen=True)
class Endpoint:
    url: str
    dump_dir: Path  # where this server writes dump records, as seen from this machine
    max_in_flight: int = 4
    #: asked after a transient failure: False means the server process is gone, so its requests go
    #: to the other endpoints at once (or fail at once if none is left) instead of backing off
    alive: Callable[[], bool] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "url", self.url.rstrip("/"))
        object.__setattr__(self, "dump_dir", Path(self.dump_dir))
        if self.max_in_flight < 1:
            raise ValueError(f"endpoint {self.url}: max_in_flight must be >= 1, got {self.max_in_flight}")


@dataclass
class Reply:
    endpoint: Endpoint
    rid: str  # the rid of the attempt that answered (records are under this name)
    body: dict[str, Any]
    attempts: int
    seconds: float


@dataclass
class _State:
    in_flight: int = 0
    backoff_until: float = 0.0  # monotonic time; no new request before it
    failures: int = 0  # consecutive transient failures
    total_failures: int = 0
    requests: int = 0
    dead: bool = False  # its process is gone (Endpoint.alive said so): never picked again
    errors: list[str] = field(default_factory=list)


def attempt_rid(rid: str, attempt: int) -> str:
    return f"{rid}-a{attempt}"


def attempt_rids(rid: str, retries: int) -> list[str]:
    """Every rid the pool may have used for `rid` (for cleaning their records)."""
    return [attempt_rid(rid, k) for k in range(retries + 1)]


_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


class ServerPool:
    """Bounded, retrying /generate requests over one or many endpoints (see the module docstring)."""

    def __init__(self, endpoints: list[Endpoint], *, request_timeout_s: float = 300.0, retries: int = 5,
                 backoff_s: float = 2.0, backoff_max_s: float = 60.0, connect_timeout_s: float = 10.0,
                 headers: dict[str, str] | None = None):
        if not endpoints:
            raise ValueError("ServerPool needs at least one endpoint")
        urls = [e.url for e in endpoints]
        if len(set(urls)) != len(urls):
            raise ValueError(f"ServerPool: duplicate endpoint urls {urls}")
        self.endpoints = list(endpoints)
        self._headers = dict(headers or {})  # e.g. the server's API key
        self.request_timeout_s, self.retries = request_timeout_s, retries
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self._timeout = httpx.Timeout(request_timeout_s, connect=min(connect_timeout_s, request_timeout_s))
        self._state = {e.url: _State() for e in endpoints}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="eyas-client", daemon=True)
        self._thread.start()
        self._closed = False
        self._init = asyncio.run_coroutine_threadsafe(self._setup(), self._loop)
        self._init.result()

    async def _setup(self) -> None:
        slots = sum(e.max_in_flight for e in self.endpoints)
        self._client = httpx.AsyncClient(timeout=self._timeout, headers=self._headers, limits=httpx.Limits(
            max_connections=slots + 4, max_keepalive_connections=slots + 4))
        self._changed = asyncio.Condition()

    @property
    def capacity(self) -> int:
        """Requests that can be in flight at once over all endpoints."""
        return sum(e.max_in_flight for e in self.endpoints)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {url: {"requests": s.requests, "in_flight": s.in_flight, "failures": s.total_failures, "dead": s.dead,
                      "last_errors": s.errors[-3:]} for url, s in self._state.items()}

    # ------------------------------------------------------------------ public, any thread

    def generate(self, input_ids: list[int], rid: str, sampling_params: dict[str, Any]) -> concurrent.futures.Future:
        """Submit one /generate; the future's result is a Reply, or it raises RequestFailed."""
        if self._closed:
            raise RuntimeError("ServerPool is closed")
        body = {"input_ids": input_ids, "sampling_params": sampling_params}
        return asyncio.run_coroutine_threadsafe(self._generate(body, rid), self._loop)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "ServerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop side

    def _pick(self) -> Endpoint | None:
        now = time.monotonic()
        free = [e for e in self.endpoints if self._state[e.url].in_flight < e.max_in_flight
                and self._state[e.url].backoff_until <= now and not self._state[e.url].dead]
        if not free:
            return None
        return max(free, key=lambda e: (e.max_in_flight - self._state[e.url].in_flight) / e.max_in_flight)

    async def _acquire(self, rid: str) -> Endpoint:
        async with self._changed:
            while True:
                if all(s.dead for s in self._state.values()):
                    raise RequestFailed(rid, "every server's process is gone: "
                                             f"{[s.errors[-1] for s in self._state.values() if s.errors]}",
                                        transient=False)
                ep = self._pick()
                if ep is not None:
                    self._state[ep.url].in_flight += 1
                    return ep
                now = time.monotonic()
                waits = [s.backoff_until - now for s in self._state.values() if s.backoff_until > now]
                try:
                    # Woken by a release; or, when every endpoint is backing off, at the earliest end.
                    await asyncio.wait_for(self._changed.wait(), timeout=min(waits) if waits else None)
                except asyncio.TimeoutError:
                    pass

    async def _release(self, ep: Endpoint, error: str | None) -> None:
        async with self._changed:
            s = self._state[ep.url]
            s.in_flight -= 1
            s.requests += 1
            if error is None:
                s.failures = 0
            else:
                s.failures += 1
                s.total_failures += 1
                s.errors = (s.errors + [error])[-10:]
                delay = min(self.backoff_s * 2 ** (s.failures - 1), self.backoff_max_s)
                s.backoff_until = max(s.backoff_until, time.monotonic() + delay * (0.75 + 0.5 * random.random()))
            self._changed.notify_all()

    async def _generate(self, body: dict[str, Any], rid: str) -> Reply:
        t0, tried = time.monotonic(), []
        for attempt in range(self.retries + 1):
            ep = await self._acquire(rid)
            arid = attempt_rid(rid, attempt)
            error: str | None = None
            try:
                r = await self._client.post(f"{ep.url}/generate", json={**body, "rid": arid})
                if r.status_code == 200:
                    return Reply(ep, arid, r.json(), attempt + 1, time.monotonic() - t0)
                text = r.text[:500]
                if r.status_code not in _TRANSIENT_STATUS:
                    raise RequestFailed(rid, f"{ep.url} answered {r.status_code}: {text}", transient=False)
                error = f"{ep.url} answered {r.status_code}: {text}"
            except httpx.TransportError as e:  # connect/read/write errors and timeouts
                error = f"{ep.url}: {type(e).__name__}: {e or 'no message'}"
            finally:
                await self._release(ep, error)
            tried.append(error)
            if ep.alive is not None and not self._state[ep.url].dead:
                alive = await asyncio.get_running_loop().run_in_executor(None, ep.alive)
                if not alive:
                    async with self._changed:
                        s = self._state[ep.url]
                        s.dead = True
                        s.errors = (s.errors + [f"{ep.url}: the server process is gone ({error})"])[-10:]
                        self._changed.notify_all()
        raise RequestFailed(rid, f"failed after {self.retries + 1} attempts in {time.monotonic() - t0:.1f}s; "
                                 f"last errors: {tried[-3:]}", transient=True)
