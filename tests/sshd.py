"""A real OpenSSH server on 127.0.0.1 for the Fabric tests, with throwaway keys.

The fixture starts /usr/sbin/sshd on a free port in a temp dir and writes a known_hosts file with
its host key, so SSHHost is tested with host-key checking on, as in production.

`start_sshd(root, private_dirs=[d])` runs that sshd in its own mount namespace with a fresh tmpfs
over each d: whatever its sessions (and the servers they launch) write there, only the SSH side
sees, as a GPU node's /dev/shm is invisible to an orchestrator on another machine. It needs root
and `unshare` (`can_unshare()` says whether this machine allows it).
"""

from __future__ import annotations

import getpass
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from eyas.config import HostConfig
from eyas.net import free_port

SSHD = "/usr/sbin/sshd"


@dataclass
class Sshd:
    port: int
    user: str
    client_key: Path
    known_hosts: Path
    other_key: Path  # a key the server does not accept
    process: subprocess.Popen
    private_dirs: tuple[Path, ...] = ()  # tmpfs mounts only the SSH side sees


def ssh_config(sshd: Sshd, **kw) -> HostConfig:
    """The host config that reaches this sshd as its user, checking its host key (kw overrides a
    field)."""
    base = dict(
        kind="ssh",
        name="loopback",
        hostname="127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        key_filename=sshd.client_key,
        known_hosts=sshd.known_hosts,
        connect_timeout_s=5,
    )
    return HostConfig(**{**base, **kw})


def ssh_host_fields(sshd: Sshd, **kw) -> dict:
    """ssh_config as the mapping a config file (or `server.host` override) holds."""
    return ssh_config(sshd, **kw).model_dump(mode="json")


def sglang_stand_in(folder: Path) -> Path:
    """An executable that answers the SGLang version question as an SGLang 0.5.23 interpreter
    would."""
    stand_in = folder / "python"
    stand_in.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'print(\"0.5.23\")'\n")
    stand_in.chmod(0o755)
    return stand_in


def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def can_unshare() -> bool:
    """Whether this process may start a program in its own mount namespace (root, unshare(1))."""
    try:
        return (
            subprocess.run(
                ["unshare", "--mount", "--propagation", "private", "true"],
                capture_output=True,
                timeout=10,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def start_sshd(root: Path, private_dirs: tuple[Path, ...] | list[Path] = ()) -> Sshd:
    root.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "client_key", "other_key"):
        _keygen(root / name)
    shutil.copy(root / "client_key.pub", root / "authorized_keys")
    port = free_port()
    config = root / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {root / 'host_key'}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin prohibit-password\nStrictModes no\n"
        f"UsePAM no\nPidFile {root / 'sshd.pid'}\nSubsystem sftp internal-sftp\nMaxSessions 50\n"
    )
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    command = [SSHD, "-D", "-e", "-f", str(config)]
    private_dirs = tuple(Path(d) for d in private_dirs)
    if (
        private_dirs
    ):  # mount, then exec: the pid stays sshd's, so terminating it stops the namespace
        for d in private_dirs:
            d.mkdir(parents=True, exist_ok=True)
        mounts = "".join(
            f"mount -t tmpfs eyas-test-private {shlex.quote(str(d))} && " for d in private_dirs
        )
        command = [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"{mounts}exec {shlex.join(command)}",
        ]
    proc = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=open(root / "sshd.log", "wb")
    )
    host_pub = (root / "host_key.pub").read_text().split()
    (root / "known_hosts").write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError(f"sshd did not start: {(root / 'sshd.log').read_text()}")
    return Sshd(
        port,
        getpass.getuser(),
        root / "client_key",
        root / "known_hosts",
        root / "other_key",
        proc,
        private_dirs,
    )
