"""Async HTTP client for one or many target servers, shared by every shard of an extraction.

    with ServerPool([Endpoint("http://gpu-1:30000", "/dev/shm/eyas-dump", 8),
                     Endpoint("http://gpu-2:30000", "/dev/shm/eyas-dump", 8)],
                    request_timeout_s=900, retries=5, backoff_s=2.0) as pool:
        reply = pool.generate(ids, "eyas-shard-00003-000017-ab12", {"max_new_tokens": 1}).result()
        reply.endpoint.records.read(reply.rid) # the records dumped for it
        (eyas/extraction/records.py)

One event loop runs in a daemon thread; callers in any thread get a concurrent.futures.Future.
Each endpoint has a bounded number of requests in flight, across every shard task that shares the
pool (an extraction keeps one per endpoint set: stage.py's ExtractionContext), and a request goes to
the endpoint with the most free slots. Transient failures (connection refused or reset, timeouts,
5xx, 429) are retried with exponential backoff, on whichever endpoint is free and not backing off; a
server answering 4xx (a bad request: ids outside the vocabulary, say) is never retried. An endpoint
with an `alive` check whose process is found gone after a failure is dropped at once: its requests
go to the others, or fail at once when none is left, instead of backing off for minutes.

Every attempt gets its own rid (`<rid>-a<k>`), so records a dying server half-wrote for an earlier
attempt can never be mixed into the sample: the collector reads only the attempt that answered,
and removes the others (`attempt_rids`). Every retry is a WARNING naming the rid, the attempt and
the error.

A watchdog bounds a stall: when requests are in flight and none has completed for
`stall_timeout_s`, less the time the /health probe may take (a quarter of it, at most
health_timeout_s), every endpoint's /health is asked; one that answers is slow, not stalled (the
clock restarts, with a warning), and when none answers, stall_timeout_s after the last reply,
every pending and later request fails instead of waiting out its timeouts and retries (a stopped
process accepts connections and never answers): the first with ServerStalled ("server stalled: no
reply for N s ..."), the others with PoolStopped, which points at it. The pool stays stalled: no
request reaches that server again (a relaunched server gets a new pool,
ExtractionContext.new_server).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import httpx

from eyas.config import HostConfig
from eyas.errors import EyasError, InvalidInput, causes
from eyas.extraction.records import DumpStore

log = logging.getLogger(__name__)


class RequestFailed(EyasError, RuntimeError):
    """A request that failed for good; names the rid, the endpoints tried and the last error."""

    def __init__(self, rid: str, message: str, *, transient: bool):
        self.rid, self.transient = rid, transient
        super().__init__(f"rid {rid}: {message}")

    @property
    def retryable(self) -> bool:  # a refused request (4xx) is refused again; a dropped one may pass
        return self.transient


class ServerStalled(RequestFailed):
    """No request completed for stall_timeout_s and no server answered /health."""

    retryable = False


class Follower:
    """Marks an error that only points at another request's error: the one to read is that one
    (`naming_the_cause`). A class, not an attribute or the error's chain, so that it survives the
    pickling of a Prefect task's result."""


class PoolStopped(RequestFailed, Follower):
    """A request given up because the pool stopped for a cause that another request's error names
    (a stall fails every request in flight and later: the first one raised carries the watchdog's
    reason, the others this, so a run's log names the stall once)."""

    retryable = False


def is_follower(error: BaseException) -> bool:
    """Whether `error` (or an error it was raised from) only points at another request's error."""
    return any(isinstance(e, Follower) for e in causes(error))


def naming_the_cause(error: BaseException, others: Iterable[BaseException | None]):
    """`error`, unless it only points at another request's error: then the first of `others` (the
    errors raised beside it; None for none) that names the cause, if any."""
    if not is_follower(error):
        return error
    return next((e for e in others if e is not None and not is_follower(e)), error)


class ServersGone(RequestFailed):
    """Every server's process is gone: retrying the request cannot help; relaunching the server
    can."""

    retryable = False


@dataclass(frozen=True)
class Endpoint:
    url: str
    dump_dir: Path  # where this server writes dump records: on dump_host when given, else here
    max_in_flight: int = 4
    #: asked after a transient failure: False means the server process is gone, so its requests go
    #: to the other endpoints at once (or fail at once if none is left) instead of backing off
    alive: Callable[[], bool] | None = field(default=None, compare=False, repr=False)
    #: the host the server dumps on; None = this machine. Its records are read here when the folder
    #: is visible here, else through the host (eyas/extraction/records.py)
    dump_host: HostConfig | None = field(default=None, compare=False, repr=False)
    #: SSH connections the collector may open to dump_host at once
    dump_connections: int = field(default=2, compare=False, repr=False)
    #: the dump host's config section, named in configuration errors
    dump_field: str = field(default="server.host", compare=False, repr=False)
    #: the host an endpoint dumps on, as part of its identity (two endpoints differ by it)
    dump_key: str | None = field(init=False, default=None, repr=False)
    records: DumpStore = field(init=False, compare=False, repr=False)  #: where its records are read

    def __post_init__(self):
        object.__setattr__(self, "url", self.url.rstrip("/"))
        object.__setattr__(self, "dump_dir", Path(self.dump_dir))
        if self.max_in_flight < 1:
            raise InvalidInput(
                f"endpoint {self.url}: max_in_flight must be >= 1, got {self.max_in_flight}"
            )
        remote = self.dump_host is not None and self.dump_host.kind == "ssh"
        object.__setattr__(self, "dump_key", self.dump_host.model_dump_json() if remote else None)
        object.__setattr__(
            self,
            "records",
            DumpStore(
                self.dump_dir,
                self.dump_host,
                connections=self.dump_connections,
                field=self.dump_field,
            ),
        )


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
    """Bounded, retrying /generate requests over one or many endpoints (see the module
    docstring)."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        *,
        request_timeout_s: float = 300.0,
        retries: int = 5,
        backoff_s: float = 2.0,
        backoff_max_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        headers: dict[str, str] | None = None,
        stall_timeout_s: float | None = None,
        health_timeout_s: float = 30.0,
    ):
        if not endpoints:
            raise InvalidInput("ServerPool needs at least one endpoint")
        urls = [e.url for e in endpoints]
        if len(set(urls)) != len(urls):
            raise InvalidInput(f"ServerPool: duplicate endpoint urls {urls}")
        self.endpoints = list(endpoints)
        self._headers = dict(headers or {})  # e.g. the server's API key
        self.request_timeout_s, self.retries = request_timeout_s, retries
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self._timeout = httpx.Timeout(
            request_timeout_s, connect=min(connect_timeout_s, request_timeout_s)
        )
        self._state = {e.url: _State() for e in endpoints}
        self.stall_timeout_s, self.health_timeout_s = stall_timeout_s, health_timeout_s
        self._last_progress = (
            time.monotonic()
        )  # a reply, or the moment requests began after a pause
        self.completed = 0
        self._stalled: str | None = None  # the stall's reason, once the watchdog found one
        self._stall_named = False  # whether a request's error carried it (the others point at it)
        self._tasks: dict[asyncio.Task, Callable[..., None]] = {}  # in flight -> its caller's warn
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="eyas-client", daemon=True
        )
        self._thread.start()
        self._closed = False
        self._init = asyncio.run_coroutine_threadsafe(self._setup(), self._loop)
        self._init.result()

    async def _setup(self) -> None:
        slots = sum(e.max_in_flight for e in self.endpoints)
        self._client = httpx.AsyncClient(
            timeout=self._timeout,
            headers=self._headers,
            limits=httpx.Limits(max_connections=slots + 4, max_keepalive_connections=slots + 4),
        )
        self._changed = asyncio.Condition()
        if self.stall_timeout_s is not None:
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    @property
    def stalled(self) -> str | None:
        """The watchdog's reason once it found every server stalled (the pool then fails every
        request)."""
        return self._stalled

    @property
    def capacity(self) -> int:
        """Requests that can be in flight at once over all endpoints."""
        return sum(e.max_in_flight for e in self.endpoints)

    def stats(self) -> dict[str, dict[str, Any]]:
        return {
            url: {
                "requests": s.requests,
                "in_flight": s.in_flight,
                "failures": s.total_failures,
                "dead": s.dead,
                "last_errors": s.errors[-3:],
            }
            for url, s in self._state.items()
        }

    # ------------------------------------------------------------------ public, any thread

    def generate(
        self,
        input_ids: list[int],
        rid: str,
        sampling_params: dict[str, Any],
        *,
        warn: Callable[..., None] | None = None,
    ) -> concurrent.futures.Future:
        """Submit one /generate; the future's result is a Reply, or it raises RequestFailed.

        `warn(fmt, *args)` gets this request's retry warnings and the watchdog's, e.g. the calling
        task's logger.warning: the pool's own thread runs in no flow run, so its module logger
        reaches the console only."""
        if self._closed:
            raise RuntimeError("ServerPool is closed")
        body = {"input_ids": input_ids, "sampling_params": sampling_params}
        return asyncio.run_coroutine_threadsafe(
            self._generate(body, rid, warn or log.warning), self._loop
        )

    def calling(self, warn: Callable[..., None] | None) -> "ServerPool":
        """This pool, with `warn` given to every generate (a task's logger.warning): for callers
        that only take a pool."""
        return _Caller(self, warn) if warn is not None else self

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        for ep in self.endpoints:
            ep.records.close()  # SSH connections the collector opened to a dump host

    async def _shutdown(self) -> None:
        watchdog = getattr(self, "_watchdog", None)
        if watchdog is not None:
            watchdog.cancel()
        await self._client.aclose()

    def __enter__(self) -> "ServerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop side

    def _pick(self) -> Endpoint | None:
        now = time.monotonic()
        free = [
            e
            for e in self.endpoints
            if self._state[e.url].in_flight < e.max_in_flight
            and self._state[e.url].backoff_until <= now
            and not self._state[e.url].dead
        ]
        if not free:
            return None
        return max(
            free, key=lambda e: (e.max_in_flight - self._state[e.url].in_flight) / e.max_in_flight
        )

    async def _acquire(self, rid: str) -> Endpoint:
        async with self._changed:
            if not any(s.in_flight for s in self._state.values()):
                self._last_progress = max(
                    self._last_progress, time.monotonic()
                )  # idle time is no stall
            while True:
                if all(s.dead for s in self._state.values()):
                    raise ServersGone(
                        rid,
                        "every server's process is gone: "
                        f"{[s.errors[-1] for s in self._state.values() if s.errors]}",
                        transient=False,
                    )
                ep = self._pick()
                if ep is not None:
                    self._state[ep.url].in_flight += 1
                    return ep
                now = time.monotonic()
                waits = [
                    s.backoff_until - now for s in self._state.values() if s.backoff_until > now
                ]
                try:
                    # Woken by a release; or, when every endpoint is backing off, at the earliest
                    # end.
                    await asyncio.wait_for(
                        self._changed.wait(), timeout=min(waits) if waits else None
                    )
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
                s.backoff_until = max(
                    s.backoff_until, time.monotonic() + delay * (0.75 + 0.5 * random.random())
                )
            self._changed.notify_all()

    async def _generate(self, body: dict[str, Any], rid: str, warn: Callable[..., None]) -> Reply:
        if self._stalled is not None:
            raise self._stall_error(rid)
        task = asyncio.current_task()
        self._tasks[task] = warn
        try:
            reply = await self._attempts(body, rid, warn)
        except asyncio.CancelledError:
            if self._stalled is None:
                raise
            raise self._stall_error(rid) from None
        finally:
            self._tasks.pop(task, None)
        self._last_progress, self.completed = time.monotonic(), self.completed + 1
        return reply

    def _stall_error(self, rid: str) -> RequestFailed:
        """The stall's reason for the first request it fails, PoolStopped for the rest (all raised
        on the pool's one event loop, so exactly one carries it)."""
        if self._stall_named:
            return PoolStopped(
                rid,
                "given up with every request in flight: another request's error says why",
                transient=False,
            )
        self._stall_named = True
        return ServerStalled(rid, self._stalled, transient=False)

    async def _attempts(self, body: dict[str, Any], rid: str, warn: Callable[..., None]) -> Reply:
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
                    raise RequestFailed(
                        rid, f"{ep.url} answered {r.status_code}: {text}", transient=False
                    )
                error = f"{ep.url} answered {r.status_code}: {text}"
            except httpx.TransportError as e:  # connect/read/write errors and timeouts
                error = f"{ep.url}: {type(e).__name__}: {e or 'no message'}"
            finally:
                await self._release(ep, error)
            tried.append(error)
            if attempt < self.retries:
                warn(
                    "rid %s: attempt %d of %d failed (%s); retrying",
                    rid,
                    attempt + 1,
                    self.retries + 1,
                    error,
                )
            if ep.alive is not None and not self._state[ep.url].dead:
                alive = await asyncio.get_running_loop().run_in_executor(None, ep.alive)
                if not alive:
                    async with self._changed:
                        s = self._state[ep.url]
                        s.dead = True
                        s.errors = (s.errors + [f"{ep.url}: the server process is gone ({error})"])[
                            -10:
                        ]
                        self._changed.notify_all()
        raise RequestFailed(
            rid,
            f"failed after {self.retries + 1} attempts in {time.monotonic() - t0:.1f}s; "
            f"last errors: {tried[-3:]}",
            transient=True,
        )

    # ------------------------------------------------------------------ the stall watchdog

    async def _watch(self) -> None:
        # The /health probe runs inside the stall timeout, so a stall is declared stall_timeout_s
        # after the last reply (within a tick), not a probe's timeout later.
        probe_s = min(self.health_timeout_s, self.stall_timeout_s / 4)
        tick = min(1.0, self.stall_timeout_s / 8)
        while True:
            await asyncio.sleep(tick)
            busy = any(s.in_flight for s in self._state.values())
            quiet = time.monotonic() - self._last_progress
            if not busy or quiet < self.stall_timeout_s - probe_s:
                continue
            health = await asyncio.gather(
                *(self._health(e, probe_s) for e in self.endpoints if not self._state[e.url].dead)
            )
            quiet = time.monotonic() - self._last_progress
            if any(ok for ok, _ in health):
                self._warn_callers(
                    "no request completed for %.0f s, but %s: slow, not stalled; waiting on",
                    quiet,
                    "; ".join(why for _, why in health),
                )
                self._last_progress = time.monotonic()
                continue
            self._stalled = (
                f"server stalled: no reply for {quiet:.0f} s (extraction.stall_timeout_s="
                f"{self.stall_timeout_s:g}; {self.completed} request(s) completed before; "
                f"{'; '.join(why for _, why in health)})"
            )
            self._warn_callers(
                "%s: failing the %d request(s) in flight", self._stalled, len(self._tasks)
            )
            for task in list(self._tasks):
                task.cancel()
            return

    def _warn_callers(self, fmt: str, *args) -> None:
        """Once per distinct caller's warn among the requests in flight (each task's own log)."""
        for warn in {id(w): w for w in self._tasks.values()}.values() or [log.warning]:
            warn(fmt, *args)

    async def _health(self, ep: Endpoint, timeout_s: float) -> tuple[bool, str]:
        try:
            r = await self._client.get(f"{ep.url}/health", timeout=timeout_s)
        except httpx.TransportError as e:
            return False, f"{ep.url}/health: {type(e).__name__} after {timeout_s:g} s"
        return r.status_code == 200, f"{ep.url}/health answered {r.status_code}"


class _Caller:
    """A ServerPool whose generate passes one caller's warn (ServerPool.calling)."""

    def __init__(self, pool: ServerPool, warn: Callable[..., None]):
        self._pool, self._warn = pool, warn

    def generate(self, input_ids, rid, sampling_params, *, warn=None):
        return self._pool.generate(input_ids, rid, sampling_params, warn=warn or self._warn)

    def __getattr__(self, name):
        return getattr(self._pool, name)
