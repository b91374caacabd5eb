"""One server per GPU host: the host's lock, held from launch to stop, visible to every run that
talks to the same Prefect server.

    with gpu_host(cfg):      # waits while a live run holds the host; takes it from a dead one
        ...

The lock is keyed on the machine the server host is, asked through the Host seam (its hostname and
machine id), never on the free `server.host.name` label: two labels, an alias, another SSH user
or port for one machine are one lock; the key is a safe name whatever the label holds. Two things
in Prefect carry it:

- the Variable `eyas-gpu-host-<machine>`: created by the holder (creation is atomic, so exactly
  one run holds it), holding who holds it: flow run, pid and process start time, machine, since;
- the strict global concurrency limit of the same name (one slot): what the UI's Concurrency page
  shows, taken while the Variable is held.

A run that finds the Variable taken reclaims it only when its holder is provably dead: the
holder's flow run is in a final state (Crashed, Failed, Cancelled, Completed) or gone, or the
holder ran on this machine (same machine id, pid namespace) and its process is gone (kill -9,
OOM killer, a reboot). The holder record is deleted by its id, so of several waiters only one
reclaims, and never a newer holder's record; holding the Variable, the run gives back any slot
the dead holder kept. Otherwise it waits, saying who holds the host and how to free it.

Why not Prefect's leased global concurrency (`prefect.concurrency.sync.concurrency(name, occupy=1,
lease_duration=...)`, Prefect 3.9): a lease frees the slot on a timer, not on proof of death, and
the lock guards GPUs that a live server still occupies.
- A holder that cannot renew for lease_duration (its worker cut off from the API, the API down
  a while) loses the slot while its server still runs: a second run then launches a second server
  on the same GPUs. Here a holder is passed over only when its flow run is final or its process
  provably gone.
- The server keeps leases in memory by default (server.concurrency.lease_storage), the slot count
  in its database: a restarted Prefect server (and `eyas run`'s temporary one, every run, on the
  same PREFECT_HOME database) forgets the lease and the slot stays taken with nothing left to expire
  it, so every later run waits for ever.
- Nothing in the API tells who holds a lease, so a waiting run could not say which run holds the
  host or how to free it; and a holder killed -9 on this machine would block the host for the
  lease's minimum of 60 s plus the server's repossessor loop, where its gone pid frees it at once.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import time
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Iterator

from eyas.config import PipelineConfig
from eyas.server.hosts import LocalHost, make_host

POLL_S = 1.0
REPORT_EVERY_S = 60.0


def host_limit_name(cfg: PipelineConfig) -> str:
    """`eyas-gpu-host-<hostname>-<digest>` of the machine cfg's server host is (asked over SSH
    for an ssh host): lowercase letters, digits and dashes only, a valid Prefect limit, Variable
    and file name whatever server.host.name holds."""
    with make_host(cfg.server.host) as host:
        hostname, machine = host.machine_identity()
    readable = re.sub(r"[^a-z0-9]+", "-", hostname.lower()).strip("-")[:40] or "host"
    digest = hashlib.sha256(f"{hostname}\0{machine}".encode()).hexdigest()[:10]
    return f"eyas-gpu-host-{readable}-{digest}"


def ensure_host_limit(cfg: PipelineConfig) -> str:
    """Create the host's limit (1 slot) if nobody has; an operator may have made it already."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    name = host_limit_name(cfg)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=1)
                )
            except ObjectAlreadyExists:
                pass
    return name


def this_machine() -> dict:
    """Where this process runs: what a holder record says, and what tells "the same machine" (same
    hostname, machine id and pid namespace: a container's pids are not its host's)."""

    def read(path: str) -> str:
        try:
            return Path(path).read_text().strip()
        except OSError:
            return ""

    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return {
        "hostname": socket.gethostname(),
        "machine": read("/etc/machine-id") or read("/var/lib/dbus/machine-id"),
        "boot": read("/proc/sys/kernel/random/boot_id"),
        "pidns": pidns,
    }


def holder_record(cfg: PipelineConfig) -> dict:
    """This process as a holder: its flow run, pid and start time, machine."""
    from prefect.runtime import flow_run

    me = LocalHost().process_identity(os.getpid())
    return {
        **this_machine(),
        "run": str(flow_run.id) if flow_run.id else None,
        "run_name": flow_run.name,
        "pid": os.getpid(),
        "start": me.start if me else None,
        "server_host": cfg.server.host.name,
        "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def dead_because(client, rec, here: dict) -> str | None:
    """Why the holder `rec` is provably dead, or None when it may be alive."""
    from prefect.exceptions import ObjectNotFound

    if not isinstance(rec, dict) or not isinstance(rec.get("pid"), int):
        return None  # not a record eyas wrote: only an operator can tell (prefect variable unset)
    if rec.get("run"):
        try:
            run = client.read_flow_run(rec["run"])
        except ObjectNotFound:
            return f"its flow run {rec['run']} no longer exists"
        if run.state is not None and run.state.is_final():
            return f"its flow run {run.name} is {run.state.name}"
    same = all(rec.get(k) == here[k] for k in ("hostname", "machine", "pidns"))
    if same and rec.get("boot") != here["boot"]:
        return f"{rec['hostname']} rebooted since it took the host"
    if same:
        found = LocalHost().process_identity(rec["pid"])
        if (
            found is None
            or found.start != rec.get("start")
            or (found.zombie and not LocalHost().is_alive(rec["pid"]))
        ):
            return f"its process (pid {rec['pid']} on {rec['hostname']}) is gone"
    return None


def _describe(rec) -> str:
    if not isinstance(rec, dict):
        return f"an unreadable record {rec!r}"
    run = (
        f"flow run {rec.get('run_name')} ({rec['run']})"
        if rec.get("run")
        else "a process outside any flow run"
    )
    return f"{run}, pid {rec.get('pid')} on {rec.get('hostname')}, since {rec.get('since')}"


def _delete(client, variable_id) -> bool:
    """Delete exactly this Variable (by id): False if it was gone already (another waiter won)."""
    import httpx

    try:
        client.request("DELETE", "/variables/{id}", path_params={"id": str(variable_id)})
        return True
    except httpx.HTTPStatusError as e:
        if e.response.status_code == 404:
            return False
        raise


def _take(client, name: str, me: dict, cfg: PipelineConfig, log):
    """Wait until this run holds the Variable `name`; returns its id."""
    from prefect.client.schemas.actions import VariableCreate
    from prefect.exceptions import ObjectAlreadyExists

    here, reported = this_machine(), None
    while True:
        try:
            return client.create_variable(VariableCreate(name=name, value=me)).id
        except ObjectAlreadyExists:
            pass
        held = client.read_variable_by_name(name)
        if held is None:
            continue  # released between the two calls
        why = dead_because(client, held.value, here)
        if why is not None:
            if _delete(client, held.id):
                log.warning(
                    "GPU host %s (%s): took it from %s: %s",
                    cfg.server.host.name,
                    name,
                    _describe(held.value),
                    why,
                )
            continue
        if reported is None or time.monotonic() - reported >= REPORT_EVERY_S:
            reported = time.monotonic()
            log.info(
                "waiting for GPU host %s (%s): held by %s. If that run is dead, set its state to "
                "Crashed or Cancelled in the UI (or `prefect variable unset %s` when it ran "
                "outside a flow run) and this run takes the host",
                cfg.server.host.name,
                name,
                _describe(held.value),
                name,
            )
        time.sleep(POLL_S)


def _logger():
    from prefect.logging import get_logger, get_run_logger

    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a run context
        return get_logger("eyas.flows")


@contextmanager
def gpu_host(cfg: PipelineConfig) -> Iterator[None]:
    """Own the server host while a server lives there: a second run waits, never doubles."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    name, log = ensure_host_limit(cfg), _logger()
    with get_client(sync_client=True) as client:
        mine = _take(client, name, holder_record(cfg), cfg, log)
        try:
            # Holding the Variable, no live run holds a slot: any taken one is a dead holder's.
            held = client.read_global_concurrency_limit_by_name(name).active_slots
            if held:
                client.update_global_concurrency_limit(
                    name, GlobalConcurrencyLimitUpdate(active_slots=0)
                )
                log.warning("gave back %d slot(s) of %s kept by a killed run", held, name)
            client.increment_concurrency_slots([name], 1, "concurrency")
        except BaseException:
            _delete(client, mine)
            raise
    since = time.monotonic()
    try:
        yield
    finally:
        try:
            with get_client(sync_client=True) as client:
                client.release_concurrency_slots([name], 1, time.monotonic() - since)
                _delete(client, mine)
        except Exception as e:  # noqa: BLE001 - the API is gone: the next run reclaims from a dead holder
            log.warning("could not give back GPU host %s (%s): %s", cfg.server.host.name, name, e)


def release_held_by(client, runs: set[str]) -> list[str]:
    """Give back every GPU host one of `runs` (flow run ids) holds: its Variable deleted, its slot
    released -> the limits' names. For a run that cannot do it itself (killed outright): the
    release flow (flows/release.py) calls this once the run is final."""
    freed = []
    for variable in client.read_variables():
        held = variable.value if isinstance(variable.value, dict) else {}
        if not variable.name.startswith("eyas-gpu-host-") or held.get("run") not in runs:
            continue
        if _delete(client, variable.id):
            client.release_concurrency_slots([variable.name], 1, _held_for(held))
            freed.append(variable.name)
    return freed


def _held_for(record: dict) -> float:
    """Seconds since a holder record's `since` (the slot's occupancy; Prefect takes > 0 only)."""
    try:
        since = datetime.strptime(record["since"], "%Y-%m-%dT%H:%M:%S%z").timestamp()
    except (KeyError, TypeError, ValueError):
        return 1.0
    return max(1.0, time.time() - since)
