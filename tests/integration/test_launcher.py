"""A local target server started by a run ends when that run's process dies without stopping it
(kill -9 of `eyas run`), unless it was launched to stay up (a top-level `serve` run)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from eyas.server.hosts import LocalHost
from eyas.server.launch import capture_launch, stop_recorded
from tests.stage_config import ROOT, stage_config

LAUNCHER = """
import sys, time
from eyas.config import PipelineConfig
from eyas.server.hosts import LocalHost
from eyas.server.launch import capture_launch, start_server
cfg = PipelineConfig.model_validate_json(open(sys.argv[1]).read())
handle = start_server(LocalHost(), capture_launch(cfg), leave_up=sys.argv[2] == "leave_up")
print(handle.pid, flush=True)
time.sleep(600)
"""


def _gone(host: LocalHost, pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not host.is_alive(pid):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize("mode", ["tied", "leave_up"])
def test_a_local_server_ends_with_the_process_that_launched_it(tmp_path, random_target, mode):
    host, cfg = LocalHost(), stage_config(tmp_path, random_target)
    (tmp_path / "cfg.json").write_text(cfg.model_dump_json())
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "cfg.json"), mode],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        pid = int(launcher.stdout.readline())
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        if mode == "tied":
            assert _gone(host, pid, 15), "the server outlived the run that launched it"
            assert (
                "has exited without stopping it: shutting down" in cfg.server.log_path.read_text()
            )
        else:
            assert not _gone(host, pid, 3), (
                "a server launched to stay up went down with its launcher"
            )
    finally:
        launcher.kill()
        stop_recorded(host, capture_launch(cfg))
