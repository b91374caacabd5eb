"""A newcomer's first `eyas run` (fresh PREFECT_HOME, no PREFECT_API_URL, no telemetry settings):
a successful run prints no traceback, and nothing from Prefect's telemetry."""

import os
import subprocess

import pytest

from tests.eyas_run import ROOT, command, overrides, small_data

pytestmark = pytest.mark.slow


def test_a_first_eyas_run_prints_no_traceback(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "DO_NOT_TRACK"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(command("run", overrides(tmp_path, small_data(tmp_path))), cwd=ROOT, env=env,
                       text=True, capture_output=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out
    for noise in ("telemetry", "database is locked"):
        assert noise not in out, noise
    # the run's last logs and events reached eyas's temporary server before it stopped: none was left
    # for the exit, where Prefect would start a server of its own to deliver it (a minute, seen)
    for late in ("Error logging to API", "Stopping temporary server"):
        assert late not in out, late
