"""Is the server up yet? The readiness sensor: tail its log through a Host, fail fast, confirm HTTP.

    report = wait_until_ready(host, log_path=cfg.server.log_path, pid=pid, url=cfg.server.url,
                              poll_interval_s=1, stall_timeout_s=600, deadline_s=3600,
                              http_timeout_s=5, on_progress=lambda p: print(p.done, p.total))

The pieces are separate and pure where they can be: `LogCursor` reads new bytes from a byte offset
(tqdm separates bar updates with \\r, so lines are split on \\r and \\n), `parse_progress` reads one
loading-bar line, `classify_fatal` names a fatal line. `wait_until_ready` is one loop with its own
monotonic deadline that puts them together; it imports nothing from Prefect.
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from eyas.errors import EyasError
from eyas.secrets import redact
from eyas.server.hosts import Host, HostUnreachable

READY_LINE = "The server is fired up and ready to roll!"
TAIL_LINES = 20  # log lines quoted in a ServerFailed
MAX_UNREACHABLE = 3  # consecutive HostUnreachable before giving up


# ---------------------------------------------------------------------------------------------
# Reading the log incrementally
# ---------------------------------------------------------------------------------------------


class LogCursor:
    """New complete lines of a (growing) log file on a host, from a saved byte offset.

    A trailing fragment without \\r or \\n is kept for the next poll, and exposed as `pending`:
    tqdm's newest bar update is always such a fragment (the next update starts with \\r).
    A missing file reads as empty: the server may not have written its log yet.
    """

    def __init__(self, host: Host, path: str | Path, offset: int = 0):
        self.host = host
        self.path = path
        self.offset = offset
        self._partial = b""  # undecoded, so a UTF-8 character split across reads survives

    def poll(self) -> list[str]:
        chunks = []
        while True:
            data, self.offset = self.host.read_from(self.path, self.offset)
            if not data:
                break
            chunks.append(data)
        buf = self._partial + b"".join(chunks)
        pieces = re.split(rb"[\r\n]", buf)
        self._partial = pieces.pop()
        return [line for p in pieces if (line := p.decode("utf-8", "replace").rstrip())]

    @property
    def pending(self) -> str:
        return self._partial.decode("utf-8", "replace").rstrip()


# ---------------------------------------------------------------------------------------------
# Loading-bar lines
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    desc: str  # "Multi-thread loading shards" or "Loading safetensors checkpoint shards"
    done: int  # shards loaded
    total: int
    percent: int
    elapsed_s: float
    remaining_s: float | None  # None while tqdm shows "?"
    rate_it_s: float | None  # shards per second (converted from s/it); None for "?"

    @property
    def key(self) -> tuple[str, int, int]:
        """What counts as a change: elapsed time moving on alone is not progress."""
        return (self.desc, self.done, self.total)


# SGLang 0.5.23's BAR_FORMAT, as its weight loader prints it (docs/operations.md):
#   "{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}]"
_BAR_RE = re.compile(
    r"(Multi-thread loading shards|Loading safetensors checkpoint "
    r"shards):\s+(\d+)% "
    r"Completed \| (\d+)/(\d+) \[([^<\]]*)<([^,\]]*), ([^\]]*)\]"
)
_RATE_RE = re.compile(r"([\d.]+)(it/s|s/it)")


def _interval_s(text: str) -> float | None:
    """tqdm's [d, ][h:]mm:ss -> seconds; None for '?'."""
    text = text.strip()
    if text == "?" or not text:
        return None
    days = 0
    if "d, " in text:
        d, text = text.split("d, ", 1)
        days = int(d)
    seconds = 0
    for part in text.split(":"):
        seconds = seconds * 60 + int(part)
    return float(days * 86400 + seconds)


def bar_totals(line: str) -> list[int]:
    """The totals of every loading-bar update on this line (tqdm's \r-separated updates)."""
    return [int(m.group(4)) for m in _BAR_RE.finditer(line)]


# A data-parallel replica's load, from its scheduler's lines: "[time DP1 TP0] Load weight begin."
# and "[time DP1 TP0] Load weight end. ...". Not anchored: another process's bar update may run into
# the line ahead of it.
_REPLICA_RE = re.compile(r"\[[^\[\]]*?\b(DP\d+)\b[^\[\]]*\]\s*Load weight (begin|end)")


def replica_load(line: str) -> tuple[str, str] | None:
    """("DP1", "loading" or "loaded") for a replica's load begin or end line, else None."""
    m = _REPLICA_RE.search(line)
    if m is None:
        return None
    return m[1], "loading" if m[2] == "begin" else "loaded"


def parse_progress(line: str) -> Progress | None:
    """The loading bar's state on this line (the last one, if a line holds several), or None."""
    matches = list(_BAR_RE.finditer(line))
    if not matches:
        return None
    desc, pct, done, total, elapsed, remaining, rate = matches[-1].groups()
    r = _RATE_RE.search(rate)
    rate_it_s = None
    if r:
        value = float(r[1])
        rate_it_s = value if r[2] == "it/s" else (1.0 / value if value else None)
    try:
        elapsed_s = _interval_s(elapsed) or 0.0
        remaining_s = _interval_s(remaining)
    except ValueError:
        return None
    return Progress(desc, int(done), int(total), int(pct), elapsed_s, remaining_s, rate_it_s)


# ---------------------------------------------------------------------------------------------
# Fatal lines SGLang 0.5.23 prints (docs/operations.md, failure table), most specific first: the
# first class found names the failure
# ---------------------------------------------------------------------------------------------

_TRACEBACK = "Traceback (most recent call last)"
_FATAL: list[tuple[str, tuple[str, ...]]] = [
    (
        "oom",
        ("CUDA out of memory", "OutOfMemoryError", "Not enough memory. Please try to increase"),
    ),
    ("nccl", ("NCCL error", "DistBackendError", "Watchdog caught collective operation timeout")),
    ("cuda error", ("CUDA error: an illegal memory access",)),
    ("watchdog timeout", ("Scheduler watchdog timeout",)),
    ("cuda graph failed", ("Capture cuda graph failed",)),
    ("health check failed", ("Health check failed",)),
    ("init failed", ("Initialization failed", "scheduler died during initialization")),
    (
        "crashed",
        (
            "Scheduler hit an exception",
            "Received sigquit from a child process",
            "SIGQUIT received",
            "DetokenizerManager hit an exception",
            "crashed with exit code",
            _TRACEBACK,
        ),
    ),
]
_RANK = {reason: i for i, (reason, _) in enumerate(_FATAL)}
_SUBPROCESS_CRASHED = re.compile(r"Subprocess \S+ \(pid=\d+\) crashed with exit code")


# The line that says why a process ended, as its tools print it last: argparse's `PROG: error: ...`,
# a Python exception's last line (`torch.OutOfMemoryError: CUDA out of memory. ...`).
_STAMP = re.compile(r"^(?:\[[^\]]*\]\s*)+")  # SGLang's "[DATE TIME TP0] " prefix
_ARGPARSE_ERROR = re.compile(r"^[^:]{1,80}: error: \S")  # PROG may have spaces
_EXCEPTION_LINE = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)(?::\s.*)?$"
)


def cause_line(lines: list[str]) -> str | None:
    """The line of a log tail that says why the process ended: argparse's error line, else the last
    exception line, else the most telling fatal line; None where no line says."""
    text = [_STAMP.sub("", line).strip() for line in lines if line.strip()]
    for pattern in (_ARGPARSE_ERROR, _EXCEPTION_LINE):
        found = [line for line in text if pattern.match(line)]
        if found:
            return found[-1]
    fatal = [
        (r, line) for line in text if (r := classify_fatal(line)) and not _bare_traceback(line)
    ]
    return min(fatal, key=lambda f: _RANK[f[0]])[1] if fatal else None


def classify_fatal(line: str) -> str | None:
    """A short reason ("oom", "nccl", "crashed", ...) if the line means the server failed, else
    None."""
    for reason, needles in _FATAL:
        for needle in needles:
            if needle in line:
                if needle == "crashed with exit code" and not _SUBPROCESS_CRASHED.search(line):
                    continue
                return reason
    return None


# ---------------------------------------------------------------------------------------------
# The wait loop
# ---------------------------------------------------------------------------------------------


class ServerFailed(EyasError, RuntimeError):
    """The server will not become ready. Its message is one line that leads with the cause: for a
    server that died, the line of its log that says why (cause_line), then `(reason: detail)`.
    `.reason` is short ("oom", "stalled", "process died", ...), `.log_lines` the last lines of its
    log (for the run's log and its failure artifact, not the message), `.fatal_lines` the lines
    that gave it away."""

    def __init__(
        self,
        reason: str,
        log_lines: list[str],
        detail: str = "",
        fatal_lines: list[str] | None = None,
    ):
        self.reason = reason
        self.detail = detail
        self.log_lines = [
            redact(line) for line in log_lines
        ]  # SGLang logs its args, an api_key among them
        self.fatal_lines = [redact(line) for line in fatal_lines or []]
        what = f"{reason}: {detail}" if detail else reason
        cause = cause_line(self.log_lines) if reason in DIED_REASONS else None
        super().__init__(_one_line(cause, what))

    def log_tail(self) -> str:
        """The log's last lines, as they were written."""
        return "\n".join(self.log_lines)


#: reasons for which the log's last error line is the cause (a stall or a deadline has none)
DIED_REASONS = {"process died", "crashed", *(reason for reason, _ in _FATAL)}
MAX_MESSAGE = 260  # leaves room for "failed at TASK: " in a state message of at most 300


def _one_line(cause: str | None, what: str) -> str:
    """`cause (what)`, or `what`, cut to MAX_MESSAGE: the cause keeps up to 160 characters."""
    if not cause:
        return what if len(what) <= MAX_MESSAGE else what[: MAX_MESSAGE - 3] + "..."
    cause = cause if len(cause) <= 160 else cause[:157] + "..."
    room = MAX_MESSAGE - len(cause) - 3
    what = what if len(what) <= room else what[: room - 3] + "..."
    return f"{cause} ({what})"


@dataclass
class ReadyReport:
    seconds: float  # from the call to HTTP confirmation
    shards_total: (
        int | None
    )  # the widest loading bar's total: the target's checkpoint (None: no bar)
    last_progress: Progress | None
    log_offset: int  # bytes of the log read so far: a later reader can start there
    # each data-parallel replica's load ("DP0": "loaded"); empty where the log names no replica
    replicas: dict[str, str] = field(default_factory=dict)


class _LogWatch:
    """The sensor's view of the log: last lines (bar updates collapsed), newest bar, fatal lines."""

    def __init__(
        self,
        host: Host,
        path: str | Path,
        offset: int,
        clock: Callable[[], float],
        on_progress: Callable[[Progress], None] | None,
        on_replicas: Callable[[dict[str, str]], None] | None = None,
    ):
        self.cursor = LogCursor(host, path, offset)
        self.clock = clock
        self.on_progress, self.on_replicas = on_progress, on_replicas
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.last_activity = clock()  # launch: the stall clock starts here
        self.progress: Progress | None = None
        # The most steps any bar counted: the target's shards. A capture launch that loads a stub
        # EAGLE-3 draft (SGLang 0.5.18) prints the draft's one-file bar after it, on the same line.
        self.shards_total: int | None = None
        self.fatal: list[tuple[str, str]] = []  # (reason, line), oldest first
        self.ready = False
        self.replicas: dict[str, str] = {}  # "DP1" -> "loading" | "loaded", in rank order

    def read(self) -> None:
        newest, replicas = None, dict(self.replicas)
        for line in self.cursor.poll():
            load = replica_load(line)
            if load is not None:
                replicas[load[0]] = load[1]
            bar = parse_progress(line)
            if bar is not None and self.tail and parse_progress(self.tail[-1]) is not None:
                self.tail[-1] = line  # keep one bar line in the quoted tail, not one per shard
            else:
                self.tail.append(line)
            if bar is not None:
                newest = bar
                self.shards_total = max([self.shards_total or 0, *bar_totals(line)])
            else:
                self.last_activity = self.clock()  # any other new line: the server is moving
            reason = classify_fatal(line)
            if reason:
                self.fatal.append((reason, line))
            self.ready = self.ready or READY_LINE in line
        if replicas != self.replicas:
            self.replicas = dict(sorted(replicas.items(), key=lambda kv: int(kv[0][2:])))
            if self.on_replicas:
                self.on_replicas(dict(self.replicas))
        # tqdm's newest update has no terminator until the next one: read it from the fragment.
        newest = parse_progress(self.cursor.pending) or newest
        if newest and (self.progress is None or newest.key != self.progress.key):
            self.progress = newest
            self.shards_total = max(self.shards_total or 0, newest.total)
            self.last_activity = self.clock()
            if self.on_progress:
                self.on_progress(newest)

    def lines(self) -> list[str]:
        pending = self.cursor.pending
        return [*self.tail, pending] if pending else list(self.tail)

    def confirmed_fatal(self) -> bool:
        """Any fatal line other than a bare Python traceback, which libraries also print
        harmlessly."""
        return any(not _bare_traceback(line) for _, line in self.fatal)


def _bare_traceback(line: str) -> bool:
    return classify_fatal(line.replace(_TRACEBACK, "")) is None


def death_reason(host: Host, log_path: str | Path, offset: int = 0) -> str:
    """Why a server that was up has gone, from its log since `offset`: the most telling fatal line
    ("oom: torch.OutOfMemoryError: CUDA out of memory ..."), else its last log line."""
    watch = _LogWatch(host, log_path, offset, time.monotonic, None)
    watch.read()
    fatal = [
        (reason, line) for reason, line in watch.fatal if not _bare_traceback(line)
    ] or watch.fatal
    if fatal:
        reason, line = min(fatal, key=lambda f: _RANK[f[0]])
        return f"{reason}: {redact(line.strip())[:300]}"
    last = [line for line in watch.lines() if line.strip()]
    return (
        f"no fatal line in {log_path}; its last line: {redact(last[-1].strip())[:300]}"
        if last
        else f"{log_path} is empty"
    )


def wait_until_ready(
    host: Host,
    *,
    log_path: str | Path,
    pid: int,
    url: str,
    poll_interval_s: float,
    stall_timeout_s: float,
    deadline_s: float,
    http_timeout_s: float,
    on_progress: Callable[[Progress], None] | None = None,
    on_replicas: Callable[[dict[str, str]], None] | None = None,
    start_offset: int = 0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> ReadyReport:
    """Wait for the ready line, then confirm over HTTP; raise ServerFailed as soon as it cannot
    come.

    Each tick reads the new log lines and fails on:
    - a fatal line (an SGLang fatal message, an OOM/NCCL/CUDA error); a bare Python traceback
      counts once the process has died, or if it is not followed by death within a grace period
      it is kept only as context (tracebacks are also printed by harmless warnings);
    - the process being gone ("process died", or the reason found in its last lines);
    - a stall: no new bar state and no other new log line for stall_timeout_s, counted from the
      call (launch) until the first line;
    - the deadline, deadline_s after the call.
    HostUnreachable is retried MAX_UNREACHABLE times in a row, then "host unreachable"; a log file
    that does not exist yet is simply empty. After the ready line, GET /health_generate must answer
    200 within http_timeout_s ("http not ready" otherwise).

    on_progress gets each new state of the loading bar; on_replicas each new state of the
    data-parallel replicas' loads ({"DP0": "loaded", "DP1": "loading"}), where the log names them.

    start_offset: where this launch's output begins in the log. Host.start appends to the log, so
    after a relaunch pass the log's size from before it, or an earlier run's lines are read too.
    """
    wait = _Wait(
        host,
        log_path,
        pid,
        poll_interval_s,
        clock,
        sleep,
        _LogWatch(host, log_path, start_offset, clock, on_progress, on_replicas),
    )
    while True:
        try:
            wait.watch.read()
            alive = wait.watch.ready or wait.watch.confirmed_fatal() or host.is_alive(pid)
            wait.unreachable = 0
        except HostUnreachable as e:
            wait.unreachable += 1
            if wait.unreachable >= MAX_UNREACHABLE:
                raise wait.failed(
                    "host unreachable", f"{e} ({wait.unreachable} tries in a row)"
                ) from e
            sleep(poll_interval_s)
            continue
        now = clock()
        if wait.watch.confirmed_fatal():
            raise wait.fail_with_log("crashed", "")
        if wait.watch.ready:
            _confirm_http(
                url,
                http_timeout_s,
                min(wait.start + deadline_s, now + http_timeout_s),
                clock,
                sleep,
                wait.failed,
            )
            return ReadyReport(
                seconds=clock() - wait.start,
                shards_total=wait.watch.shards_total,
                last_progress=wait.watch.progress,
                log_offset=wait.watch.cursor.offset,
                replicas=wait.watch.replicas,
            )
        wait.check(now, alive, stall_timeout_s, deadline_s)
        sleep(max(0.0, min(poll_interval_s, wait.start + deadline_s - now)))


def wait_for_server(
    host: Host,
    handle,
    sensor,
    on_progress: Callable[[Progress], None] | None = None,
    on_replicas: Callable[[dict[str, str]], None] | None = None,
):
    """wait_until_ready for a launched server (a launch.ServerHandle) with the config's sensor
    settings (SensorConfig) -> ReadyReport."""
    return wait_until_ready(
        host,
        log_path=handle.log_path,
        pid=handle.pid,
        url=handle.url,
        start_offset=handle.log_offset,
        poll_interval_s=sensor.poll_interval_s,
        stall_timeout_s=sensor.stall_timeout_s,
        deadline_s=sensor.deadline_s,
        http_timeout_s=sensor.http_timeout_s,
        on_progress=on_progress,
        on_replicas=on_replicas,
    )


class _Wait:
    """One wait for readiness: the log being watched, and how each way of failing is named."""

    def __init__(
        self, host: Host, log_path, pid: int, poll_interval_s: float, clock, sleep, watch: _LogWatch
    ):
        self.host, self.log_path, self.pid, self.poll_interval_s = (
            host,
            log_path,
            pid,
            poll_interval_s,
        )
        self.clock, self.sleep, self.watch = clock, sleep, watch
        self.start = clock()
        self.unreachable = 0
        self.traceback_grace_s = max(10.0, 3 * poll_interval_s)
        self.traceback_seen_at: float | None = None

    def failed(self, reason: str, detail: str) -> ServerFailed:
        where = f"log {self.log_path} on {getattr(self.host, 'name', 'host')}, pid {self.pid}"
        return ServerFailed(
            reason,
            self.watch.lines(),
            f"{detail} ({where})",
            [line for _, line in self.watch.fatal],
        )

    def fail_with_log(self, default: str, detail: str, dead: bool = False) -> ServerFailed:
        """Name the worst failure in the log's last lines. A live process may still be writing
        its traceback, so it gets a moment; a dead one has written everything it will."""
        if not dead:
            self.sleep(min(self.poll_interval_s, 0.2))
        try:
            self.watch.read()
        except HostUnreachable:
            pass
        if self.watch.fatal:
            reason = min((r for r, _ in self.watch.fatal), key=_RANK.__getitem__)
            return self.failed(reason, detail or "fatal line in the server log")
        return self.failed(default, detail)

    def check(self, now: float, alive: bool, stall_timeout_s: float, deadline_s: float) -> None:
        """Raise ServerFailed if the server cannot become ready any more: a dead process, a stall,
        the deadline. A bare traceback the process outlives is forgotten."""
        watch = self.watch
        if not alive:
            raise self.fail_with_log(
                "process died", f"server process {self.pid} exited before it was ready", dead=True
            )
        if watch.fatal and self.traceback_seen_at is None:
            self.traceback_seen_at = now
        if (
            self.traceback_seen_at is not None
            and now - self.traceback_seen_at > self.traceback_grace_s
        ):
            watch.fatal.clear()  # the process outlived its traceback: it was not fatal
            self.traceback_seen_at = None
        if now - watch.last_activity > stall_timeout_s:
            p = watch.progress
            at = f" at {p.done}/{p.total} shards" if p else ""
            raise self.failed(
                "stalled",
                f"no loading progress or log output for {now - watch.last_activity:.1f}s"
                f"{at} (stall_timeout_s={stall_timeout_s})",
            )
        if now - self.start > deadline_s:
            raise self.failed(
                "deadline", f"not ready after {now - self.start:.1f}s (deadline_s={deadline_s})"
            )


def _confirm_http(
    url: str,
    http_timeout_s: float,
    until: float,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    failed: Callable[[str, str], ServerFailed],
) -> None:
    """GET /health_generate (or /health where that route is missing) until a 200 or `until`."""
    last = "no answer"
    while True:
        for path in ("/health_generate", "/health"):
            try:
                r = httpx.get(
                    f"{url}{path}", timeout=max(0.1, min(http_timeout_s, until - clock()))
                )
            except httpx.HTTPError as e:
                last = f"GET {url}{path}: {type(e).__name__}: {e}"
                break
            if r.status_code == 200:
                return
            last = f"GET {url}{path} -> {r.status_code}"
            if r.status_code != 404:
                break  # the route exists but is not healthy yet
        if clock() >= until:
            raise failed("http not ready", f"the ready line was logged, but {last}")
        sleep(min(0.2, max(0.0, until - clock())))
