"""A newcomer's first `eyas run` (fresh PREFECT_HOME, no PREFECT_API_URL, no telemetry settings):
a successful run prints no traceback, and nothing from Prefect's telemetry."""

import os
import subprocess

import pytest

from tests.eyas_run import ROOT, command, overrides, small_data

pytestmark = pytest.mark.slow


def test_a_first_eyas_run_prints_no_traceback(tmp_path):
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "DO_NOT_TRACK"
    }
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    sets = overrides(
        tmp_path,
        small_data(tmp_path),
        **{  # regeneration: its workers log from threads
            "data.regenerate.enabled": True,
            "data.regenerate.max_new_tokens": 4,
        },
    )
    r = subprocess.run(
        command("run", sets), cwd=ROOT, env=env, text=True, capture_output=True, timeout=600
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out
    # A task timeout Prefect cannot enforce in a worker thread is not declared (eyas's own watchdogs
    # bound the stages: extraction.stall_timeout_s, the readiness sensor's deadline)
    assert "but the task is running in a worker thread" not in out
    for noise in ("telemetry", "database is locked"):
        assert noise not in out, noise
    # One Prefect server, eyas's: no thread of the run (regeneration's workers, progress publishers)
    # made Prefect start an ephemeral one of its own, and the run's last logs and events reached
    # eyas's before it stopped, none left for the exit (where they found no server: a minute, seen)
    for other in ("Starting temporary server", "Stopping temporary server", "Error logging to API"):
        assert other not in out, other
