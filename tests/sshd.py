"""A real OpenSSH server on 127.0.0.1 for the Fabric tests, with throwaway keys.

The fixture starts /usr/sbin/sshd on a free port in a temp dir and writes a known_hosts file with
its host key, so SSHHost is tested with host-key checking on, as in production.
"""

from __future__ import annotations

import getpass
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from eyas.server.hosts import free_port

SSHD = "/usr/sbin/sshd"


@dataclass
class Sshd:
    port: int
    user: str
    client_key: Path
    known_hosts: Path
    other_key: Path  # a key the server does not accept
    process: subprocess.Popen




def _keygen(path: Path) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)


def start_sshd(root: Path) -> Sshd:
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
        f"UsePAM no\nPidFile {root / 'sshd.pid'}\nSubsystem sftp internal-sftp\nMaxSessions 50\n")
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stdout=subprocess.DEVNULL,
                            stderr=open(root / "sshd.log", "wb"))
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
    return Sshd(port, getpass.getuser(), root / "client_key", root / "known_hosts", root / "other_key", proc)
