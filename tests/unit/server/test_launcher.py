"""A process named by its pid and start time, as a local server names the run that launched it (the
server ending with that run: tests/integration/test_launcher.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from eyas.server.launcher import launcher_alive, launcher_identity


def test_a_launcher_is_alive_until_it_exits_and_a_reused_pid_is_not_it():
    me = launcher_identity()
    pid, start = me.split(":")
    assert int(pid) == os.getpid() and start.isdigit() and launcher_alive(me)
    assert not launcher_alive(f"{pid}:{int(start) + 1}")  # the same pid started at another time
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    ident = launcher_identity(child.pid)
    child.wait()
    assert ident is not None and not launcher_alive(ident)
    assert launcher_identity(child.pid) is None
