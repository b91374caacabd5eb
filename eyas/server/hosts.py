"""Where commands run: this machine (LocalHost, subprocess) or a GPU host over SSH (SSHHost in
eyas/server/ssh_host.py, Fabric), behind one seam: the Host protocol and make_host.

    with make_host(cfg.server.host) as host:  # closed (the SSH connection too) on leaving the block
        pid = host.start("python3 -m eyas serve-local ...", log_path="/srv/eyas/server.log",
        env={...}) while host.is_alive(pid): chunk, offset = host.read_from("/srv/eyas/server.log",
        offset) host.kill_group(pid)

Both implementations have the same methods and the same failure types, so stages never ask which
one they hold. Commands are shell strings run by /bin/sh on the host: callers quote every value in
them (shlex); environment names are checked here. Secret variables (`start(..., secret_env=)`)
never enter a command string: a local process gets them through its environment, an SSH one
through the channel's stdin. Error messages pass through eyas.secrets.redact.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from eyas.config import HostConfig
from eyas.errors import EyasError
from eyas.files import write_bytes_atomic
from eyas.secrets import check_env_name, redact, register


class HostError(EyasError, RuntimeError):
    """A command on a host failed; carries the host, the command and what it printed."""

    retryable = True  # a command that failed over a connection may pass

    def __init__(self, host: str, command: str, exit_code: int | None, stderr: str = ""):
        command, stderr = redact(command), redact(stderr)  # never a secret in a message
        self.host, self.command, self.exit_code, self.stderr = host, command, exit_code, stderr
        tail = stderr.strip()[-2000:]
        super().__init__(f"[{host}] command failed (exit {exit_code}): {command}\n{tail}".rstrip())


class HostUnreachable(HostError):
    """The host could not be reached (connection refused, timeout, DNS): worth retrying."""

    def __init__(self, host: str, reason: str):
        super().__init__(host, "<connect>", None, reason)
        self.args = (f"[{host}] host unreachable: {reason}",)


class HostAuthError(HostError):
    """The host refused our credentials or its host key is unknown: never retried."""

    retryable = False

    def __init__(self, host: str, reason: str):
        super().__init__(host, "<connect>", None, reason)
        self.args = (f"[{host}] authentication or host-key failure: {reason}",)


class HostConfigError(HostAuthError):
    """The host's configuration cannot work (a known_hosts file that is not there): never
    retried."""

    def __init__(self, host: str, reason: str):
        super().__init__(host, reason)
        self.args = (f"[{host}] {reason}",)


@dataclass
class RunResult:
    exit_code: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0


class Host(Protocol):
    name: str

    def run(
        self,
        command: str,
        *,
        check: bool = True,
        timeout: float | None = None,
        env: dict[str, str] | None = None,
    ) -> RunResult: ...
    def start(
        self,
        command: str,
        *,
        log_path: str | Path,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        secret_env: dict[str, str] | None = None,
    ) -> int: ...
    def is_alive(self, pid: int) -> bool: ...
    def read_from(
        self, path: str | Path, offset: int, max_bytes: int = 1 << 20
    ) -> tuple[bytes, int]: ...
    def put(self, local: str | Path, remote: str | Path) -> None: ...
    def get(self, remote: str | Path, local: str | Path) -> None: ...
    def list_dir(self, path: str | Path) -> list[str] | None: ...
    def read_file(self, path: str | Path) -> bytes | None: ...
    def remove_tree(self, path: str | Path) -> int: ...
    def kill_group(self, pid: int, sig: int = signal.SIGTERM) -> None: ...
    def process_identity(self, pid: int) -> ProcessIdentity | None: ...
    def machine_identity(self) -> tuple[str, str]: ...
    def close(self) -> None: ...
    def __enter__(self) -> Host: ...
    def __exit__(self, *exc: object) -> None: ...


@dataclass(frozen=True)
class ProcessIdentity:
    """Who a pid is: a pid is reused, (boot, start) is not. `start` is the start time in clock
    ticks since boot (/proc/<pid>/stat field 22), or `ps -o lstart` where there is no /proc."""

    boot: str
    start: str
    pgrp: int | None
    zombie: bool
    argv: tuple[str, ...]


# One command, any POSIX host: the boot id, the process's stat line and its argv.
_IDENTITY = (
    "if [ -r /proc/self/stat ]; then cat /proc/sys/kernel/random/boot_id 2>/dev/null || hostname; "
    "echo @@; cat /proc/{pid}/stat 2>/dev/null; echo @@; tr '\\0' '\\037' < "
    "/proc/{pid}/cmdline 2>/dev/null; "
    "else echo ps; echo @@; ps -o pgid= -o stat= -o lstart= -p {pid}; echo @@; ps -o "
    "args= -p {pid}; fi"
)


def _parse_identity(out: str) -> ProcessIdentity | None:
    parts = out.split("@@\n")
    if len(parts) != 3 or not parts[1].strip():
        return None
    boot, stat, argv = parts[0].strip(), parts[1].strip(), parts[2]
    if boot == "ps":  # no /proc: pgid, state, then the start time to the second (lstart)
        pgid, state, *lstart = stat.split()
        return ProcessIdentity(
            "ps", " ".join(lstart), int(pgid), state.startswith("Z"), (argv.strip(),)
        )
    fields = stat[stat.rfind(")") + 2 :].split()  # comm may hold spaces and parentheses
    return ProcessIdentity(
        boot,
        fields[19],
        int(fields[2]),
        fields[0] == "Z",
        tuple(a for a in argv.rstrip("\n").split("\x1f") if a),
    )


def alive_from_status(status: str) -> bool:
    """Liveness from /proc/<pid>/status. A zombie main thread is dead only once its other threads
    are gone too: until then they may still hold the server's port, and a relaunch would fail."""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    zombie = fields.get("State", "").strip().startswith("Z")
    return not zombie or int(fields.get("Threads", "1").strip() or 1) > 1


def env_exports(env: dict[str, str] | None) -> str:
    """`A='1' B='x y'`: names checked (never quoted, so never free text), values quoted."""
    return " ".join(f"{check_env_name(k)}={shlex.quote(str(v))}" for k, v in (env or {}).items())


def _background_script(
    command: str,
    log_path: str | Path,
    env: dict[str, str] | None,
    cwd: str | Path | None,
    env_on_stdin: bool = False,
) -> str:
    """A shell line that starts `command` detached and prints its pid at once.

    setsid gives it its own session and process group (so kill_group reaches its children),
    stdin comes from /dev/null and both outputs go to the log, so no channel stays open: with
    Fabric, an open stdout would make the launch block for as long as the server runs.
    env_on_stdin: first read `export NAME='value'` lines from stdin (secrets, off the command line).
    """
    exports = env_exports(env)
    prefix = 'eval "$(cat)"; ' if env_on_stdin else ""
    prefix += f"cd {shlex.quote(str(cwd))}; " if cwd else ""
    log = shlex.quote(str(log_path))
    inner = f"{'export ' + exports + '; ' if exports else ''}exec {command}"
    return (
        f'{prefix}mkdir -p "$(dirname {log})"; '
        f"setsid sh -c {shlex.quote(inner)} >> {log} 2>&1 < /dev/null & echo $!"
    )


class BaseHost:
    """What both hosts (LocalHost below, SSHHost) do the same way on top of their own `run`."""

    name: str

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()  # closes the connection; an exception in the block still propagates

    def _result(
        self, command: str, exit_code: int, stdout: str, stderr: str, check: bool
    ) -> RunResult:
        result = RunResult(exit_code, stdout, stderr)
        if check and not result.ok:
            raise HostError(self.name, command, exit_code, stderr)
        return result

    def start(self, command, *, log_path, env=None, cwd=None, secret_env=None) -> int:
        env_exports(secret_env)  # names checked before anything runs
        register(*(secret_env or {}).values())
        out = self._start_script(
            _background_script(
                command, log_path, env, cwd, bool(secret_env) and self._secrets_on_stdin
            ),
            secret_env or {},
        ).stdout
        return int(out.strip().splitlines()[-1])

    def process_identity(self, pid: int) -> ProcessIdentity | None:
        """The process's identity, or None if no process has that pid (read from the process
        table)."""
        return _parse_identity(
            self.run(_IDENTITY.format(pid=int(pid)), check=False, timeout=30).stdout
        )

    def machine_identity(self) -> tuple[str, str]:
        """(hostname, machine id): the machine the host's commands run on, however it was
        reached."""
        out = self.run(
            "hostname; cat /etc/machine-id 2>/dev/null || cat /var/lib/dbus/machine-id 2>/dev/null "
            "|| cat /proc/sys/kernel/random/boot_id",
            timeout=30,
        ).stdout.split()
        return out[0], out[1] if len(out) > 1 else out[0]


class LocalHost(BaseHost):
    """This machine, through subprocess."""

    _secrets_on_stdin = False

    def __init__(self, name: str = "localhost"):
        self.name = name

    def _start_script(self, script: str, secret_env: dict[str, str]) -> RunResult:
        return self.run(script, timeout=30, env=secret_env)  # the environment, not the command

    def run(self, command, *, check=True, timeout=None, env=None) -> RunResult:
        env_exports(env)
        full_env = {**os.environ, **(env or {})}
        try:
            p = subprocess.run(
                command, shell=True, capture_output=True, text=True, timeout=timeout, env=full_env
            )
        except subprocess.TimeoutExpired as e:
            raise HostError(self.name, command, None, f"timed out after {timeout}s") from e
        return self._result(command, p.returncode, p.stdout, p.stderr, check)

    def is_alive(self, pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:
            return alive_from_status(Path(f"/proc/{pid}/status").read_text())
        except FileNotFoundError:
            return False

    def read_from(self, path, offset, max_bytes=1 << 20) -> tuple[bytes, int]:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read(max_bytes)
        except FileNotFoundError:
            return b"", offset
        return data, offset + len(data)

    def put(self, local, remote) -> None:
        write_bytes_atomic(remote, Path(local).read_bytes())

    def get(self, remote, local) -> None:
        self.put(remote, local)

    def list_dir(self, path) -> list[str] | None:
        """The names in a folder, sorted; None if there is no such folder."""
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise HostError(self.name, f"<listdir {path}>", None, f"{type(e).__name__}: {e}") from e

    def read_file(self, path) -> bytes | None:
        """A whole file's bytes; None if there is no such file."""
        try:
            return Path(path).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise HostError(self.name, f"<read {path}>", None, f"{type(e).__name__}: {e}") from e

    def remove_tree(self, path) -> int:
        """Delete a folder and everything in it; returns how many files went (0: no such folder)."""
        if not os.path.isdir(path) or os.path.islink(path):
            return 0
        count = sum(len(files) for _, _, files in os.walk(path))
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as e:  # a file written into it meanwhile, say: the caller decides
            raise HostError(self.name, f"<remove {path}>", None, f"{type(e).__name__}: {e}") from e
        return count

    def kill_group(self, pid: int, sig: int = signal.SIGTERM) -> None:
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        pass


def make_host(cfg: HostConfig, field: str = "server.host") -> Host:
    """The Host for a config section (`field` names that section in configuration errors)."""
    if cfg.kind != "ssh":
        return LocalHost(cfg.name)
    from eyas.server.ssh_host import SSHHost  # here, not at the top: ssh_host builds on this module

    return SSHHost(cfg, field)


def wait_dead(host: Host, pid: int, timeout: float, poll: float = 0.1) -> bool:
    """True once pid is gone, False if it is still alive after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not host.is_alive(pid):
            return True
        time.sleep(poll)
    return not host.is_alive(pid)
