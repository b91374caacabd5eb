"""A run stops only a server it launched, and eyas deletes only folders it made (issue 16, part 1).

Real `eyas run` and `eyas stop` processes on 127.0.0.1 against the session's Prefect server, real
signals, real unrelated processes that a stale pid record could name.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from eyas.server.hosts import LocalHost, wait_dead
from eyas.server.launch import LaunchError, capture_launch, start_server
from tests import eyas_run
from tests.stage_config import stage_config


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None once it is gone: a pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return None if stat[stat.rfind(")") + 2] == "Z" else stat[stat.rfind(")") + 2 :].split()[19]


@pytest.fixture
def api_url(prefect_harness) -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


def test_a_second_run_of_a_busy_config_fails_at_once_and_leaves_the_first_runs_server_alone(
    tmp_path, api_url
):
    data = eyas_run.small_data(tmp_path)
    sets = eyas_run.overrides(tmp_path, data, name="owned")
    run, env, host = eyas_run.command("run", sets), eyas_run.env(tmp_path, api_url), LocalHost()
    first_log = tmp_path / "first.log"
    first = subprocess.Popen(
        run,
        cwd=eyas_run.ROOT,
        env=env,
        stdout=open(first_log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = None
    try:
        record = eyas_run.wait_for_server(tmp_path, first_log, first)
        server = record["pid"]
        # The first run, frozen mid-extraction: alive, holding its output dir, its server up.
        os.killpg(first.pid, signal.SIGSTOP)
        before = _started(server)
        t0 = time.monotonic()
        second = subprocess.run(
            run, cwd=eyas_run.ROOT, env=env, capture_output=True, text=True, timeout=240
        )
        took, out = time.monotonic() - t0, second.stdout + second.stderr
        assert second.returncode != 0, out[-3000:]
        # The first run's server is untouched: same process, its record and dump folder in place.
        assert _started(server) == before, (
            "the second run stopped the first run's server:\n" + out[-3000:]
        )
        assert f"is in use by another eyas run (pid {first.pid}, flow run " in out, out[-3000:]
        assert "this run stopped before touching anything" in out, out[-3000:]
        assert took < 120, f"the second run took {took:.0f} s to fail"
        assert json.loads((tmp_path / "server" / "server.pid").read_text())["pid"] == server
        assert (tmp_path / "server" / "dump" / ".eyas-owned").exists()
        # The first run dies without cleaning up; `eyas stop` stops the server it recorded.
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(30)
        stop = subprocess.run(
            eyas_run.command("stop", sets),
            cwd=eyas_run.ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        # the local server also exits by itself with the killed run (eyas/server/launcher.py): a
        # race
        assert stop.returncode == 0 and json.loads(stop.stdout)["outcome"] in (
            "terminated",
            "killed",
            "not running",
        ), stop
        assert wait_dead(host, server, 5)
        assert not (tmp_path / "server" / "dump").exists()  # eyas made it, eyas removed it
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait(30)
        if server is not None and host.is_alive(server):
            host.kill_group(server, signal.SIGKILL)


def test_eyas_stop_never_signals_a_process_a_stale_record_names_nor_deletes_foreign_files(tmp_path):
    host = LocalHost()
    sleeper = subprocess.Popen(["sleep", "300"], start_new_session=True)  # its own process group
    dump = tmp_path / "precious"
    dump.mkdir()
    (dump / "notes.txt").write_text("not eyas's")
    sets = {"server.workdir": tmp_path / "server", "server.dump_dir": dump}
    (tmp_path / "server").mkdir()
    record = tmp_path / "server" / "server.pid"
    env = eyas_run.env(tmp_path, None)

    def stop(**extra):
        return subprocess.run(
            eyas_run.command("stop", {**sets, **extra}),
            cwd=eyas_run.ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    try:
        # An older eyas's record (a bare pid) whose pid is now an unrelated process.
        record.write_text(f"{sleeper.pid}\n")
        r = stop()
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["outcome"].startswith("not running"), r.stdout
        time.sleep(0.5)
        assert sleeper.poll() is None, "eyas stop signalled a process it did not launch"
        assert (dump / "notes.txt").read_text() == "not eyas's"
        # A record with identity, its pid reused by another process (another start time).
        me = host.process_identity(sleeper.pid)
        record.write_text(
            json.dumps(
                {
                    "pid": sleeper.pid,
                    "boot": me.boot,
                    "start": str(int(me.start) - 1),
                    "command": "sleep 300",
                    "owner": "x",
                    "runs": [],
                }
            )
        )
        r = stop()
        assert r.returncode == 0 and "is now another process" in json.loads(r.stdout)["outcome"], (
            r.stdout
        )
        time.sleep(0.5)
        assert sleeper.poll() is None and (dump / "notes.txt").exists()
        assert not record.exists()  # the stale record is gone, the process it named is not
        # A folder eyas would empty may not be a filesystem root or a home folder: refused up front.
        for field, value in (
            ("server.dump_dir", "/"),
            ("server.workdir", "/root"),
            ("server.dump_dir", tmp_path / "server" / ".."),
        ):
            r = stop(**{field: value})
            assert r.returncode != 0 and field in r.stderr, (field, r.stderr)
    finally:
        sleeper.kill()
        sleeper.wait(10)


def test_launch_refuses_a_dump_dir_holding_files_eyas_did_not_write(tmp_path, random_target):
    host = LocalHost()
    cfg = stage_config(tmp_path, random_target, **{"server.dump_dir": str(tmp_path / "data")})
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "thesis.tex").write_text("years of work")
    try:
        with pytest.raises(
            LaunchError,
            match=r"server.dump_dir .* holds files eyas did not write "
            r"\(thesis.tex\)",
        ):
            start_server(host, capture_launch(cfg))
        assert (tmp_path / "data" / "thesis.tex").read_text() == "years of work"
        assert not cfg.server.pid_path.exists()  # nothing was launched
    finally:
        if (
            cfg.server.pid_path.exists()
        ):  # (the old behaviour: it launched, after deleting the file)
            text = cfg.server.pid_path.read_text().strip()
            host.kill_group(
                json.loads(text)["pid"] if text.startswith("{") else int(text), signal.SIGKILL
            )
