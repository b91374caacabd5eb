"""Where commands run: this machine (subprocess) or a GPU host over SSH (Fabric), behind one seam.

    host = make_host(cfg.server.host)
    pid = host.start("python3 -m eyas serve-local ...", log_path="/srv/eyas/server.log", env={...})
    while host.is_alive(pid): chunk, offset = host.read_from("/srv/eyas/server.log", offset)
    host.kill_group(pid)

Both implementations have the same methods and the same failure types, so stages never ask which
one they hold. Commands are shell strings run by /bin/sh on the host: callers quote every value in
them (shlex); environment names are checked here. Secret variables (`start(..., secret_env=)`)
never enter a command string: a local process gets them through its environment, an SSH one
through the channel's stdin. Error messages pass through eyas.secrets.redact.
"""

from __future__ import annotations

import io
import logging
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from eyas.config import HostConfig
from eyas.secrets import check_env_name, redact, register

log = logging.getLogger(__name__)


def free_port(bind: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at `bind` right now (tests and benchmarks start servers there)."""
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


class HostError(RuntimeError):
    """A command on a host failed; carries the host, the command and what it printed."""

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

    def __init__(self, host: str, reason: str):
        super().__init__(host, "<connect>", None, reason)
        self.args = (f"[{host}] authentication or host-key failure: {reason}",)


class HostConfigError(HostAuthError):
    """The host's configuration cannot work (a known_hosts file that is not there): never retried."""

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

    def run(self, command: str, *, check: bool = True, timeout: float | None = None,
            env: dict[str, str] | None = None) -> RunResult: ...
    def start(self, command: str, *, log_path: str | Path, env: dict[str, str] | None = None,
              cwd: str | Path | None = None, secret_env: dict[str, str] | None = None) -> int: ...
    def is_alive(self, pid: int) -> bool: ...
    def read_from(self, path: str | Path, offset: int, max_bytes: int = 1 << 20) -> tuple[bytes, int]: ...
    def put(self, local: str | Path, remote: str | Path) -> None: ...
    def get(self, remote: str | Path, local: str | Path) -> None: ...
    def list_dir(self, path: str | Path) -> list[str] | None: ...
    def read_file(self, path: str | Path) -> bytes | None: ...
    def remove_tree(self, path: str | Path) -> int: ...
    def kill_group(self, pid: int, sig: int = signal.SIGTERM) -> None: ...
    def process_identity(self, pid: int) -> ProcessIdentity | None: ...
    def machine_identity(self) -> tuple[str, str]: ...
    def close(self) -> None: ...


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
_IDENTITY = ("if [ -r /proc/self/stat ]; then cat /proc/sys/kernel/random/boot_id 2>/dev/null || hostname; "
             "echo @@; cat /proc/{pid}/stat 2>/dev/null; echo @@; tr '\\0' '\\037' < /proc/{pid}/cmdline 2>/dev/null; "
             "else echo ps; echo @@; ps -o pgid= -o stat= -o lstart= -p {pid}; echo @@; ps -o args= -p {pid}; fi")


def _parse_identity(out: str) -> ProcessIdentity | None:
    parts = out.split("@@\n")
    if len(parts) != 3 or not parts[1].strip():
        return None
    boot, stat, argv = parts[0].strip(), parts[1].strip(), parts[2]
    if boot == "ps":  # no /proc: pgid, state, then the start time to the second (lstart)
        pgid, state, *lstart = stat.split()
        return ProcessIdentity("ps", " ".join(lstart), int(pgid), state.startswith("Z"), (argv.strip(),))
    fields = stat[stat.rfind(")") + 2:].split()  # comm may hold spaces and parentheses
    return ProcessIdentity(boot, fields[19], int(fields[2]), fields[0] == "Z",
                           tuple(a for a in argv.rstrip("\n").split("\x1f") if a))


def _alive_from_status(status: str) -> bool:
    """Liveness from /proc/<pid>/status. A zombie main thread is dead only once its other threads
    are gone too: until then they may still hold the server's port, and a relaunch would fail."""
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    zombie = fields.get("State", "").strip().startswith("Z")
    return not zombie or int(fields.get("Threads", "1").strip() or 1) > 1


def _exports(env: dict[str, str] | None) -> str:
    """`A='1' B='x y'`: names checked (never quoted, so never free text), values quoted."""
    return " ".join(f"{check_env_name(k)}={shlex.quote(str(v))}" for k, v in (env or {}).items())


def _background_script(command: str, log_path: str | Path, env: dict[str, str] | None,
                       cwd: str | Path | None, env_on_stdin: bool = False) -> str:
    """A shell line that starts `command` detached and prints its pid at once.

    setsid gives it its own session and process group (so kill_group reaches its children),
    stdin comes from /dev/null and both outputs go to the log, so no channel stays open: with
    Fabric, an open stdout would make the launch block for as long as the server runs.
    env_on_stdin: first read `export NAME='value'` lines from stdin (secrets, off the command line).
    """
    exports = _exports(env)
    prefix = 'eval "$(cat)"; ' if env_on_stdin else ""
    prefix += f"cd {shlex.quote(str(cwd))}; " if cwd else ""
    log = shlex.quote(str(log_path))
    inner = f"{'export ' + exports + '; ' if exports else ''}exec {command}"
    return (f"{prefix}mkdir -p \"$(dirname {log})\"; "
            f"setsid sh -c {shlex.quote(inner)} >> {log} 2>&1 < /dev/null & echo $!")


class _BaseHost:
    """What both hosts do the same way on top of their own `run`."""

    name: str

    def _result(self, command: str, exit_code: int, stdout: str, stderr: str, check: bool) -> RunResult:
        result = RunResult(exit_code, stdout, stderr)
        if check and not result.ok:
            raise HostError(self.name, command, exit_code, stderr)
        return result

    def start(self, command, *, log_path, env=None, cwd=None, secret_env=None) -> int:
        _exports(secret_env)  # names checked before anything runs
        register(*(secret_env or {}).values())
        out = self._start_script(_background_script(command, log_path, env, cwd, bool(secret_env)
                                                    and self._secrets_on_stdin), secret_env or {}).stdout
        return int(out.strip().splitlines()[-1])

    def process_identity(self, pid: int) -> ProcessIdentity | None:
        """The process's identity, or None if no process has that pid (read from the process table)."""
        return _parse_identity(self.run(_IDENTITY.format(pid=int(pid)), check=False, timeout=30).stdout)

    def machine_identity(self) -> tuple[str, str]:
        """(hostname, machine id): the machine the host's commands run on, however it was reached."""
        out = self.run("hostname; cat /etc/machine-id 2>/dev/null || cat /var/lib/dbus/machine-id 2>/dev/null "
                       "|| cat /proc/sys/kernel/random/boot_id", timeout=30).stdout.split()
        return out[0], out[1] if len(out) > 1 else out[0]


class LocalHost(_BaseHost):
    """This machine, through subprocess."""

    _secrets_on_stdin = False

    def __init__(self, name: str = "localhost"):
        self.name = name

    def _start_script(self, script: str, secret_env: dict[str, str]) -> RunResult:
        return self.run(script, timeout=30, env=secret_env)  # the environment, not the command

    def run(self, command, *, check=True, timeout=None, env=None) -> RunResult:
        _exports(env)
        full_env = {**os.environ, **(env or {})}
        try:
            p = subprocess.run(command, shell=True, capture_output=True, text=True,
                               timeout=timeout, env=full_env)
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
            return _alive_from_status(Path(f"/proc/{pid}/status").read_text())
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
        Path(remote).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{remote}.tmp-{os.getpid()}")
        tmp.write_bytes(Path(local).read_bytes())
        os.replace(tmp, remote)

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


# Errors from paramiko that mean "could not reach the host" rather than "we were refused".
def _classify_connect_error(name: str, e: BaseException) -> HostError:
    import paramiko

    if isinstance(e, paramiko.AuthenticationException):
        return HostAuthError(name, f"{type(e).__name__}: {e}")
    if isinstance(e, paramiko.SSHException) and "known_hosts" in str(e):
        return HostAuthError(name, f"unknown host key: {e}")
    if isinstance(e, paramiko.BadHostKeyException):
        return HostAuthError(name, f"host key mismatch: {e}")
    if isinstance(e, (OSError, socket.timeout, paramiko.SSHException, EOFError)):
        return HostUnreachable(name, f"{type(e).__name__}: {e}")
    return HostError(name, "<connect>", None, f"{type(e).__name__}: {e}")


# Files this large are read through `cat` on an exec channel, smaller ones over SFTP: a session
# costs ~0.1-0.2 s to open on a busy host, and `cat` saves about that per 16 MB (bench/dump_read.py).
STREAM_BYTES = 16 << 20


class _WholeStream(io.StringIO):
    """stdin for Fabric, handed over in one read (invoke reads 1 byte per 10 ms otherwise), then EOF."""

    def read(self, size: int | None = -1) -> str:
        return super().read()


class _AcceptUnknownHostKey:
    """insecure_accept_any_host_key: a host known_hosts does not list is accepted, with a warning,
    and not written to the file. A listed host whose key differs never gets here: paramiko refuses it."""

    def __init__(self, name: str):
        self.name = name

    def missing_host_key(self, client, hostname, key) -> None:
        log.warning("[%s] accepting the unlisted host key of %s (%s %s) because insecure_accept_any_host_key "
                    "is true; add it to known_hosts", self.name, hostname, key.get_name(), key.fingerprint)


class SSHHost(_BaseHost):
    """A remote host through Fabric, with its host key checked against a known_hosts file."""

    _secrets_on_stdin = True

    def __init__(self, cfg: HostConfig, field: str = "server.host"):
        from fabric import Connection

        self.name = cfg.name
        self.cfg = cfg
        connect_kwargs = {"look_for_keys": cfg.key_filename is None, "allow_agent": False}
        if cfg.key_filename:
            connect_kwargs["key_filename"] = str(Path(cfg.key_filename).expanduser())
        self._conn = Connection(host=cfg.hostname, user=cfg.user, port=cfg.port,
                                connect_timeout=cfg.connect_timeout_s, connect_kwargs=connect_kwargs)
        # Fabric installs AutoAddPolicy (trust any key, and write it into a loaded known_hosts).
        # known_hosts is always read when configured, so a key that contradicts it is always refused.
        import paramiko

        if cfg.known_hosts is not None:
            known = Path(cfg.known_hosts).expanduser()
            if not known.is_file():
                raise HostConfigError(self.name, f"{field}.known_hosts: {known} does not exist (it must list "
                                                 f"the host's key: ssh-keyscan -p {cfg.port} {cfg.hostname})")
            self._conn.client.load_host_keys(str(known))
        insecure = cfg.insecure_accept_any_host_key
        self._conn.client.set_missing_host_key_policy(
            _AcceptUnknownHostKey(self.name) if insecure else paramiko.RejectPolicy())

    def _open(self):
        if not self._conn.is_connected:
            if self.cfg.insecure_accept_any_host_key:
                log.warning("[%s] connecting with insecure_accept_any_host_key: true: a host key known_hosts "
                            "does not list is accepted unchecked", self.name)
            try:
                self._conn.open()
            except Exception as e:  # noqa: BLE001 - classified into our three error types
                raise _classify_connect_error(self.name, e) from e
        return self._conn

    def run(self, command, *, check=True, timeout=None, env=None, stdin: str | None = None) -> RunResult:
        from invoke.exceptions import CommandTimedOut

        if env:
            command = f"export {_exports(env)}; {command}"
        conn = self._open()
        try:
            r = conn.run(command, hide=True, warn=True, timeout=timeout,
                         in_stream=False if stdin is None else _WholeStream(stdin))
        except CommandTimedOut as e:
            raise HostError(self.name, command, None, f"timed out after {timeout}s") from e
        except (OSError, EOFError) as e:
            self._conn.close()
            raise HostUnreachable(self.name, f"{type(e).__name__}: {e}") from e
        return self._result(command, r.exited, r.stdout, r.stderr, check)

    def _start_script(self, script: str, secret_env: dict[str, str]) -> RunResult:
        # The secrets travel on the channel's stdin, read by the script's `eval "$(cat)"`.
        lines = "".join(f"export {_exports({k: v})}\n" for k, v in secret_env.items())
        return self.run(script, timeout=30, stdin=lines or None)

    def is_alive(self, pid: int) -> bool:
        # Reading /proc/<pid>/stat over the open SFTP channel costs well under a millisecond;
        # an exec channel (ps) costs a fork of a session on the host, ~100x more. A zombie
        # counts as dead.
        try:
            with self._open().sftp().open(f"/proc/{int(pid)}/status", "rb") as f:
                return _alive_from_status(f.read(4096).decode(errors="replace"))
        except FileNotFoundError:
            return False
        except (IOError, IndexError) as e:
            if getattr(e, "errno", None) == 2:
                return False
        r = self.run(f"ps -o stat= -p {int(pid)}", check=False)  # a host without /proc
        return r.ok and r.stdout.strip() != "" and not r.stdout.strip().startswith("Z")

    def read_from(self, path, offset, max_bytes=1 << 20) -> tuple[bytes, int]:
        conn = self._open()
        try:
            sftp = conn.sftp()
            with sftp.open(str(path), "rb") as f:
                f.seek(offset)
                data = f.read(max_bytes)
        except FileNotFoundError:
            return b"", offset
        except IOError as e:
            if getattr(e, "errno", None) == 2:
                return b"", offset
            raise HostUnreachable(self.name, f"{type(e).__name__}: {e}") from e
        return data, offset + len(data)

    def put(self, local, remote) -> None:
        conn = self._open()
        tmp = f"{remote}.tmp-{os.getpid()}"
        self.run(f"mkdir -p {shlex.quote(str(Path(remote).parent))}")
        conn.put(str(local), remote=tmp)
        self.run(f"mv -f {shlex.quote(tmp)} {shlex.quote(str(remote))}")

    def get(self, remote, local) -> None:
        conn = self._open()
        Path(local).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{local}.tmp-{os.getpid()}")
        conn.get(str(remote), local=str(tmp))
        os.replace(tmp, local)

    # Files through the connection's SFTP channel: one request costs about a millisecond, where a
    # command (an exec channel) costs a session on the host; bulk reads run at the channel's rate.
    def _sftp_call(self, what: str, path, fn):
        try:
            sftp = self._open().sftp()
            if sftp.get_channel().closed:  # Fabric keeps the SFTP client of a connection that died
                self._conn.close()
                sftp = self._open().sftp()
            return fn(sftp)
        except FileNotFoundError:
            return None
        except (EOFError, OSError) as e:
            # The host's answer (permission denied, not a folder: the connection lives) is an error
            # about the path; a dropped connection is "unreachable", and the next call connects again.
            transport = self._conn.client.get_transport() if self._conn.is_connected else None
            if isinstance(e, OSError) and transport is not None and transport.is_active():
                raise HostError(self.name, f"<sftp {what} {path}>", None, f"{type(e).__name__}: {e}") from e
            self._conn.close()
            raise HostUnreachable(self.name, f"{what} {path}: {type(e).__name__}: {e}") from e
        except Exception as e:  # noqa: BLE001 - paramiko's SSHException: the channel is unusable
            import paramiko

            if not isinstance(e, paramiko.SSHException):
                raise
            self._conn.close()
            raise HostUnreachable(self.name, f"{what} {path}: {type(e).__name__}: {e}") from e

    def list_dir(self, path) -> list[str] | None:
        return self._sftp_call("listdir", path, lambda sftp: sorted(sftp.listdir(str(path))))

    def read_file(self, path) -> bytes | None:
        def read(sftp):
            with sftp.open(str(path), "rb") as f:
                st = f.stat()
                size = st.st_size
                if size >= STREAM_BYTES and stat.S_ISREG(st.st_mode or 0):
                    return self._cat(path)
                f.prefetch(size)  # requests in flight ahead of the reads, as sftp.get does
                # One SFTP request's worth per read: paramiko grows its buffer by copying, so a
                # larger read costs a copy per 32 KB block (4x slower at 1 MB).
                chunks = []
                while chunk := f.read(32768):
                    chunks.append(chunk)
                return b"".join(chunks)
        return self._sftp_call("read", path, read)

    def _cat(self, path) -> bytes:
        """A file's bytes through `cat` on an exec channel: no SFTP framing per 32 KB, so about twice
        SFTP's rate on loopback, for the price of a session on the host (bench/dump_read.py)."""
        channel = self._open().client.get_transport().open_session()
        try:
            channel.exec_command(f"cat -- {shlex.quote(str(path))}")
            chunks = []
            while chunk := channel.recv(1 << 20):
                chunks.append(chunk)
            code = channel.recv_exit_status()
            err = b""
            while channel.recv_stderr_ready():
                err += channel.recv_stderr(65536)
        finally:
            channel.close()
        if code != 0:
            message = err.decode(errors="replace").strip()
            if "No such file" in message:
                raise FileNotFoundError(message)
            raise OSError(f"cat {path} exited {code}: {message}")
        return b"".join(chunks)

    def remove_tree(self, path) -> int:
        def remove(sftp, folder: str) -> int:
            count = 0
            for entry in sftp.listdir_attr(folder):
                child = f"{folder}/{entry.filename}"
                if stat.S_ISDIR(entry.st_mode or 0):
                    count += remove(sftp, child)
                else:
                    sftp.remove(child)
                    count += 1
            sftp.rmdir(folder)
            return count

        def top(sftp) -> int:
            if not stat.S_ISDIR(sftp.lstat(str(path)).st_mode or 0):
                return 0
            return remove(sftp, str(path).rstrip("/"))
        return self._sftp_call("remove", path, top) or 0

    def kill_group(self, pid: int, sig: int = signal.SIGTERM) -> None:
        self.run(f"kill -{int(sig)} -- -{int(pid)}", check=False)

    def close(self) -> None:
        self._conn.close()


def make_host(cfg: HostConfig, field: str = "server.host") -> Host:
    """The Host for a config section (`field` names that section in configuration errors)."""
    return SSHHost(cfg, field) if cfg.kind == "ssh" else LocalHost(cfg.name)


def wait_dead(host: Host, pid: int, timeout: float, poll: float = 0.1) -> bool:
    """True once pid is gone, False if it is still alive after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not host.is_alive(pid):
            return True
        time.sleep(poll)
    return not host.is_alive(pid)
