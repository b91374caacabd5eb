"""Issue 16.2: config values that reach a shell, locally and over a real sshd, never run as
commands.

Every string field that ends up in a command carries shell metacharacters (`;`, `$( )`, backticks,
both quotes, a backslash, a newline, spaces); each would `touch` a marker file if a shell read it as
code. The marker must never appear, and every value must arrive intact where it belongs: the
server's argv and environment (/proc/<pid>/cmdline, /proc/<pid>/environ), the interpreter that ran,
the training node's arguments. Names and addresses, where quoting cannot help, are refused by the
config (the error names the field) and again by the Host seam.
"""

import json
import os
import shlex
import sys
import time
from pathlib import Path

import pytest

from eyas.config import ConfigError, HostConfig, TargetConfig, load_config
from eyas.evaluation.serve_bench import stage_drafter
from eyas.server import launch, sglang_probe
from eyas.server.hosts import LocalHost
from eyas.server.ssh_host import SSHHost
from eyas.training.distributed import TrainingLaunchError, launch_training
from tests.helpers_training import training_config
from tests.sshd import ssh_host_fields
from tests.stage_config import ROOT, stage_config

TINY = ROOT / "fixtures" / "tiny-target"
REAL_PYTHON = sys.executable


def evil(marker: Path) -> str:
    """A value any shell would choke on or run: each part touches `marker`."""
    m = str(marker)
    return f"x; touch {m} $(touch {m}) `touch {m}` 'sq' \"dq\" back\\slash\nnew line; touch {m}"


@pytest.fixture(params=["local", "ssh"])
def where(request):
    return request.param


def _host_cfg(where, request) -> dict | None:
    return ssh_host_fields(request.getfixturevalue("sshd")) if where == "ssh" else None


def _make_host(host_cfg):
    return SSHHost(HostConfig(**host_cfg)) if host_cfg else LocalHost()


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _proc(pid: int, name: str) -> bytes:
    return Path(f"/proc/{pid}/{name}").read_bytes()


def test_metacharacters_in_every_launch_field_arrive_intact_and_run_nothing(
    tmp_path, where, request
):
    marker = tmp_path / "pwned"
    bad = evil(marker)
    root = tmp_path / f"root {bad}"
    checkpoint = root / f"target {bad}"
    checkpoint.parent.mkdir(parents=True)
    checkpoint.symlink_to(TINY)
    # server.python: an interpreter at a path full of metacharacters; it notes how it was called
    python = _script(
        root / f"py {bad}" / "python3",
        f'printf %s "$0" > "$(dirname "$0")/ran"\nexec {shlex.quote(REAL_PYTHON)} "$@"\n',
    )
    host_cfg = _host_cfg(where, request)
    overrides = {
        "server.python": str(python),
        "server.workdir": str(root / f"work {bad}"),
        "server.dump_dir": str(root / f"dump {bad}"),
        "server.url_host": "127.0.0.1",
        "server.launch_args": ["--served-model-name", bad, "--load-delay", "0.3"],
        "server.env": {"OMP_NUM_THREADS": "1", "EYAS_EVIL": bad},
        "server.secret_env": {"EYAS_EVIL_SECRET": bad + " secret"},
    }
    if host_cfg:
        overrides["server.host"] = host_cfg
    cfg = stage_config(tmp_path, checkpoint, **overrides)
    host = _make_host(host_cfg)
    try:
        handle = launch.start_server(host, launch.capture_launch(cfg))
        try:
            deadline = time.monotonic() + 30
            while (
                _proc(handle.pid, "cmdline").split(b"\0")[0] != REAL_PYTHON.encode()
            ):  # the wrapper exec'd
                assert time.monotonic() < deadline, _proc(handle.pid, "cmdline")
                time.sleep(0.05)
            argv = [a.decode() for a in _proc(handle.pid, "cmdline").split(b"\0")[:-1]]
            assert argv[1:] == shlex.split(launch.launch_command(launch.capture_launch(cfg)))[1:]
            assert argv[argv.index("--model-path") + 1] == str(checkpoint)
            assert argv[argv.index("--served-model-name") + 1] == bad
            environ = dict(
                e.decode().split("=", 1) for e in _proc(handle.pid, "environ").split(b"\0") if e
            )
            assert environ["EYAS_EVIL"] == bad and environ["EYAS_EVIL_SECRET"] == bad + " secret"
            assert environ["EYAS_DUMP_DIR"] == str(cfg.server.dump_dir)
            assert os.readlink(f"/proc/{handle.pid}/cwd") == str(cfg.server.workdir)
            assert (python.parent / "ran").read_text() == str(python)
            assert (
                cfg.server.log_path.exists()
                and json.loads(Path(cfg.server.pid_path).read_text())["pid"] == handle.pid
            )
        finally:
            assert launch.stop_server(host, launch.capture_launch(cfg), handle)["outcome"] in (
                "terminated",
                "killed",
            )
        assert not cfg.server.dump_dir.exists()
        # the patch stage's probe runs server.python with server.env, paths as arguments
        (python.parent / "ran").unlink()
        probe = sglang_probe.probe(host, str(python), {"EYAS_EVIL": bad}, [bad])
        assert probe.python == REAL_PYTHON or probe.python.endswith("python3")
        assert (python.parent / "ran").read_text() == str(python)
        # the serving benchmark's drafter upload (SSH: under server.workdir)
        drafter = root / f"drafter {bad}"
        drafter.mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (drafter / name).write_text(name)
        staged = stage_drafter(host, cfg, drafter)
        assert (staged / "model.safetensors").read_text() == "model.safetensors"
        # the port probe takes the address as an argument: a bad one (were the config bypassed) is
        # no code
        assert (
            launch._port_in_use(
                host, f"127.0.0.1$(touch {marker})`touch {marker}`", cfg.server.port
            )
            is False
        )
    finally:
        host.close()
    assert not marker.exists()


def test_training_nodes_get_python_paths_and_env_intact(tmp_path, where, request, free_port):
    marker = tmp_path / "pwned"
    bad = evil(marker)
    fake = _script(
        tmp_path / f"py {bad}" / "python3",
        'd="$(dirname "$0")"\nprintf "%s\\0" "$0" "$@" > "$d/argv"\nprintf %s '
        '"$EYAS_EVIL" > "$d/env"\n',
    )
    host_cfg = _host_cfg(where, request)
    distributed = {
        "nproc_per_node": 2,
        "master_port": free_port,
        "python": str(fake),
        "env": {"EYAS_EVIL": bad},
    }
    if host_cfg:
        distributed["hosts"] = [host_cfg]
    out = tmp_path / f"train {bad}"
    cfg = training_config(out, distributed=distributed)
    target = TargetConfig(checkpoint=tmp_path / f"target {bad}", layer_ids=[1, 2, 3])
    with pytest.raises(TrainingLaunchError, match="wrote no"):  # the fake torchrun trains nothing
        launch_training(
            cfg, target, [tmp_path / f"shard {bad}.safetensors"], log=lambda _: None, poll_s=0.1
        )
    argv = (fake.parent / "argv").read_bytes().decode().split("\0")[:-1]
    job = out / "launch" / "job.json"
    assert (
        argv[0] == str(fake)
        and argv[1:3] == ["-m", "torch.distributed.run"]
        and argv[-1] == str(job)
    )
    assert argv[argv.index("--master-port") + 1] == str(free_port)
    assert (fake.parent / "env").read_text() == bad
    assert (out / "launch" / "node-0.rc").read_text().strip() == "0"
    assert not marker.exists()


def test_names_and_addresses_are_refused_by_the_config_naming_the_field(tmp_path):
    marker = tmp_path / "pwned"
    cases = {
        "server.env": {f"A=1; touch {marker}; B": "1"},
        "server.secret_env": {f"X$(touch {marker})": "1"},
        "server.env_from": [f"Y`touch {marker}`"],
        "training.distributed.env": {"A B": "1"},
        "server.bind": f"127.0.0.1$(touch {marker})",
        "server.url_host": "host name",
        "server.host.name": "../../etc/x",
    }
    for field, value in cases.items():
        with pytest.raises(ConfigError) as e:
            load_config(ROOT / "configs" / "local-tiny.yaml", {field: value})
        assert field in str(e.value), str(e.value)
    for ok in ("0.0.0.0", "::1", "gpu-node-1.example.org"):
        assert (
            load_config(ROOT / "configs" / "local-tiny.yaml", {"server.bind": ok}).server.bind == ok
        )
    assert not marker.exists()


def test_the_host_seam_refuses_a_bad_variable_name_before_running_anything(
    tmp_path, where, request
):
    marker = tmp_path / "pwned"
    host = _make_host(_host_cfg(where, request))
    bad_name = f"A=1; touch {marker}; B"
    try:
        with pytest.raises(ValueError, match="not an environment variable name"):
            host.start("sleep 1", log_path=tmp_path / "log", env={bad_name: "1"})
        with pytest.raises(ValueError, match="not an environment variable name"):
            host.start("sleep 1", log_path=tmp_path / "log", secret_env={bad_name: "1"})
        with pytest.raises(ValueError, match="not an environment variable name"):
            host.run("true", env={bad_name: "1"})
        assert host.run('printf %s "$V"', env={"V": evil(marker)}).stdout == evil(marker)
    finally:
        host.close()
    assert not marker.exists() and not (tmp_path / "log").exists()
