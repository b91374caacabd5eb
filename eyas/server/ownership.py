"""What is eyas's own: the servers a run launched and the folders eyas made. Nothing else is
signalled or deleted.

    owner = Owner.new(runs=[flow_run_id, parent_run_id])   # who launches: a token, the flow runs
    # "alive" | "gone" | "replaced" | "unverified"
    verdict(host, handle)
    # make + mark it, or refuse foreign content
    prepare_dump_dir(host, python, path, config_name)
    # delete only eyas's records, in a marked folder
    clean_dump_dir(host, python, path)

A pid is reused, a process's (boot id, start time) is not: the launch record (server.pid, JSON)
carries both, read from the host's process table through the Host seam, so a stale record can
never name someone else's process. A folder is eyas's when it holds the marker `.eyas-owned`
written when eyas created (or adopted an empty) folder; eyas deletes its records there, and the
folder itself only if eyas created it.
"""

from __future__ import annotations

import json
import shlex
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from eyas.remote import source
from eyas.server.hosts import Host

if TYPE_CHECKING:  # launch builds on this module
    from eyas.server.launch import ServerHandle

MARKER = ".eyas-owned"


@dataclass(frozen=True)
class Owner:
    """Who launches a server: a token unique to this launch, and the flow runs it happens in (the
    launching run first, then its parents), so a run's failure hook can tell its server from
    others'."""

    token: str
    runs: tuple[str, ...] = ()

    @classmethod
    def new(cls, runs=()) -> "Owner":
        return cls(uuid.uuid4().hex, tuple(str(r) for r in runs if r))


def verdict(host: Host, handle: ServerHandle) -> str:
    """Is the launched server (launch.ServerHandle, as server.pid records it) still the process it
    names?

    alive: the pid lives with the recorded boot id and start time. gone: no such pid (or a zombie
    without threads). replaced: the pid now belongs to another process. unverified: the record has
    no identity (written by an older eyas): only its command line can speak for it.
    """
    found = host.process_identity(handle.pid)
    if found is None or (found.zombie and not host.is_alive(handle.pid)):
        return "gone"
    if not handle.start:
        return "unverified"
    same = found.boot == handle.boot and found.start == handle.start
    return "alive" if same and found.pgrp == handle.pid else "replaced"


def _dump_dir(host: Host, python: str, action: str, path: str, name: str) -> dict:
    q = shlex.quote
    r = host.run(
        f"{q(python)} -c {q(source('dump_dir'))} {action} {q(str(path))} {q(name)}", timeout=120
    )
    return json.loads(r.stdout.strip().splitlines()[-1])


def prepare_dump_dir(host: Host, python: str, path: str, config_name: str) -> dict:
    """Make the dump folder (marked as eyas's) or empty an eyas one of old records; {"state":
    "refused", "foreign": [...]} when it holds anything eyas did not write: nothing is touched
    then."""
    return _dump_dir(host, python, "prepare", path, config_name)


def clean_dump_dir(host: Host, python: str, path: str) -> dict:
    """Delete eyas's records in a marked dump folder, and the folder if eyas created it; a folder
    without the marker, and any file eyas did not write, are left alone."""
    return _dump_dir(host, python, "clean", path, "")
