"""How eyas's CPU work shares the machine's cores with other jobs.

OpenMP's threads (torch's intra-op pool) spin for a while when they wait for work. On an idle
machine that is the fastest way to wait; beside other jobs a spinning thread burns the time slice
the thread it waits for needs, and a training step slows far beyond its share of the cores
(bench/contention.py). OMP_WAIT_POLICY=PASSIVE makes waiting threads sleep: beside other jobs the
step keeps to about its share, at some cost on an idle machine. So eyas's processes wait passively
when the machine is busy as they start, and spin when it is idle.

OpenMP reads the setting once, when the library loads (when torch is first imported): it is put
into the environment before that, and the processes eyas starts inherit it. An operator's own
OMP_WAIT_POLICY is kept. The choice holds for the whole command, so the sample is long enough
(half a second) that a moment's work of another command does not decide it, and the command says
when it chose to sleep: on a machine that turns idle after the start, PASSIVE costs a training step
about a third (bench/contention.py).
"""

from __future__ import annotations

import os
import time

#: cores other processes keep busy at start at or above which waiting threads sleep
BUSY_CORES = 0.5


def busy_cores(interval_s: float = 0.5) -> float | None:
    """How many cores are busy now (from /proc/stat, over interval_s); None where it is absent."""

    def sample() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields), idle

    first = sample()
    time.sleep(interval_s)
    second = sample()
    if first is None or second is None or second[0] <= first[0]:
        return None
    total, idle = second[0] - first[0], second[1] - first[1]
    return (1 - idle / total) * os.cpu_count()


def cpu_settings(env: dict[str, str] | None = None, busy: float | None = None) -> dict[str, str]:
    """The OpenMP settings for a process starting now: PASSIVE waiting on a busy machine (`busy`
    cores, measured when not given), none on an idle one or where `env` (default: this process's
    environment) sets a wait policy already."""
    env = os.environ if env is None else env
    if "OMP_WAIT_POLICY" in env:
        return {}
    busy = busy_cores() if busy is None else busy
    return {"OMP_WAIT_POLICY": "PASSIVE"} if busy is not None and busy >= BUSY_CORES else {}


def apply_cpu_settings() -> str | None:
    """Put cpu_settings into this process's environment (before torch is first imported) -> a line
    saying what was set and why (None: nothing was)."""
    if "OMP_WAIT_POLICY" in os.environ:
        return None
    busy = busy_cores()
    if busy is None:  # no /proc/stat: nothing known, nothing set
        return None
    settings = cpu_settings(busy=busy)
    os.environ.update(settings)
    if not settings:
        return None
    return (
        f"{busy:.1f} of {os.cpu_count()} cores were busy as this command started: OpenMP's waiting "
        "threads sleep for all of it (OMP_WAIT_POLICY=PASSIVE; set OMP_WAIT_POLICY to choose)"
    )
