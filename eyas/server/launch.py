"""Launch and stop the target server through a Host, from a Launch alone.

    launch = capture_launch(cfg)             # extraction; serving: evaluation/serving.py
    # detached; returns at once with pid, log offset, identity
    handle = start_server(host, launch, owner)
    ...
    stop_server(host, launch, handle)        # process group TERM, wait, KILL; cleans the dump dir
    stop_recorded(host, launch)              # whatever server.pid names (eyas stop, failure hooks)

The same function launches SGLang on a GPU host and eyas's local server here: only the command
differs. A capture launch gets the dump directory through EYAS_DUMP_DIR (and SGLang's hook also in
its --forward-hooks config), so the hidden-state writer in either process writes to the place the
collector reads; a serving launch gets neither. Every config value in a command is quoted; the
server's secret variables (server.secret_env, server.env_from) are resolved here, on the worker, and
handed to Host.start apart from the command; the command kept in the handle (logged, reported) is
redacted (eyas/secrets.py).

Only a server eyas launched is ever signalled: `<server.workdir>/server.pid` records the launch
(JSON: pid, boot id and start time from the host's process table, the command, a launch token and
the flow runs that launched it), and every stop first checks that the pid is still that process
(eyas/server/ownership.py). A caller that passes `runs` (a failure hook) stops only a server one
of those runs launched.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields, replace
from typing import Literal

from eyas.config import PipelineConfig, ServerConfig, TargetConfig
from eyas.dump import DUMP_DIR_ENV
from eyas.errors import EyasError
from eyas.layers import server_layer_ids
from eyas.secrets import PYDANTIC_MASK, redact, register, secret_flag_values
from eyas.server.capture_draft import FOLDER as CAPTURE_DRAFT
from eyas.server.capture_draft import capture_draft_args, install_capture_draft
from eyas.server.hosts import Host, HostError, make_host, wait_dead
from eyas.server.launcher import LAUNCHER_ENV, launcher_identity
from eyas.server.ownership import Owner, clean_dump_dir, prepare_dump_dir, verdict
from eyas.server.patch_sets import available_versions, load_patch_set
from eyas.server.sglang_probe import server_python, sglang_version
from eyas.target import trust_remote_code

# The forward hook that the patch stage installs on SGLang hosts (patches/sglang/<version>/).
SGLANG_HOOK = "eyas_sglang_hook:make_hook"


class LaunchError(EyasError, RuntimeError):
    """The server cannot be started (port taken, a previous server still alive, ...)."""


class ServerDied(EyasError, RuntimeError):
    """The launched server died again after its one relaunch; names both deaths."""


@dataclass(frozen=True)
class ServerHandle:
    """One launch, as recorded in server.pid: where it serves, and who it is (boot, start).

    Tasks and flows pass this object itself; to_dict/from_record are server.pid's JSON."""

    pid: int
    host: str = ""
    url: str = ""
    log_path: str = ""
    log_offset: int = 0  # the log's size at launch: the sensor reads only what this launch wrote
    command: str = ""  # redacted: an --api-key value reads ***
    boot: str | None = None  # the host's boot id and the process's start time (ownership.verdict)
    start: str | None = None
    owner: str = ""  # the launch token
    runs: tuple[str, ...] = ()  # the flow runs that launched it, innermost first
    config: str = ""
    launched_at: str = ""

    def to_dict(self) -> dict:
        return {**asdict(self), "runs": list(self.runs)}

    @classmethod
    def from_record(cls, record: dict) -> ServerHandle:
        """A server.pid record; fields it lacks (a record without identity) take their defaults."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in record.items() if k in known and v is not None}
        return cls(**{**values, "pid": int(record["pid"]), "runs": tuple(values.get("runs") or ())})


@dataclass(frozen=True)
class Launch:
    """One launch of the target server: what it is for, and the sections it reads.

    `capture` (extraction): the hidden-state flags, server.capture_launch_args and capture_env, and
    the dump folder (EYAS_DUMP_DIR; SGLang's hook also in its --forward-hooks config, its records in
    `dtype`). `serve` (the serving benchmark): none of those; its serving flags are already in its
    server.launch_args (eyas/evaluation/serving.py serving_launch).
    """

    mode: Literal["capture", "serve"]
    server: ServerConfig  # the section it launches with: workdir, port, flags, environment
    target: TargetConfig
    name: str  # the config's name: server.pid's `config`, the dump folder's owner
    dtype: str | None = None  # capture: the dump records' dtype (extraction.dtype)


def capture_launch(cfg: PipelineConfig) -> Launch:
    """The extraction's launch: cfg's server as configured, capturing hidden states."""
    return Launch("capture", cfg.server, cfg.target, cfg.name, cfg.extraction.dtype)


def launch_command(
    launch: Launch, architecture: str | None = None, capture_draft: str | None = None
) -> str:
    """The shell command that starts the launch's server backend (capture_command or
    serving_command)."""
    if launch.mode == "serve":
        return serving_command(launch)
    return capture_command(launch, architecture, capture_draft)


def serving_command(launch: Launch) -> str:
    """A plain serving launch (the benchmark): no capture, no hook; server.launch_args add the
    rest."""
    s = launch.server
    module = ["sglang.launch_server"] if s.backend == "sglang" else ["eyas", "serve-local"]
    trust = _trust(launch) if s.backend == "sglang" else []
    args = [server_python(s), "-m", *module, *_model_address(launch), *trust]
    return shlex.join([*args, *s.launch_args])


def capture_command(
    launch: Launch, architecture: str | None = None, capture_draft: str | None = None
) -> str:
    """The extraction's launch: the target served with hidden-state capture.

    `architecture` (the target config.json's first one, read on the server host) picks how SGLang's
    model class maps --return-aux-hidden-state-layer-ids to captured layers (eyas/dump.py); None:
    DeepSeek-V2's rule. `capture_draft` (an SGLang without capture-only mode, 0.5.18): the folder of
    the stub EAGLE-3 draft whose eagle_config names the layers, which the capture launch loads
    instead of passing the capture-only flags (eyas/server/capture_draft.py).
    """
    s = launch.server
    common = [
        *_model_address(launch),
        *_capture_flags(launch, architecture, capture_draft),
        "--disable-radix-cache",
        "--chunked-prefill-size",
        str(s.chunked_prefill_size),
    ]
    if s.max_running_requests is not None:
        common += ["--max-running-requests", str(s.max_running_requests)]
    if s.dp_size is not None:
        common += ["--dp-size", str(s.dp_size)]
    if s.backend == "sglang":
        args = _sglang_capture(launch, common, architecture, capture_draft)
    else:
        args = [server_python(s), "-m", "eyas", "serve-local", *common]
    return shlex.join([*args, *s.launch_args, *s.capture_launch_args])


def _model_address(launch: Launch) -> list[str]:
    s = launch.server
    return ["--model-path", str(launch.target.checkpoint), "--host", s.bind, "--port", str(s.port)]


def _capture_flags(
    launch: Launch, architecture: str | None, capture_draft: str | None
) -> list[str]:
    """The flags that make the server capture the target's layers: SGLang's capture-only flags (in
    its model class's id rule), or the stub draft's."""
    t = launch.target
    # asked with the stub draft too: it names the same layers, so ids the architecture's rule
    # cannot ask are refused either way
    ids = (
        t.capture_ids()
        if launch.server.backend == "local"
        else server_layer_ids(t.capture_ids(), architecture)
    )
    if capture_draft is not None:
        return capture_draft_args(capture_draft)
    return [
        "--enable-return-aux-hidden-states",
        "--return-aux-hidden-state-layer-ids",
        *map(str, ids),
    ]


def _sglang_capture(
    launch: Launch, common: list[str], architecture: str | None, capture_draft: str | None
) -> list[str]:
    """SGLang's capture launch before the configured flags: capture-only EAGLE3, no prefill CUDA
    graph (the hook runs only in eager forwards), and the dump hook unless source_patch dumps."""
    # With capture-only mode EAGLE3 only names the layer-id convention; SGLang loads no draft
    # (docs/sglang-hook.md). Without it, the stub draft's flags name EAGLE3 already.
    speculative = ["--speculative-algorithm", "EAGLE3"] if capture_draft is None else []
    args = [
        server_python(launch.server),
        "-m",
        "sglang.launch_server",
        *common,
        *_trust(launch),
        *speculative,
        "--disable-prefill-cuda-graph",
    ]
    if launch.server.capture == "forward_hook":  # source_patch: the patched model file dumps
        args += ["--forward-hooks", json.dumps(_dump_hook(launch, architecture))]
    return args


def _dump_hook(launch: Launch, architecture: str | None) -> list[dict]:
    """SGLang's --forward-hooks value: eyas's dump hook on the logits processor."""
    config = {
        "dump_dir": str(launch.server.dump_dir),
        "layer_ids": launch.target.capture_ids(),
        "dtype": launch.dtype,
    }
    if architecture:
        config["architecture"] = architecture
    return [
        {
            "name": "eyas-dump",
            "target_modules": ["*logits_processor"],
            "hook_factory": SGLANG_HOOK,
            "config": config,
        }
    ]


def _trust(launch: Launch) -> list[str]:
    """SGLang's --trust-remote-code when target.trust_remote_code resolves on (eyas/target.py), so
    the server runs the tokenizer and model code the orchestrator trusts; once, if launch_args lack
    it."""
    s = launch.server
    wanted = (
        trust_remote_code(launch.target, s.backend) and "--trust-remote-code" not in s.launch_args
    )
    return ["--trust-remote-code"] if wanted else []


def launch_env(launch: Launch) -> dict[str, str]:
    """The server's environment: server.env for every launch; capture_env and the dump folder for
    the capture launch only. A serving launch must not get EYAS_DUMP_DIR: a source-patched SGLang
    would try to dump its speculative forwards, which keep no last hidden states."""
    s = launch.server
    if launch.mode == "serve":
        return {**s.env, "PYTHONUNBUFFERED": "1"}
    return {**s.env, **s.capture_env, DUMP_DIR_ENV: str(s.dump_dir), "PYTHONUNBUFFERED": "1"}


def target_config(host: Host, target: TargetConfig) -> dict | None:
    """The target's config.json as the server host has it, or None."""
    path = f"{str(target.checkpoint).rstrip('/')}/config.json"
    r = host.run(f"cat {shlex.quote(path)}", check=False, timeout=30)
    try:
        found = json.loads(r.stdout) if r.ok else None
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def _first_architecture(config: dict | None) -> str | None:
    names = (config or {}).get("architectures")
    return names[0] if isinstance(names, list) and names and isinstance(names[0], str) else None


def needs_capture_draft(host: Host, launch: Launch) -> bool:
    """True for a capture launch of an SGLang without capture-only mode (its patch set says so)."""
    s = launch.server
    if s.backend != "sglang" or launch.mode != "capture":
        return False
    version = sglang_version(host, server_python(s), s.env)
    return version in available_versions() and not load_patch_set(version).capture_only_mode


def host_launch_command(host: Host, launch: Launch, *, install_draft: bool = False) -> str:
    """launch_command for the target as the server host has it (SGLang: its architecture's id rule,
    and the stub draft's folder where the version has no capture-only mode). `install_draft`
    (start_server): write that draft there too."""
    if launch.server.backend != "sglang":
        return launch_command(launch)
    config = target_config(host, launch.target)
    architecture, draft = _first_architecture(config), None
    if needs_capture_draft(host, launch):
        draft = f"{str(launch.server.workdir).rstrip('/')}/{CAPTURE_DRAFT}"
        if install_draft:
            if config is None:
                raise LaunchError(
                    f"[{host.name}] no readable config.json in {launch.target.checkpoint}: the "
                    f"capture draft this SGLang needs is shaped after it"
                )
            install_capture_draft(host, draft, config, launch.target.capture_ids(), architecture)
    return launch_command(launch, architecture, draft)


def launch_secrets(s: ServerConfig, environ=os.environ) -> dict[str, str]:
    """The server's secret variables: server.env_from read from this process's environment (the
    worker's), server.secret_env's values. Registered for redaction; never part of a command."""
    out = {}
    for name, source in s.env_from.items():
        if source not in environ:
            raise LaunchError(
                f"server.env_from: {source} is not set in the environment of this worker "
                f"(pid {os.getpid()}), so the server's {name} cannot be given"
            )
        out[name] = environ[source]
    for name, value in s.secret_env.items():
        if value.get_secret_value() == PYDANTIC_MASK:
            raise LaunchError(
                f"server.secret_env.{name} holds {PYDANTIC_MASK}, the mask Prefect "
                f"stored instead of the value; give the secret through server.env_from or a config "
                f"file on the worker"
            )
        out[name] = value.get_secret_value()
    register(*out.values(), *secret_flag_values([*s.launch_args, *s.capture_launch_args]))
    return out


def auth_headers(server: ServerConfig) -> dict[str, str]:
    """What every request to the launched server carries: the --api-key of server.launch_args, as
    SGLang wants it (Authorization: Bearer KEY; its /health routes need none)."""
    keys = secret_flag_values(server.launch_args)
    register(*keys)
    return {"Authorization": f"Bearer {keys[-1]}"} if keys else {}


_PORT_PROBE = (
    "import socket, sys; s = socket.socket(); s.settimeout(1); "
    "sys.exit(0 if s.connect_ex((sys.argv[1], int(sys.argv[2]))) == 0 else 1)"
)


def _port_in_use(host: Host, bind: str, port: int) -> bool:
    address = (
        "127.0.0.1" if bind in ("0.0.0.0", "", "::") else bind
    )  # values as arguments, never code
    probe = shlex.join(["python3", "-c", _PORT_PROBE, address, str(int(port))])
    return host.run(probe, check=False, timeout=15).ok


def _helper_python(server: ServerConfig) -> str:
    """The interpreter for eyas's small helper scripts on the server host."""
    return sys.executable if server.host.kind == "local" else "python3"


def read_record(host: Host, server: ServerConfig) -> ServerHandle | None:
    """The launch recorded in server.pid (a bare pid, from an older eyas, gives a handle of that pid
    alone), or None."""
    r = host.run(f"cat {shlex.quote(str(server.pid_path))}", check=False)
    text = r.stdout.strip() if r.ok else ""
    if text.isdigit():
        return ServerHandle(int(text))
    try:
        record = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return None
    return ServerHandle.from_record(record)


def _check(host: Host, launch: Launch, handle: ServerHandle) -> str:
    """ownership.verdict; a record without identity counts as alive only while its pid runs
    exactly this launch's command."""
    v = verdict(host, handle)
    if v == "unverified":
        found = host.process_identity(handle.pid)
        return (
            "alive"
            if found and list(found.argv) == shlex.split(host_launch_command(host, launch))
            else "replaced"
        )
    return v


def gone_reason(host: Host, launch: Launch, handle: ServerHandle) -> str | None:
    """Why the server `handle` names is gone (its log's most telling fatal line since its launch),
    or None while it still runs."""
    from eyas.server.readiness import death_reason

    if _check(host, launch, handle) == "alive":
        return None
    return f"pid {handle.pid} exited: {death_reason(host, handle.log_path, handle.log_offset)}"


def server_alive(launch: Launch) -> bool:
    """Is the server recorded in server.pid_path alive? (Asked after a request failed: connects
    anew.)"""
    try:
        with make_host(launch.server.host) as host:
            record = read_record(host, launch.server)
            return record is not None and _check(host, launch, record) == "alive"
    except Exception:  # noqa: BLE001 - unreachable host: not proof of death; the requests' backoff decides
        return True


# What this process launched and has not stopped yet: a signal handler stops these
# (flows/runtime/process.py).
_launched: dict[tuple[str, int], tuple[Launch, ServerHandle]] = {}
_launched_lock = threading.Lock()


def start_server(
    host: Host, launch: Launch, owner: Owner | None = None, *, leave_up: bool = False
) -> ServerHandle:
    """Start the server detached and record who it is; refuses if its port is taken, a recorded
    server lives, or server.dump_dir holds files eyas did not write.

    eyas's local server on this machine exits when this process dies without stopping it
    (eyas/server/launcher.py), unless `leave_up` (a `serve` run's server, up on purpose)."""
    s, q, owner = launch.server, shlex.quote, owner or Owner.new()
    secrets = launch_secrets(s)  # a missing secret fails before anything on the host changes
    old = read_record(host, s)
    if old is not None and _check(host, launch, old) == "alive":
        by = f", launched by flow run {old.runs[0]}" if old.runs else ""
        raise LaunchError(
            f"[{host.name}] a server recorded in {s.pid_path} (pid {old.pid}{by}) is still "
            f"alive; stop it first (eyas stop)"
        )
    if _port_in_use(host, s.bind, s.port):
        raise LaunchError(
            f"[{host.name}] port {s.port} is already in use; pick another server.port"
        )
    host.run(f"mkdir -p {q(str(s.workdir))}")
    dump = prepare_dump_dir(host, _helper_python(s), str(s.dump_dir), launch.name)
    if dump["state"] == "refused":
        raise LaunchError(
            f"[{host.name}] server.dump_dir {s.dump_dir} holds files eyas did not write "
            f"({', '.join(dump['foreign'])}); eyas deletes that folder's contents, so point "
            f"server.dump_dir at a new or empty folder"
        )
    size = host.run(
        f"stat -c %s {q(str(s.log_path))} 2>/dev/null || echo 0", check=False
    ).stdout.strip()
    command = host_launch_command(host, launch, install_draft=True)
    env = launch_env(launch)
    if s.backend == "local" and s.host.kind == "local" and not leave_up:
        env[LAUNCHER_ENV] = launcher_identity() or ""
    pid = host.start(command, log_path=s.log_path, env=env, cwd=s.workdir, secret_env=secrets)
    found = host.process_identity(pid)
    handle = ServerHandle(
        pid,
        host.name,
        s.url,
        str(s.log_path),
        int(size or 0),
        redact(command),
        found.boot if found else None,
        found.start if found else None,
        owner.token,
        tuple(owner.runs),
        launch.name,
        time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    tmp = f"{s.pid_path}.tmp-{owner.token}"
    host.run(
        f"printf '%s\\n' {q(json.dumps(handle.to_dict()))} > {q(tmp)} && mv -f {q(tmp)} "
        f"{q(str(s.pid_path))}"
    )
    with _launched_lock:
        _launched[(host.name, pid)] = (launch, handle)
    return handle


def stop_recorded(host: Host, launch: Launch, *, runs: set[str] | None = None) -> dict:
    """Stop the server server.pid records (stop_server), if any; with none recorded, clean the dump
    directory, except for a hook (`runs` given): it proves nothing there, so it leaves the folder
    alone."""
    record = read_record(host, launch.server)
    if record is None:
        return {
            "pid": None,
            "outcome": "not running",
            "dump_dir": _clean(host, launch.server) if runs is None else "kept",
        }
    return stop_server(host, launch, record, runs=runs)


def stop_server(
    host: Host, launch: Launch, handle: ServerHandle, *, runs: set[str] | None = None
) -> dict:
    """Stop the server eyas launched that `handle` names, then clean its dump directory.

    The pid is signalled only while it is still the launched process (same boot id and start
    time; a record without them: this launch's exact command line). With `runs`, only a server
    launched by one of those flow runs is stopped; another run's server is left alone, with its
    record and dump folder. Idempotent.
    """
    s = launch.server
    recorded = read_record(host, s)
    pid, launched_by = handle.pid, list(handle.runs)
    if runs is not None and not set(launched_by) & {str(r) for r in runs}:
        who = (
            f"flow run {launched_by[0]}"
            if launched_by
            else "a launch this run cannot prove its own"
        )
        return {"pid": pid, "outcome": f"left alone: launched by {who}, not by this run"}
    state = _check(host, launch, handle)
    outcome = {
        "gone": "not running",
        "replaced": f"not running (pid {pid} is now another process: left alone)",
    }.get(state, "terminated")
    if state == "alive":
        host.kill_group(pid, signal.SIGCONT)  # a stopped (SIGSTOP) server handles no SIGTERM
        host.kill_group(pid, signal.SIGTERM)
        if not wait_dead(host, pid, s.stop_timeout_s):
            if _check(host, launch, handle) == "alive":
                host.kill_group(pid, signal.SIGKILL)
                outcome = "killed"
                if not wait_dead(host, pid, 10):
                    raise HostError(host.name, f"kill -9 -{pid}", None, "server survived SIGKILL")
    with _launched_lock:
        _launched.pop((host.name, pid), None)
    if recorded is not None and (recorded.pid, recorded.owner) == (pid, handle.owner):
        host.run(f"rm -f {shlex.quote(str(s.pid_path))}", check=False)
        dump = _clean(host, s)
    elif recorded is not None and _check(host, launch, recorded) == "alive":
        dump = "kept: the recorded server uses it"
    else:
        dump = _clean(host, s)
    return {"pid": pid, "outcome": outcome, "launched_by": launched_by[:1], "dump_dir": dump}


def _clean(host: Host, server: ServerConfig) -> str:
    try:
        return clean_dump_dir(host, _helper_python(server), str(server.dump_dir))["state"]
    except (HostError, ValueError) as e:
        return f"not cleaned: {e}"


def stop_launched(timeout_s: float = 10.0) -> list[dict]:
    """Stop every server this process launched and has not stopped (a signal handler's last act)."""
    with _launched_lock:
        pending = list(_launched.values())
    out = []
    for launch, handle in pending:
        try:
            with make_host(launch.server.host) as host:
                quick = replace(
                    launch, server=launch.server.model_copy(update={"stop_timeout_s": timeout_s})
                )
                out.append(stop_server(host, quick, handle))
        except Exception as e:  # noqa: BLE001 - best effort on the way out
            out.append({"pid": handle.pid, "outcome": f"not stopped: {e}"})
    return out
