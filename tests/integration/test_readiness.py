"""The readiness sensor: parsers on real tqdm text, and the wait loop against real processes."""

from __future__ import annotations

import io
import shlex
import sys
import threading
import time

import pytest
from tqdm import tqdm

from eyas.config import HostConfig
from eyas.local.engine import BAR_DESC, BAR_FORMAT
from eyas.server.hosts import LocalHost
from eyas.server.readiness import (
    READY_LINE,
    LogCursor,
    Progress,
    ServerFailed,
    classify_fatal,
    parse_progress,
    wait_until_ready,
)
from eyas.server.ssh_host import SSHHost

POLL = 0.25


def wait(proc, **overrides):
    kwargs = dict(
        log_path=proc.log_path,
        pid=proc.pid,
        url=proc.url,
        poll_interval_s=POLL,
        stall_timeout_s=60,
        deadline_s=120,
        http_timeout_s=10,
    )
    return wait_until_ready(proc.host, **{**kwargs, **overrides})


# --- LogCursor -------------------------------------------------------------------------------


def test_log_cursor_splits_on_cr_and_keeps_fragments(tmp_path):
    path = tmp_path / "server.log"
    cursor = LogCursor(LocalHost(), path)
    assert cursor.poll() == [] and cursor.offset == 0  # not written yet: empty, not an error
    with open(path, "wb") as f:
        f.write(b"[t] Load weight begin\n\rbar 0/8\rbar 1/8")
        f.flush()
        assert cursor.poll() == ["[t] Load weight begin", "bar 0/8"]
        assert cursor.pending == "bar 1/8"
        f.write("\rbar 2/8\n[t] caf\xc3".encode("latin-1"))  # a UTF-8 character cut in half
        f.flush()
        assert cursor.poll() == ["bar 1/8", "bar 2/8"]
        f.write(b"\xa9 ready\r\n")
        f.flush()
        assert cursor.poll() == ["[t] café ready"]
    assert cursor.offset == path.stat().st_size and cursor.pending == ""


# --- parse_progress --------------------------------------------------------------------------


def real_bar_text(num_shards: int, step_s: float, desc: str = BAR_DESC) -> str:
    """What tqdm really writes with SGLang's bar format, updates separated by \\r."""
    out = io.StringIO()
    bar = tqdm(
        total=num_shards, desc=desc, bar_format=BAR_FORMAT, file=out, mininterval=0, miniters=1
    )
    for _ in range(num_shards):
        time.sleep(step_s)
        bar.update(1)
    bar.close()
    return out.getvalue()


def test_parse_progress_on_real_tqdm_output():
    text = real_bar_text(4, 0.01)
    updates = [parse_progress(part) for part in text.replace("\n", "\r").split("\r") if part]
    assert [(p.done, p.total) for p in updates] == [(0, 4), (1, 4), (2, 4), (3, 4), (4, 4), (4, 4)]
    first = updates[0]
    assert first.remaining_s is None and first.rate_it_s is None and first.percent == 0
    assert updates[-1].percent == 100 and updates[-1].rate_it_s > 10

    slow = real_bar_text(1, 1.1, desc="Loading safetensors checkpoint shards")
    last = parse_progress(slow.split("\r")[-1])
    assert last.desc == "Loading safetensors checkpoint shards" and "s/it" in slow
    assert 0.5 < last.rate_it_s < 1.0 and last.elapsed_s == 1.0


def test_parse_progress_on_sglang_doc_lines():
    p = parse_progress(
        "Multi-thread loading shards:  53% Completed | 34/64 [00:05<00:03,  7.58it/s]"
    )
    assert p == Progress(BAR_DESC, 34, 64, 53, 5.0, 3.0, 7.58)
    p = parse_progress(
        "Loading safetensors checkpoint shards:  40% Completed | 65/163 "
        "[1:02:03<1:33:20, 57.30s/it]"
    )
    assert (p.done, p.total, p.elapsed_s, p.remaining_s) == (65, 163, 3723.0, 5600.0)
    assert p.rate_it_s == pytest.approx(1 / 57.3)
    assert parse_progress("[2026-01-01 00:00:00] Load weight end. elapsed=3.1 s") is None
    assert (
        parse_progress("Capturing batches (bs=8 avail_mem=10.1 GB): 100%|##| 4/4 [00:01<00:00]")
        is None
    )


# --- classify_fatal --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, reason",
    [
        (
            "[2026-01-01 00:00:00 TP0] Scheduler hit an exception: Traceback (most recent call "
            "last):",
            "crashed",
        ),
        (
            "[2026-01-01 00:00:00] Received sigquit from a child process. It usually means the "
            "child failed.",
            "crashed",
        ),
        (
            "[2026-01-01 00:00:00] SIGQUIT received. signum=None, frame=None. It usually means one "
            "child failed.",
            "crashed",
        ),
        ("[2026-01-01 00:00:00] DetokenizerManager hit an exception: Traceback", "crashed"),
        (
            "[2026-01-01 00:00:00] Subprocess scheduler_0 (pid=4242) crashed with exit code -9",
            "crashed",
        ),
        ("Traceback (most recent call last):", "crashed"),
        (
            "[2026-01-01 00:00:00] Rank 3 scheduler died during initialization (exit code: -9)",
            "init failed",
        ),
        ("[2026-01-01 00:00:00] Initialization failed. warmup error: Traceback", "init failed"),
        (
            "[2026-01-01 00:00:00 TP0] Scheduler watchdog timeout (self.watchdog_timeout=300, "
            "self.soft=False)",
            "watchdog timeout",
        ),
        ("RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.", "oom"),
        ("[2026-01-01 00:00:00 TP0] Capture cuda graph failed: CUDA error", "cuda graph failed"),
        (
            "[2026-01-01 00:00:00] Health check failed. Server couldn't get a response from "
            "detokenizer",
            "health check failed",
        ),
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.75 GiB. GPU 0 has",
            "oom",
        ),
        (
            "torch.distributed.DistBackendError: NCCL error in: "
            "../torch/csrc/distributed/c10d/NCCLUtils.hpp",
            "nccl",
        ),
        ("[rank0]:[E101] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=1)", "nccl"),
        ("RuntimeError: CUDA error: an illegal memory access was encountered", "cuda error"),
    ],
)
def test_classify_fatal(line, reason):
    assert classify_fatal(line) == reason


@pytest.mark.parametrize(
    "line",
    [
        "[2026-01-01 00:00:00] Load weight begin. avail mem=78.12 GB",
        "Multi-thread loading shards:  53% Completed | 34/64 [00:05<00:03,  7.58it/s]",
        "[2026-01-01 00:00:00] The server is fired up and ready to roll!",
        "[2026-01-01 00:00:00] Subprocess output crashed the parser",  # not the watchdog's line
    ],
)
def test_classify_fatal_ignores_normal_lines(line):
    assert classify_fatal(line) is None


# --- wait_until_ready against real processes -------------------------------------------------


@pytest.fixture(scope="module")
def slow_failures(start_server):
    """Servers that fail on their own: started together, early, so their start-up overlaps."""
    return {
        "hang": start_server(
            "--fault", "hang-at-shard", "--fault-shard", "4", "--load-delay", "0.02", name="hang"
        ),
        "oom": start_server("--fault", "oom-at-shard", "--fault-shard", "2", name="oom"),
    }


def test_ready_is_detected_with_progress(start_server, slow_failures, random_target):
    proc = start_server("--load-delay", "0.05", name="ready")
    seen: list[Progress] = []
    report = wait(proc, on_progress=seen.append)
    num_shards = len(list(random_target.glob("*.safetensors")))
    assert report.shards_total == num_shards and report.last_progress.done == num_shards
    assert len(seen) >= 3 and [p.done for p in seen] == sorted(
        {p.done for p in seen}
    )  # changes only
    assert 0 < report.seconds < 120
    assert 0 < report.log_offset <= proc.log_path.stat().st_size
    assert READY_LINE in proc.log_text()


def test_death_while_loading_is_crashed_within_two_polls(start_server):
    proc = start_server(
        "--fault", "die-at-shard", "--fault-shard", "3", "--load-delay", "0.05", name="die"
    )
    died_at: list[float] = []

    def watch_exit():  # when the process really ends (Python's teardown after a traceback is slow)
        while proc.host.is_alive(proc.pid):
            time.sleep(0.01)
        died_at.append(time.monotonic())

    watcher = threading.Thread(target=watch_exit, daemon=True)
    watcher.start()
    with pytest.raises(ServerFailed) as e:
        wait(proc)
    detected = time.monotonic()
    watcher.join(5)
    assert e.value.reason == "crashed"
    assert any("Traceback (most recent call last)" in line for line in e.value.fatal_lines)
    assert any("eyas fault injection: died after 3 of" in line for line in e.value.log_lines)
    assert detected - died_at[0] < 2 * POLL + 0.2


def test_hang_while_loading_is_a_stall(slow_failures):
    proc = slow_failures["hang"]
    with pytest.raises(ServerFailed) as e:
        wait(proc, stall_timeout_s=2)
    assert e.value.reason == "stalled"
    assert "at 4/" in str(e.value)  # the newest bar update, still without its terminator
    assert proc.host.is_alive(proc.pid)
    with pytest.raises(ServerFailed) as e:
        wait(proc, deadline_s=0.5)
    assert e.value.reason == "deadline"


def test_oom_is_named_and_quoted(slow_failures):
    proc = slow_failures["oom"]
    with pytest.raises(ServerFailed) as e:
        wait(proc)
    assert e.value.reason == "oom"
    assert any(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate" in x
        for x in e.value.fatal_lines
    )
    assert any("Scheduler hit an exception" in x for x in e.value.fatal_lines)
    assert "CUDA out of memory" in str(e.value)


def _start(host: LocalHost, tmp_path, script: str) -> tuple[int, str]:
    log = tmp_path / "server.log"
    pid = host.start(shlex.join([sys.executable, "-c", script]), log_path=log)
    return pid, str(log)


def test_silent_exit_is_process_died_and_old_runs_are_skipped(tmp_path):
    host = LocalHost()
    log = tmp_path / "server.log"
    log.write_text("[2026-01-01 00:00:00] old run: torch.OutOfMemoryError: CUDA out of memory.\n")
    before = log.stat().st_size  # Host.start appends: this launch's output starts here
    pid = host.start(
        shlex.join([sys.executable, "-c", "print('starting', flush=True)"]), log_path=log
    )
    with pytest.raises(ServerFailed) as e:
        wait_until_ready(
            host,
            log_path=log,
            pid=pid,
            url="http://127.0.0.1:1",
            poll_interval_s=POLL,
            stall_timeout_s=30,
            deadline_s=30,
            http_timeout_s=1,
            start_offset=before,
        )
    assert e.value.reason == "process died" and e.value.log_lines == ["starting"]


def test_a_launch_refused_by_the_servers_arguments_fails_with_its_error_line_first(
    tmp_path, free_port
):
    """The real `eyas serve-local` given a flag it does not know: argparse prints its usage (about
    20 lines) and then the error. The failure is one line of at most 260 characters that starts
    with argparse's error line; the usage text stays in the log tail."""
    host = LocalHost()
    command = shlex.join(
        [sys.executable, "-m", "eyas", "serve-local", "--model-path", str(tmp_path)]
        + ["--port", str(free_port), "--api-key", "sk-abc", "--bogus-flag"]
    )
    log = tmp_path / "server.log"
    pid = host.start(command, log_path=log)
    with pytest.raises(ServerFailed) as e:
        wait_until_ready(
            host,
            log_path=log,
            pid=pid,
            url=f"http://127.0.0.1:{free_port}",
            poll_interval_s=POLL,
            stall_timeout_s=60,
            deadline_s=120,
            http_timeout_s=1,
        )
    message = str(e.value)
    assert message.startswith("eyas serve-local: error: unrecognized arguments: --bogus-flag ("), (
        message
    )
    assert len(message) <= 260 and "\n" not in message, message
    assert e.value.reason == "process died" and "[--port PORT]" in e.value.log_tail()
    assert "sk-abc" not in e.value.log_tail()


def test_ready_line_without_http_is_not_ready(tmp_path, free_port):
    host = LocalHost()
    pid, log = _start(
        host, tmp_path, f"import time; print({READY_LINE!r}, flush=True); time.sleep(30)"
    )
    try:
        with pytest.raises(ServerFailed) as e:
            wait_until_ready(
                host,
                log_path=log,
                pid=pid,
                url=f"http://127.0.0.1:{free_port}",
                poll_interval_s=POLL,
                stall_timeout_s=30,
                deadline_s=30,
                http_timeout_s=0.5,
            )
        assert e.value.reason == "http not ready"
    finally:
        host.kill_group(pid, 9)


# one print line: a test swaps it for a print of its own
HARMLESS_TRACEBACK = f"""
import http.server, sys, threading, time
print("Traceback (most recent call last):\\n  File \\"x.py\\", line 1\\nImportError: optional", flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
s = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
time.sleep(1.0)
print({READY_LINE!r}, flush=True)
s.serve_forever()
"""  # noqa: E501


def test_a_traceback_the_process_survives_is_not_fatal(tmp_path, free_port):
    host, port = LocalHost(), free_port
    log = tmp_path / "server.log"
    pid = host.start(
        shlex.join([sys.executable, "-c", HARMLESS_TRACEBACK, str(port)]), log_path=log
    )
    try:
        report = wait_until_ready(
            host,
            log_path=log,
            pid=pid,
            url=f"http://127.0.0.1:{port}",
            poll_interval_s=POLL,
            stall_timeout_s=30,
            deadline_s=30,
            http_timeout_s=5,
        )
        assert report.shards_total is None
    finally:
        host.kill_group(pid, 9)


def test_unreachable_host_gives_up_after_three_tries(free_port):
    closed = free_port  # nothing listens: every connect is refused
    host = SSHHost(
        HostConfig(
            kind="ssh",
            name="gpu-x",
            hostname="127.0.0.1",
            port=closed,
            insecure_accept_any_host_key=True,
            connect_timeout_s=1,
        )
    )
    sleeps: list[float] = []
    with pytest.raises(ServerFailed) as e:
        wait_until_ready(
            host,
            log_path="/srv/eyas/server.log",
            pid=1,
            url="http://127.0.0.1:1",
            poll_interval_s=0.01,
            stall_timeout_s=30,
            deadline_s=30,
            http_timeout_s=1,
            sleep=sleeps.append,
        )
    assert e.value.reason == "host unreachable"
    assert (
        str(e.value).startswith("host unreachable: [gpu-x] host unreachable") and len(sleeps) == 2
    )


def test_a_stub_drafts_bar_after_the_targets_leaves_the_targets_shard_count(tmp_path, free_port):
    """A capture launch on SGLang 0.5.18 loads a one-file stub draft after the target: its bar
    follows the target's on the same \\r-separated line, and the report still counts the target's
    shards."""
    host, port = LocalHost(), free_port
    bars = real_bar_text(5, 0.0).rstrip("\n") + real_bar_text(1, 0.0)
    script = HARMLESS_TRACEBACK.replace(
        'print("Traceback', f"print({bars!r}, end='', flush=True)\n#", 1
    )
    log = tmp_path / "server.log"
    pid = host.start(shlex.join([sys.executable, "-c", script, str(port)]), log_path=log)
    try:
        report = wait_until_ready(
            host,
            log_path=log,
            pid=pid,
            url=f"http://127.0.0.1:{port}",
            poll_interval_s=POLL,
            stall_timeout_s=30,
            deadline_s=30,
            http_timeout_s=5,
        )
        assert report.shards_total == 5 and report.last_progress.total == 1
    finally:
        host.kill_group(pid, 9)


def test_each_replica_of_a_dp_server_is_seen_loading_then_loaded(start_server):
    """--dp-size 2: both replicas' lines reach the log with their ranks (SGLang's "DP1 TP0"), and
    the sensor reports each one's load as it changes, and all of them at ready; the worker's bar
    and ready line stay out of the log."""
    proc = start_server("--dp-size", "2", "--load-delay", "0.05", name="dp-ready")
    seen: list[dict[str, str]] = []
    report = wait(proc, on_replicas=seen.append)
    assert report.replicas == {"DP0": "loaded", "DP1": "loaded"}, seen
    assert seen[-1] == report.replicas and all(set(s) <= {"DP0", "DP1"} for s in seen)
    for rank in ("DP0", "DP1"):  # each went through loading to loaded
        states = [s[rank] for s in seen if rank in s]
        assert states[0] == "loading" and states[-1] == "loaded", seen
    text = proc.log_text()
    assert " DP1 TP0] Load weight end." in text and " DP0 TP0] Load weight end." in text
    assert text.count(READY_LINE) == 1  # the front's: the worker's ready line is not relayed
    bars = [line for line in text.replace("\r", "\n").splitlines() if "% Completed |" in line]
    assert bars and len({parse_progress(b).total for b in bars}) == 1


def test_one_replica_names_no_replicas(start_server):
    proc = start_server("--skip-server-warmup", name="one-replica")
    seen: list[dict[str, str]] = []
    assert wait(proc, on_replicas=seen.append).replicas == {} and seen == []
    assert " DP0 " not in proc.log_text()
