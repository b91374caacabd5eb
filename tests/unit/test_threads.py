"""eyas's OpenMP wait policy: passive on a busy machine, left alone on an idle one or where set."""

import os
import subprocess
import sys

from eyas.threads import busy_cores, cpu_settings


def test_a_busy_machine_gets_passive_waiting_an_idle_one_nothing():
    assert cpu_settings({}, busy=1.6) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert cpu_settings({}, busy=0.1) == {}
    assert cpu_settings({"OMP_WAIT_POLICY": "ACTIVE"}, busy=2.0) == {}  # the operator's own


def test_busy_cores_sees_a_spinning_process():
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        busy = busy_cores(0.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy is not None and 0.5 <= busy <= os.cpu_count(), busy


def test_the_eyas_command_sets_it_before_torch_loads():
    """`eyas` beside a spinning process: its environment says PASSIVE by the time a command runs,
    and torch was not loaded before."""
    probe = (
        "import sys, os\n"
        "from eyas import cli\n"
        "def show(args):\n"
        "    print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
        "    return 0\n"
        "cli.main(['probe', 'x'], extra=[cli.Command('probe', 'p', show)])\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        spinner.kill()
        spinner.wait()
    assert out.stdout.split() == ["PASSIVE", "False"], out.stdout + out.stderr
    # ... and says so, once, with how to choose
    said = "OMP_WAIT_POLICY=PASSIVE; set OMP_WAIT_POLICY to choose"
    assert out.stderr.count(said) == 1, out.stderr


def test_an_operators_own_policy_is_kept_and_nothing_is_said(monkeypatch):
    from eyas.threads import apply_cpu_settings

    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert apply_cpu_settings() is None and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
