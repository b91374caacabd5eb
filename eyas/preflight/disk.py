"""The shard folder's read rate on the first training host, probed with the page cache dropped,
against what the planned training speed reads."""

from __future__ import annotations

import dataclasses
import json
import shlex
import sys
from pathlib import Path

from eyas.config import PipelineConfig
from eyas.plan import GB, Plan, on_gpu
from eyas.preflight.hosts import run_on
from eyas.remote import source

#: bytes the disk probe reads (a few hundred MB: past any disk's own cache, a second or so)
DISK_PROBE_BYTES = 256 << 20


def _probe(cfg: PipelineConfig, remote: bool, problems: list[str]):
    """Run the disk probe on the shard folder (its nearest existing parent) of the first training
    host -> (the command's result or None, the host's name)."""
    t = cfg.training
    hosts = t.distributed.hosts
    folder = Path(cfg.extraction.output_dir)
    if not remote:
        folder = existing_parent(folder)
    python = t.distributed.python or ("python3" if remote else sys.executable)
    # on a remote host the folder may not exist yet: probe its nearest existing parent there
    where = shlex.quote(str(folder))
    command = (
        f'd={where}; while [ ! -d "$d" ]; do d=$(dirname "$d"); done; '
        f'{shlex.quote(python)} -c {shlex.quote(source("disk_probe"))} "$d" {DISK_PROBE_BYTES}'
    )
    if remote:
        r = run_on(hosts[0], "training.distributed.hosts.0", command, problems)
        return r, hosts[0].hostname or hosts[0].name
    from eyas.server.hosts import LocalHost

    return LocalHost().run(command, check=False, timeout=120), "this machine"


def _slow_disk(cfg: PipelineConfig, plan: Plan, rate: float, name: str) -> str:
    """Why a folder reading `rate` bytes/s is too slow for the planned training, and what helps."""
    x, t = cfg.extraction, cfg.training
    return (
        f"extraction.output_dir={x.output_dir}: training reads "
        f"{plan.read_bytes_per_s / GB:,.2f} GB/s of shards "
        f"per node at plan.train_tokens_per_s={cfg.plan.train_tokens_per_s:g} x "
        f"{t.distributed.nproc_per_node} "
        f"process(es), but the folder read {rate / GB:,.2f} GB/s on {name} from disk: steps "
        f"would wait for data once the shards are not in the page cache. Use "
        f"extraction.encoding=fp8_e4m3 (half "
        f"the bytes), keep the shards in the page cache (host memory above their size), or "
        f"put them "
        f'on local NVMe (docs/training.md, "Reading the shards")'
    )


def check_disk_rate(
    cfg: PipelineConfig, plan: Plan, problems: list[str], notes: list[str], check: bool
) -> Plan:
    """The shard folder's read rate on the (first) training host against the plan's need
    (plan.read_bytes_per_s), per training.disk_check: "warn" a note, "refuse" a problem, "off" no
    probe."""
    t = cfg.training
    if plan.read_bytes_per_s is None:
        return plan
    if t.disk_check == "off":
        return dataclasses.replace(plan, disk_probe="not probed: training.disk_check=off")
    if not on_gpu(cfg):  # a CPU step reads a few MB/s
        return dataclasses.replace(plan, disk_probe="not probed: training on the CPU")
    hosts = t.distributed.hosts
    remote = bool(hosts) and hosts[0].kind == "ssh"
    if remote and not check:
        return dataclasses.replace(plan, disk_probe="not probed: host checks skipped")
    r, name = _probe(cfg, remote, problems)
    try:
        got = json.loads(r.stdout.strip().splitlines()[-1]) if r is not None and r.ok else None
    except (ValueError, IndexError):
        got = None
    if got is None:
        notes.append(
            f"extraction.output_dir={cfg.extraction.output_dir}: the disk probe failed on {name}"
            + (f" (exit {r.exit_code}: {r.stderr.strip()[-300:]})" if r is not None else "")
        )
        return dataclasses.replace(plan, disk_probe=f"probe failed on {name}")
    rate = float(got["bytes_per_s"])
    plan = dataclasses.replace(
        plan,
        disk_bytes_per_s=rate,
        disk_probe=(
            f"{got['bytes'] / 1e6:,.0f} MB of {'a temp file' if got['temp'] else got['file']} on "
            f"{name}, page cache dropped"
        ),
    )
    if rate < plan.read_bytes_per_s:
        (problems if t.disk_check == "refuse" else notes).append(
            _slow_disk(cfg, plan, rate, name)
            + ("" if t.disk_check == "refuse" else " (training.disk_check=warn)")
        )
    return plan


def existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
