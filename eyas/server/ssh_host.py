"""The Host for a machine reached over SSH (Fabric): commands on exec channels, files over SFTP.

Its host key is checked against a known_hosts file (paramiko's RejectPolicy) unless the config
says insecure_accept_any_host_key. Connection failures are sorted into HostUnreachable (worth
retrying), HostAuthError (never) and HostError; secret variables travel on the channel's stdin.
"""

from __future__ import annotations

import io
import logging
import os
import shlex
import signal
import socket
import stat
from pathlib import Path

from eyas.config import HostConfig
from eyas.server.hosts import (
    BaseHost,
    HostAuthError,
    HostConfigError,
    HostError,
    HostUnreachable,
    RunResult,
    alive_from_status,
    env_exports,
)

log = logging.getLogger(__name__)


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
# costs ~0.1-0.2 s to open on a busy host, and `cat` saves about that per 16 MB
# (bench/dump_read.py).
STREAM_BYTES = 16 << 20


class _WholeStream(io.StringIO):
    """stdin for Fabric, handed over in one read (invoke reads 1 byte per 10 ms otherwise), then
    EOF."""

    def read(self, size: int | None = -1) -> str:
        return super().read()


class _AcceptUnknownHostKey:
    """insecure_accept_any_host_key: a host known_hosts does not list is accepted, with a warning,
    and not written to the file. A listed host whose key differs never gets here: paramiko refuses
    it."""

    def __init__(self, name: str):
        self.name = name

    def missing_host_key(self, client, hostname, key) -> None:
        log.warning(
            "[%s] accepting the unlisted host key of %s (%s %s) because "
            "insecure_accept_any_host_key is true; add it to known_hosts",
            self.name,
            hostname,
            key.get_name(),
            key.fingerprint,
        )


class SSHHost(BaseHost):
    """A remote host through Fabric, with its host key checked against a known_hosts file."""

    _secrets_on_stdin = True

    def __init__(self, cfg: HostConfig, field: str = "server.host"):
        from fabric import Connection

        self.name = cfg.name
        self.cfg = cfg
        connect_kwargs = {"look_for_keys": cfg.key_filename is None, "allow_agent": False}
        if cfg.key_filename:
            connect_kwargs["key_filename"] = str(Path(cfg.key_filename).expanduser())
        self._conn = Connection(
            host=cfg.hostname,
            user=cfg.user,
            port=cfg.port,
            connect_timeout=cfg.connect_timeout_s,
            connect_kwargs=connect_kwargs,
        )
        # Fabric installs AutoAddPolicy (trust any key, and write it into a loaded known_hosts).
        # known_hosts is always read when configured, so a key that contradicts it is always
        # refused.
        import paramiko

        if cfg.known_hosts is not None:
            known = Path(cfg.known_hosts).expanduser()
            if not known.is_file():
                raise HostConfigError(
                    self.name,
                    f"{field}.known_hosts: {known} does not exist (it must list "
                    f"the host's key: ssh-keyscan -p {cfg.port} {cfg.hostname})",
                )
            self._conn.client.load_host_keys(str(known))
        insecure = cfg.insecure_accept_any_host_key
        self._conn.client.set_missing_host_key_policy(
            _AcceptUnknownHostKey(self.name) if insecure else paramiko.RejectPolicy()
        )

    def _open(self):
        if not self._conn.is_connected:
            if self.cfg.insecure_accept_any_host_key:
                log.warning(
                    "[%s] connecting with insecure_accept_any_host_key: true: a host key "
                    "known_hosts does not list is accepted unchecked",
                    self.name,
                )
            try:
                self._conn.open()
            except Exception as e:  # noqa: BLE001 - classified into our three error types
                raise _classify_connect_error(self.name, e) from e
        return self._conn

    def run(
        self, command, *, check=True, timeout=None, env=None, stdin: str | None = None
    ) -> RunResult:
        from invoke.exceptions import CommandTimedOut

        if env:
            command = f"export {env_exports(env)}; {command}"
        conn = self._open()
        try:
            r = conn.run(
                command,
                hide=True,
                warn=True,
                timeout=timeout,
                in_stream=False if stdin is None else _WholeStream(stdin),
            )
        except CommandTimedOut as e:
            raise HostError(self.name, command, None, f"timed out after {timeout}s") from e
        except (OSError, EOFError) as e:
            self._conn.close()
            raise HostUnreachable(self.name, f"{type(e).__name__}: {e}") from e
        return self._result(command, r.exited, r.stdout, r.stderr, check)

    def _start_script(self, script: str, secret_env: dict[str, str]) -> RunResult:
        # The secrets travel on the channel's stdin, read by the script's `eval "$(cat)"`.
        lines = "".join(f"export {env_exports({k: v})}\n" for k, v in secret_env.items())
        return self.run(script, timeout=30, stdin=lines or None)

    def is_alive(self, pid: int) -> bool:
        # Reading /proc/<pid>/stat over the open SFTP channel costs well under a millisecond;
        # an exec channel (ps) costs a fork of a session on the host, ~100x more. A zombie
        # counts as dead.
        try:
            with self._open().sftp().open(f"/proc/{int(pid)}/status", "rb") as f:
                return alive_from_status(f.read(4096).decode(errors="replace"))
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
            # about the path; a dropped connection is "unreachable", and the next call connects
            # again.
            transport = self._conn.client.get_transport() if self._conn.is_connected else None
            if isinstance(e, OSError) and transport is not None and transport.is_active():
                raise HostError(
                    self.name, f"<sftp {what} {path}>", None, f"{type(e).__name__}: {e}"
                ) from e
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
        """A file's bytes through `cat` on an exec channel: no SFTP framing per 32 KB, so about
        twice SFTP's rate on loopback, for the price of a session on the host
        (bench/dump_read.py)."""
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
