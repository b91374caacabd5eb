"""A local target server ends with the process that launched it.

A pipeline run starts eyas's local server detached (its own session, so a signal to the run does not
reach it and stop_server can end its whole process group). When the run's process dies without
stopping it (kill -9, an OOM kill), nothing else would: the launch therefore names the launcher in
the server's environment, and the server exits once that process is gone.

    env[LAUNCHER_ENV] = launcher_identity()      # in the launching process (eyas/server/launch.py)
    exit_with_launcher(log)                      # in the server, at start (eyas/local/server.py)

A process is named by its pid and its start time (/proc/<pid>/stat field 22): a pid is reused, the
pair is not. A server a `serve` run leaves up on purpose is launched without it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

LAUNCHER_ENV = "EYAS_LAUNCHER"  #: "<pid>:<start time>" of the process whose death ends the server
POLL_S = 1.0


def _start_time(pid: int) -> str | None:
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return None
    return stat[stat.rfind(")") + 2 :].split()[19]  # field 22; comm may hold spaces and parentheses


def launcher_identity(pid: int | None = None) -> str | None:
    """This process's (or pid's) "<pid>:<start time>", or None where there is no /proc."""
    pid = os.getpid() if pid is None else pid
    start = _start_time(pid)
    return f"{pid}:{start}" if start is not None else None


def launcher_alive(identity: str) -> bool:
    pid, start = identity.split(":", 1)
    return _start_time(int(pid)) == start


def exit_with_launcher(log: Callable[[str], None], environ=os.environ) -> None:
    """Watch the launcher named in LAUNCHER_ENV; when it is gone, end this server's process group
    (the server and its replicas) with SIGTERM, as stop_server would."""
    identity = environ.get(LAUNCHER_ENV)
    if not identity:
        return

    def watch() -> None:  # the launcher may be gone already: it can die while this server imports
        while launcher_alive(identity):
            time.sleep(POLL_S)
        log(
            f"the process that launched this server (pid {identity.split(':')[0]}) has exited "
            f"without stopping it: shutting down"
        )
        if os.getpgrp() == os.getsid(0):  # launched through setsid: the group is this server's own
            os.killpg(os.getpgrp(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)  # replicas follow (replicas.exit_with_parent)

    threading.Thread(target=watch, name="eyas-launcher-watch", daemon=True).start()
