"""What a run needs after an earlier one was killed (kill -9, OOM killer, lost node).

    # one run per output dir; a killed run's lock is gone with it
    lock_output_dir(out_dir)
    discard_partials(out_dir)             # .shard-*.partial and temp files of a killed writer
    reclaim_stale_server(host, cfg)       # stop the server a killed run of this config left running

The lock is an flock on `<output_dir>/.eyas.lock`, held for the life of the process: the kernel
drops it when the process dies, however it dies, so a lock that can be taken proves that no live
run uses this output directory. Only then are partial files deleted and a recorded server with
this config's exact command line stopped, once its pid is proven to be still the launched process
(a server of another config is never touched: the launch then refuses with its own message). A
second run that finds the lock taken fails at once with OutputBusy, having touched nothing.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from eyas.config import PipelineConfig
from eyas.errors import EyasError
from eyas.server.hosts import Host


class OutputBusy(EyasError, RuntimeError):
    """Another live process holds the output directory."""


_held: dict[str, int] = {}  # resolved lock path -> fd, for this process
_held_lock = threading.Lock()


def hold_lock(path: str | Path, *, what: str = "it", holder: str = "", busy: str = "") -> Path:
    """Hold an flock on `path` for this process (idempotent); released when the process dies.

    The lock file names the holder: its pid and `holder` (a flow run, say). Held by another process:
    OutputBusy at once, naming it, followed by `busy`. Usable for any "one live run at a time" rule
    whose holder may be killed without warning.
    """
    path = Path(path).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _held_lock:
        if str(path) in _held:
            return path
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        with _held_lock:
            if str(path) in _held:  # this process holds it (another thread got there first)
                os.close(fd)
                return path
        owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise OutputBusy(
            f"{what} is in use by another eyas run "
            f"(pid {owner.replace(' ', ', ', 1)}, lock {path}){busy}"
        ) from None
    with _held_lock:
        if str(path) in _held:  # another thread of this process took it meanwhile
            os.close(fd)  # (flock is per open file: closing ours leaves theirs held)
            return path
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {holder}".strip().encode() + b"\n", 0)
        _held[str(path)] = fd
    return path


def read_holder(path: str | Path) -> str | None:
    """What a lock file says of its last holder ("<pid> <holder>"), or None (no file, or this
    process's)."""
    try:
        text = Path(path).read_text(errors="replace").strip()
    except OSError:
        return None
    pid = text.split(" ", 1)[0]
    return None if not text or pid == str(os.getpid()) else text


def release_lock(path: str | Path) -> None:
    with _held_lock:
        fd = _held.pop(str(Path(path).resolve()), None)
    if fd is not None:
        os.close(fd)  # closing the descriptor releases the flock


def lock_output_dir(output_dir: str | Path, holder: str = "") -> Path:
    """Take the output directory's lock for this process (idempotent); OutputBusy at once if another
    has it: the caller has then launched, deleted and stopped nothing, and must not."""
    output_dir = Path(output_dir)
    return hold_lock(
        output_dir / ".eyas.lock",
        what=f"extraction.output_dir {output_dir}",
        holder=holder,
        busy="; this run stopped before touching anything (no server launched or stopped, "
        "no file deleted). Wait for that run to end, or point extraction.output_dir elsewhere",
    )


def unlock_output_dir(output_dir: str | Path) -> None:
    release_lock(Path(output_dir) / ".eyas.lock")


def discard_partials(output_dir: str | Path) -> list[str]:
    """Delete files a killed writer left (".*.partial", ".*.tmp*"); returns their names.
    Only call with the output lock held: a live writer's partial file looks the same."""
    output_dir = Path(output_dir)
    removed = []
    for folder in (output_dir, output_dir / "plan"):
        if not folder.is_dir():
            continue
        for p in folder.iterdir():
            if p.name.startswith(".") and (p.name.endswith(".partial") or ".tmp" in p.name):
                p.unlink(missing_ok=True)
                removed.append(p.name)
    return sorted(removed)


def reclaim_stale_server(host: Host, cfg: PipelineConfig) -> dict | None:
    """Stop the server recorded in server.pid if it is still the launched process and runs exactly
    this config's launch command.

    Call only with the output lock held (then no live run of this config uses that server). Returns
    what was done, or None when there was nothing to reclaim.
    """
    from eyas.secrets import redact
    from eyas.server.launch import (
        _check,
        capture_launch,
        host_launch_command,
        read_record,
        stop_server,
    )

    launch = capture_launch(cfg)
    record = read_record(host, cfg.server)
    if record is None or _check(host, launch, record) != "alive":
        return None
    command = redact(host_launch_command(host, launch))
    if (record.command or command) != command:
        return {
            "pid": record.pid,
            "outcome": "left alone: not this config's server",
            "command": redact(record.command),
        }
    return {
        **stop_server(host, launch, record),
        "reason": "stale server of a killed run of this config",
    }
