"""What reading one dump record costs: here (a tmpfs on this machine) against through an SSH host.

    python bench/dump_read.py [--tokens 4096] [--reps 3]

One record as large as a Kimi-K2.5 request of `--tokens` tokens (H = 7168, three aux layers and the
last layer in bf16: 57 KB per token, 235 MB at 4096) is written to /dev/shm, then read back through
eyas.extraction.records.DumpStore on both routes, each parsed and checked by eyas.dump's reader
(eyas.dump.validate on top, as the collector runs it):

  local   the folder is visible here: read_records on the file (what a worker on the node does)
  host    through a real sshd on 127.0.0.1 (tests/sshd.py) with its dump folder in its own mount
          namespace, so the probe finds it invisible here: SFTP listdir, then Host.read_file
  cat     the bare Host.read_file of the same file over the same connection, made to use `cat` on
          an exec channel (as it does for files of ssh_host.STREAM_BYTES or more)
  sftp    the same made to use a prefetched SFTP read (as it does below that size)
  session_open_s  what opening an exec channel costs (`true`), which the threshold weighs

Needs root, openssh-server and unshare. Best of `--reps`. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eyas.config import HostConfig  # noqa: E402
from eyas.dump import DumpWriter, validate  # noqa: E402
from eyas.extraction.records import DumpStore  # noqa: E402
from eyas.server import ssh_host  # noqa: E402
from eyas.server.ssh_host import SSHHost  # noqa: E402
from tests.sshd import start_sshd  # noqa: E402

HIDDEN, LAYERS = 7168, [2, 30, 58]


def best(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    n, rid = args.tokens, "eyas-bench-a0"
    scratch = Path(tempfile.mkdtemp(prefix="eyas-dump-read-"))
    private = Path(tempfile.mkdtemp(prefix="eyas-dump-read-", dir="/dev/shm"))
    sshd = start_sshd(scratch / "sshd", private_dirs=[private / "node"])
    cfg = HostConfig(
        kind="ssh",
        name="loopback",
        hostname="127.0.0.1",
        port=sshd.port,
        user=sshd.user,
        key_filename=sshd.client_key,
        known_hosts=sshd.known_hosts,
    )
    host = SSHHost(cfg)
    try:
        local = private / "here"
        DumpWriter(local, layer_ids=LAYERS).write(
            rid,
            0,
            torch.arange(n, dtype=torch.int32),
            torch.randn(n, 3 * HIDDEN).to(torch.bfloat16),
            torch.randn(n, HIDDEN).to(torch.bfloat16),
        )
        record = local / rid / "0000000000.safetensors"
        size = record.stat().st_size
        remote = private / "node" / "dump"
        host.put(record, remote / rid / record.name)  # into the namespace's tmpfs: invisible here
        ids = list(range(n))

        here, there = DumpStore(local, None), DumpStore(remote, cfg)
        figures = {"record_mb": round(size / 1e6, 1), "tokens": n}
        figures["local"] = best(lambda: validate(here.read(rid), ids), args.reps)
        figures["host"] = best(lambda: validate(there.read(rid), ids), args.reps)
        assert there.route == "host", there.route
        stream, ssh_host.STREAM_BYTES = (
            ssh_host.STREAM_BYTES,
            0,
        )  # each path on the same file, whatever its size
        figures["cat"] = best(lambda: host.read_file(remote / rid / record.name), args.reps)
        ssh_host.STREAM_BYTES = size + 1
        figures["sftp"] = best(lambda: host.read_file(remote / rid / record.name), args.reps)
        ssh_host.STREAM_BYTES = stream
        transport = host._conn.client.get_transport()

        def session() -> None:
            ch = transport.open_session()
            ch.exec_command("true")
            ch.recv_exit_status()
            ch.close()

        figures["session_open_s"] = round(best(session, 5), 4)
        figures["cipher"] = f"{transport.remote_cipher} / {transport.remote_mac}"
        there.close()
        for k in ("local", "host", "sftp", "cat"):
            print(f"{k:6s} {figures[k]:7.3f} s  {size / figures[k] / 1e6:8.0f} MB/s")
            figures[f"{k}_mb_s"] = round(size / figures[k] / 1e6, 1)
            figures[k] = round(figures[k], 3)
        print(json.dumps(figures))
    finally:
        host.close()
        sshd.process.terminate()
        sshd.process.wait(10)
        shutil.rmtree(private, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
