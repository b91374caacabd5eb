"""Launch and stop the target server through a Host, from the config alone.

    handle = start_server(host, cfg)        # detached; returns at once with pid and log offset
    ...
    stop_server(host, cfg, handle.pid)      # process group TERM, wait, KILL; cleans the dump dir

The same function launches SGLang on a GPU host and eyas's local server here: only the command
differs. Both get the dump directory through EYAS_DUMP_DIR, so the hidden-state writer in either
process writes to the place the collector reads. Every config value in a command is quoted; the
server's secret variables (server.secret_env, server.env_from) are resolved here, on the worker, and
handed to Host.start apart from the command; the command kept in the handle (logged, reported) is
redacted (eyas/secrets.py).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
from dataclasses import asdict, dataclass

from eyas.config import PipelineConfig
from eyas.dump import DUMP_DIR_ENV
from eyas.secrets import PYDANTIC_MASK, redact, register, secret_flag_values
from eyas.server.hosts import Host, HostError, make_host, wait_dead

# The forward hook that the patch stage installs on SGLang hosts (patches/sglang/<version>/).
SGLANG_HOOK = "eyas_sglang_hook:make_hook"


class LaunchError(RuntimeError):
    """The server cannot be started (port taken, a previous server still alive, ...)."""


@dataclass
class ServerHandle:
    pid: int
    host: str
    url: str
    log_path: str
    log_offset: int  # the log's size at launch: the sensor reads only what this launch wrote
    command: str  # redacted: an --api-key value reads ***

    def to_dict(self) -> dict:
        return asdict(self)


def launch_command(cfg: PipelineConfig) -> str:
    """The shell command that starts the configured server backend."""
    s, t = cfg.server, cfg.target
    python = s.python or (sys.executable if s.host.kind == "local" else "python3")
    capture = [str(i) for i in t.capture_ids()]
    common = ["--model-path", str(t.checkpoint), "--host", s.bind, "--port", str(s.port),
              "--enable-return-aux-hidden-states", "--return-aux-hidden-state-layer-ids", *capture,
              "--disable-radix-cache", "--chunked-prefill-size", str(s.chunked_prefill_size)]
    if s.max_running_requests is not None:
        common += ["--max-running-requests", str(s.max_running_requests)]
    if not s.capture_aux:
        # A plain serving launch (the benchmark): no capture, no hook; launch_args add the rest.
        module = ["sglang.launch_server"] if s.backend == "sglang" else ["eyas", "serve-local"]
        args = [python, "-m", *module, "--model-path", str(t.checkpoint), "--host", s.bind,
                "--port", str(s.port)]
    elif s.backend == "sglang":
        hook = [{"name": "eyas-dump", "target_modules": ["*logits_processor"],
                 "hook_factory": SGLANG_HOOK,
                 "config": {"dump_dir": str(s.dump_dir), "layer_ids": t.capture_ids(),
                            "dtype": cfg.extraction.dtype}}]
        # EAGLE3 only names the layer-id convention here; SGLang loads no draft (docs/sglang-hook.md).
        args = [python, "-m", "sglang.launch_server", *common, "--speculative-algorithm", "EAGLE3",
                "--disable-prefill-cuda-graph", "--forward-hooks", json.dumps(hook)]
    else:
        args = [python, "-m", "eyas", "serve-local", *common]
    return " ".join(shlex.quote(a) for a in [*args, *s.launch_args])


def launch_env(cfg: PipelineConfig) -> dict[str, str]:
    return {**cfg.server.env, DUMP_DIR_ENV: str(cfg.server.dump_dir), "PYTHONUNBUFFERED": "1"}


def launch_secrets(cfg: PipelineConfig, environ=os.environ) -> dict[str, str]:
    """The server's secret variables: server.env_from read from this process's environment (the
    worker's), server.secret_env's values. Registered for redaction; never part of a command."""
    s, out = cfg.server, {}
    for name, source in s.env_from.items():
        if source not in environ:
            raise LaunchError(f"server.env_from: {source} is not set in the environment of this worker "
                              f"(pid {os.getpid()}), so the server's {name} cannot be given")
        out[name] = environ[source]
    for name, value in s.secret_env.items():
        if value.get_secret_value() == PYDANTIC_MASK:
            raise LaunchError(f"server.secret_env.{name} holds {PYDANTIC_MASK}, the mask Prefect stored instead of "
                              f"the value; give the secret through server.env_from or a config file on the worker")
        out[name] = value.get_secret_value()
    register(*out.values(), *secret_flag_values(s.launch_args))
    return out


def auth_headers(cfg: PipelineConfig) -> dict[str, str]:
    """What every request to the launched server carries: the --api-key of server.launch_args, as
    SGLang wants it (Authorization: Bearer KEY; its /health routes need none)."""
    keys = secret_flag_values(cfg.server.launch_args)
    register(*keys)
    return {"Authorization": f"Bearer {keys[-1]}"} if keys else {}


_PORT_PROBE = ("import socket, sys; s = socket.socket(); s.settimeout(1); "
               "sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)")


def _port_in_use(host: Host, bind: str, port: int) -> bool:
    address = "127.0.0.1" if bind in ("0.0.0.0", "", "::") else bind  # values as arguments, never code
    probe = shlex.join(["python3", "-c", _PORT_PROBE, address, str(int(port))])
    return host.run(probe, check=False, timeout=15).ok


def _recorded_pid(host: Host, cfg: PipelineConfig) -> int | None:
    r = host.run(f"cat {shlex.quote(str(cfg.server.pid_path))}", check=False)
    text = r.stdout.strip()
    return int(text) if r.ok and text.isdigit() else None


def server_alive(cfg: PipelineConfig) -> bool:
    """Is the server recorded in server.pid_path alive? (Asked after a request failed: connects anew.)"""
    host = make_host(cfg.server.host)
    try:
        pid = _recorded_pid(host, cfg)
        return pid is not None and host.is_alive(pid)
    except Exception:  # noqa: BLE001 - unreachable host: not proof of death; the requests' backoff decides
        return True
    finally:
        host.close()


def start_server(host: Host, cfg: PipelineConfig) -> ServerHandle:
    """Start the server detached; refuses if its port is taken or a recorded server lives."""
    s = cfg.server
    secrets = launch_secrets(cfg)  # a missing secret fails before anything on the host changes
    old = _recorded_pid(host, cfg)
    if old is not None and host.is_alive(old):
        raise LaunchError(f"[{host.name}] a server recorded in {s.pid_path} (pid {old}) is still alive; "
                          f"stop it first (eyas stop) or remove the pid file if it is not ours")
    if _port_in_use(host, s.bind, s.port):
        raise LaunchError(f"[{host.name}] port {s.port} is already in use; pick another server.port")
    q = shlex.quote
    host.run(f"mkdir -p {q(str(s.workdir))} {q(str(s.dump_dir))} && rm -rf {q(str(s.dump_dir))}/*")
    size = host.run(f"stat -c %s {q(str(s.log_path))} 2>/dev/null || echo 0", check=False).stdout.strip()
    command = launch_command(cfg)
    pid = host.start(command, log_path=s.log_path, env=launch_env(cfg), cwd=s.workdir, secret_env=secrets)
    host.run(f"echo {int(pid)} > {q(str(s.pid_path))}")
    return ServerHandle(pid, host.name, s.url, str(s.log_path), int(size or 0), redact(command))


def stop_server(host: Host, cfg: PipelineConfig, pid: int | None = None) -> dict:
    """Stop the server's whole process group, then clean its dump directory. Idempotent."""
    s = cfg.server
    pid = pid if pid is not None else _recorded_pid(host, cfg)
    outcome = "not running"
    if pid is not None and host.is_alive(pid):
        host.kill_group(pid, signal.SIGTERM)
        outcome = "terminated"
        if not wait_dead(host, pid, s.stop_timeout_s):
            host.kill_group(pid, signal.SIGKILL)
            outcome = "killed"
            if not wait_dead(host, pid, 10):
                raise HostError(host.name, f"kill -9 -{pid}", None, "server survived SIGKILL")
    q = shlex.quote
    host.run(f"rm -f {q(str(s.pid_path))}; rm -rf {q(str(s.dump_dir))}", check=False)
    return {"pid": pid, "outcome": outcome}
