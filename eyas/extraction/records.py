"""Where the collector reads a server's dump records: here, or on the server's host through the Host
seam.

    store = DumpStore("/dev/shm/eyas-dump", cfg.server.host)  # nothing is touched before first use
    # parsed and checked per record by eyas.dump; [] if none yet
    records = store.read(rid)
    store.remove(["<rid>-a0", "<rid>-a1"]) # consumed or abandoned records
    store.route                            # "local" or "host", once decided

The route is decided once per store, at its first use. A folder of this machine (no host, or a
local one) is read here. For an SSH host, a probe file is written into the dump
folder through the host and looked for at the same path here (probe_visible): found (the
orchestrator runs on the node, or mounts its dump folder), records are read here at file speed;
not found (the orchestrator is another machine), every record comes over SSH (Host.list_dir and
Host.read_file: SFTP, or `cat` on an exec channel for large files), on up to `connections`
connections at once. The probe is shaped like an abandoned record
(`<dump_dir>/eyas-route-<hex>/.0000000000.safetensors.tmp-<hex>`), so one that a killed run leaves
behind is cleaned with the records and never blocks a launch.

Over SSH a record costs its bytes at the channel's rate: 100-180 MB/s per connection on loopback
(paramiko, aes128-ctr; bench/dump_read.py, bench/results/2026-12-05_cpu2_dump-read.md), where a
tmpfs here gives GB/s. A worker on the node is the fast layout; validation is eyas.dump's either
way.
"""

from __future__ import annotations

import logging
import queue
import shlex
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from typing import Iterator

from eyas.config import HostConfig
from eyas.dump import (
    DumpRecord,
    check_rid,
    is_record_name,
    read_records,
    records_from_bytes,
    remove_records,
)
from eyas.server.hosts import Host, HostError, HostUnreachable, make_host

log = logging.getLogger(__name__)

PROBE_PREFIX = (
    "eyas-route-"  # a rid-shaped folder: eyas's dump-folder cleaner treats it as a record's
)


def probe_visible(host: Host, path: str | Path) -> tuple[bool, str]:
    """Is the folder `path` on `host` (or its nearest existing ancestor there) the same folder here?

    A probe with a fresh token is written there through the host, looked for at the same path
    here, and removed. Returns (visible here, the folder probed)."""
    token, q = uuid.uuid4().hex, shlex.quote
    r = host.run(
        f'd={q(str(path))}; while [ ! -d "$d" ]; do d=$(dirname "$d"); done; '
        f'p="$d/{PROBE_PREFIX}{token}"; mkdir "$p" && '
        f'printf %s {token} > "$p/.0000000000.safetensors.tmp-{token}" && printf %s "$d"',
        timeout=60,
    )
    folder = PurePosixPath(r.stdout.strip()) / f"{PROBE_PREFIX}{token}"
    try:
        seen = Path(folder / f".0000000000.safetensors.tmp-{token}").read_text()
    except (OSError, UnicodeDecodeError):
        seen = None
    finally:
        host.remove_tree(folder)
    return seen == token, str(folder.parent)


class DumpStore:
    """One server's dump folder, read here or through its host (see the module docstring).

    `host` is the machine the server dumps on (dump_dir is a path there); None = this machine.
    `connections` bounds the SSH connections the host route opens (one read or removal each at
    once); `field` names the host's config section in configuration errors.
    """

    def __init__(
        self,
        dump_dir: str | Path,
        host: HostConfig | None = None,
        *,
        connections: int = 2,
        field: str = "server.host",
    ):
        self.dump_dir = Path(dump_dir)
        self.field = field
        self.host_cfg = host if host is not None and host.kind == "ssh" else None
        self.connections = max(1, connections)
        self._route: str | None = None if self.host_cfg else "local"
        self._lock = threading.Lock()  # the route is decided once
        self._idle: queue.LifoQueue[Host] = queue.LifoQueue()
        self._opened: list[Host] = []
        self._opened_lock = threading.Lock()
        self._slots = threading.Semaphore(self.connections)

    @property
    def where(self) -> str:
        """The dump folder, named as messages name it: `host:/path` for a remote one."""
        return f"{self.host_cfg.name}:{self.dump_dir}" if self.host_cfg else str(self.dump_dir)

    @property
    def route(self) -> str | None:
        """ "local" (read here) or "host" (through the host); None until the first use decides."""
        return self._route

    # ------------------------------------------------------------------ the route

    def _decide(self) -> str:
        with self._lock:
            if self._route is None:
                with self._host() as host:
                    self._route = "local" if probe_visible(host, self.dump_dir)[0] else "host"
                log.info(
                    "[%s] dump records in %s are read %s",
                    self.host_cfg.name,
                    self.dump_dir,
                    "here (the folder is visible on this machine)"
                    if self._route == "local"
                    else "through SSH (the folder is not visible on this machine)",
                )
            return self._route

    # ------------------------------------------------------------------ connections

    @contextmanager
    def _host(self) -> Iterator[Host]:
        """A connection to the host, for one operation; at most `connections` are open."""
        self._slots.acquire()
        try:
            try:
                host = self._idle.get_nowait()
            except queue.Empty:
                host = make_host(self.host_cfg, self.field)
                with self._opened_lock:
                    self._opened.append(host)
            try:
                yield host
            finally:
                self._idle.put(host)  # reusable after any failure: a lost connection reconnects
        finally:
            self._slots.release()

    def _on_host(self, what: str, fn):
        """fn(host), once more on a fresh connection when the first one was lost."""
        for attempt in (0, 1):
            with self._host() as host:
                try:
                    return fn(host)
                except HostUnreachable:
                    if attempt:
                        raise
                    log.warning(
                        "[%s] connection lost while %s; connecting again", self.host_cfg.name, what
                    )

    # ------------------------------------------------------------------ reading and removing

    def read(self, rid: str, have: dict[str, DumpRecord] | None = None) -> list[DumpRecord]:
        """The request's records, sorted by offset ([] if none yet). `have` (host route): records
        read by an earlier call for the same rid, by file name; only new files are fetched."""
        if (self._route or self._decide()) == "local":
            return read_records(self.dump_dir, rid)
        folder = PurePosixPath(self.dump_dir) / check_rid(rid)
        have = {} if have is None else have

        def fetch(host: Host) -> list[DumpRecord]:
            names = [n for n in host.list_dir(folder) or [] if is_record_name(n) and n not in have]
            files = [(f"{host.name}:{folder / n}", host.read_file(folder / n)) for n in names]
            fresh = records_from_bytes(rid, [(w, d) for w, d in files if d is not None])
            have.update({f"{r.prefix_offset:010d}.safetensors": r for r in fresh})
            return sorted(have.values(), key=lambda r: r.prefix_offset)

        return self._on_host(f"reading the records of {rid}", fetch)

    def remove(self, rids: list[str]) -> int:
        """Delete these requests' records (any that exist); returns how many files went. Never
        raises for the host route: a record left behind is removed when the server stops.

        An SSH store no read has used yet is left alone: the collector removes every attempt's
        records on every endpoint after each sequence, and probing (or waiting out the connect
        timeout of) a host whose server never answered would cost each sequence that much."""
        if self._route is None:
            return 0
        wanted = [check_rid(r) for r in rids]

        def remove(host: Host) -> int:
            present = set(host.list_dir(self.dump_dir) or [])
            return sum(
                host.remove_tree(PurePosixPath(self.dump_dir) / r) for r in wanted if r in present
            )

        if self._route == "local":
            return sum(remove_records(self.dump_dir, r) for r in wanted)
        try:
            return self._on_host(f"removing the records of {wanted[:1]}", remove)
        except HostError as e:
            log.warning("[%s] could not remove dump records %s: %s", self.host_cfg.name, wanted, e)
            return 0

    def close(self) -> None:
        with self._opened_lock:
            opened, self._opened = self._opened, []
        for host in opened:
            host.close()
