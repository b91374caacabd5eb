"""server.dump_dir on the server host: room for the dump records extraction keeps there at once,
and whether this machine reads them in place or through SSH."""

from __future__ import annotations

import re
import shlex

from eyas.config import PipelineConfig
from eyas.plan import GB
from eyas.preflight.hosts import run_on

#: shards the extract flow works on at once (flows/extract.py, ThreadPoolTaskRunner(max_workers=2)):
#: each keeps up to extraction.collect_workers answered sequences' dump records while writing them
SHARDS_AT_ONCE = 2
#: bytes per element of each extraction.dtype (the dump records' dtype)
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
#: prints the nearest existing folder at or above the path, then its filesystem's `df -P` row
_DF_SCRIPT = (
    'p={path}; while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done; '
    'printf "%s\\n" "$p"; df -Pk "$p" | tail -n 1'
)
_DF_ROW = re.compile(r"\s(\d+)\s+(\d+)\s+(\d+)\s+\d+%\s")  # 1024-blocks, used, available, capacity


def dump_bytes_needed(cfg: PipelineConfig, hidden_size: int) -> tuple[int, int, int]:
    """(bytes, sequences, bytes per token): the most dump records server.dump_dir holds at once
    during extraction. Every sequence in flight (extraction.concurrency) writes one record per
    prefill chunk, and an answered one keeps them until its shard has written it
    (extraction.collect_workers per shard, SHARDS_AT_ONCE shards); each record holds the aux layers
    and the last hidden state in extraction.dtype plus an int32 id per token (eyas/dump.py): ~235 MB
    for 4,096 tokens at H=7168."""
    x = cfg.extraction
    per_token = (len(cfg.target.layer_ids) + 1) * hidden_size * _ITEMSIZE[x.dtype] + 4
    sequences = x.concurrency + SHARDS_AT_ONCE * x.collect_workers
    return sequences * cfg.data.max_length * per_token, sequences, per_token


def check_dump_dir(
    cfg: PipelineConfig, tcfg: dict, problems: list[str], notes: list[str], check: bool
) -> None:
    """server.dump_dir's filesystem on the server host against dump_bytes_needed."""
    s, x = cfg.server, cfg.extraction
    if s.host.kind == "ssh" and not check:
        notes.append(
            f"server.dump_dir={s.dump_dir}: free space on {s.host.hostname} not checked "
            f"(check_hosts=False)"
        )
        return
    hidden = int(tcfg["hidden_size"])
    need, sequences, per_token = dump_bytes_needed(cfg, hidden)
    unreached: list[str] = []
    r = run_on(
        s.host, "server.host", _DF_SCRIPT.format(path=shlex.quote(str(s.dump_dir))), unreached
    )
    if r is None:  # an SSH host's version check has reported the same failure already
        problems += unreached if s.host.kind != "ssh" else []
        return
    lines = r.stdout.strip().splitlines()
    row = _DF_ROW.search(f" {lines[-1]} ") if r.ok and len(lines) >= 2 else None
    if row is None:
        notes.append(
            f"server.dump_dir={s.dump_dir}: its free space could not be read on {s.host.name} "
            f"(df -Pk, exit {r.exit_code}: {(r.stderr or r.stdout).strip()[-200:]})"
        )
        return
    folder, size, free = lines[0], int(row[1]) * 1024, int(row[3]) * 1024
    if free >= need:
        return
    why = (
        f"server.dump_dir={s.dump_dir}: {folder} on {s.host.name} has {free:,} bytes "
        f"({free / GB:,.2f} GB) free "
        f"of {size / GB:,.2f} GB, but extraction keeps up to {need:,} bytes ({need / GB:,.2f} "
        f"GB) of dump records "
        f"there: {sequences} sequences (extraction.concurrency={x.concurrency} + "
        f"{SHARDS_AT_ONCE} shards x extraction.collect_workers={x.collect_workers}) of up to "
        f"data.max_length={cfg.data.max_length} tokens "
        f"x {per_token:,} B per token ({len(cfg.target.layer_ids)} aux layers + the last, "
        f"hidden {hidden}, extraction.dtype={x.dtype}); "
    )
    if size < need:
        why += (
            "the filesystem itself is smaller than that (a container's /dev/shm is 64 MB "
            "unless it was started "
            "with --shm-size): enlarge it (docker run --shm-size, or mount -o remount,size=... "
            "on the host), point server.dump_dir at a larger tmpfs, or lower extraction.concurrency"
        )
    else:
        why += "free space there (an earlier run's dump folders?) or lower extraction.concurrency"
    problems.append(why)


# ----------------------------------------------------------------------------- disk and memory


def check_dump_route(
    cfg: PipelineConfig, tcfg: dict | None, problems: list[str], notes: list[str]
) -> None:
    """How extraction will read server.dump_dir's records from this machine: a probe file written
    through the SSH host, looked for here (eyas/extraction/records.py, the collector's own
    probe)."""
    from eyas.extraction.records import probe_visible
    from eyas.server.hosts import HostError, make_host

    s = cfg.server
    try:
        with make_host(s.host) as host:
            visible, folder = probe_visible(host, s.dump_dir)
    except HostError as e:
        problems.append(
            f"server.dump_dir={s.dump_dir}: cannot write a file in it (or its nearest existing "
            f"folder) on {s.host.name}: {e}"
        )
        return
    if visible:
        notes.append(
            f"server.dump_dir={s.dump_dir}: {folder} on {s.host.name} is the same folder here: "
            f"extraction reads the dump records on this machine"
        )
        return
    rate = ""
    if tcfg is not None:
        per_token = dump_bytes_needed(cfg, int(tcfg["hidden_size"]))[2]
        rate = (
            f"; plan.prefill_tokens_per_s={cfg.plan.prefill_tokens_per_s:g} makes "
            f"{per_token * cfg.plan.prefill_tokens_per_s / 1e6:,.0f} MB/s of records per server"
        )
    notes.append(
        f"server.dump_dir={s.dump_dir}: not visible on this machine, so extraction reads the dump "
        f"records through SSH from {s.host.name} (100-180 MB/s per connection on loopback, "
        f"{cfg.extraction.collect_workers + 1} connections{rate}); a Prefect worker on "
        f"the node reads them at file speed (docs/production.md)"
    )
