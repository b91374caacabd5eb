"""Multi-process drafter training: torchrun on every node, launched through the Host seam.

    result = launch_training(cfg.training, cfg.target, shard_paths, log=print)   # blocks
    # what runs
    python -m torch.distributed.run --nproc-per-node 8 -m eyas.training.distributed JOB.json

`launch_training` writes a job file (the training and target config, the shard paths) into
`training.output_dir/launch/`, then starts one torchrun per node, detached, through `Host.start`:
node i on `training.distributed.hosts[i]` (this machine when the list is empty), node 0's hostname
as the rendezvous address. Every process runs this module's `main`, which sets its GPU, initialises
the process group (NCCL on GPUs, gloo on CPUs) and calls `train_drafter`; the ranks share each
global batch (eyas/training/train.py), under DDP or FSDP (`training.distributed.strategy`). Rank 0
writes the TrainResult to `launch/result.json` atomically, and every step's StepStats as a JSON line
to `launch/progress.jsonl`. The launcher follows node 0's log (into `log`) and that file (into
`on_step`, as train_drafter would call it), and once every node has exited returns the result, or
raises naming the node, its exit code and its log.

Shards, the target checkpoint and training.output_dir must be at the same paths on every training
host (a shared filesystem): the job file is copied to each host, nothing else is.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import eyas
from eyas.errors import EyasError


class TrainingLaunchError(EyasError, RuntimeError):
    """A node's torchrun failed or never finished; the message names the node, host and log."""


@dataclass
class _Launch:
    """One launch: node i's torchrun on hosts[i], node 0's host the rendezvous; the job file, each
    node's log and exit code, rank 0's progress and result in `folder` (training.output_dir/launch).
    """

    hosts: list
    local: bool  # every node on this machine: no job file to upload, no result to fetch
    nproc: int  # processes per node
    master: str  # node 0's address
    port: int
    python: str
    env: dict
    folder: Path

    @property
    def job(self) -> Path:
        return self.folder / "job.json"

    @property
    def result(self) -> Path:
        return self.folder / "result.json"

    @property
    def progress(self) -> Path:
        return self.folder / "progress.jsonl"

    def command(self, node: int, rc_path: Path) -> str:
        """Node `node`'s torchrun, its exit code written to rc_path."""
        run = (
            f"{shlex.quote(self.python)} -m torch.distributed.run --nnodes {len(self.hosts)} "
            f"--node-rank {node} --nproc-per-node {self.nproc} "
            f"--master-addr {shlex.quote(self.master)} --master-port {self.port} "
            f"-m eyas.training.distributed {shlex.quote(str(self.job))}"
        )
        return f"sh -c {shlex.quote(f'{run}; echo $? > {shlex.quote(str(rc_path))}')}"

    def start_node(self, i: int, log) -> tuple:
        """Node i's torchrun started on its host (its old log, rc and progress files removed first,
        the job file uploaded to a remote one) -> (host, pid, log path, rc path)."""
        host = self.hosts[i]
        log_path, rc_path = self.folder / f"node-{i}.log", self.folder / f"node-{i}.rc"
        host.run(
            f"rm -f {shlex.quote(str(rc_path))} {shlex.quote(str(log_path))}"
            + (f" {shlex.quote(str(self.progress))}" if i == 0 else ""),
            check=False,
        )
        if not self.local:
            host.put(self.job, self.job)
        pid = host.start(
            self.command(i, rc_path), log_path=log_path, env=self.env, cwd=str(self.folder)
        )
        log(
            f"[{host.name}] node {i}/{len(self.hosts)}: torchrun with {self.nproc} process(es), "
            f"pid {pid}, log {log_path}"
        )
        return host, pid, log_path, rc_path


def _make_hosts(d, made: contextlib.ExitStack) -> list:
    """training.distributed.hosts, each closed when `made` closes; this machine when none."""
    from eyas.server.hosts import LocalHost, make_host

    if not d.hosts:
        return [LocalHost()]
    return [
        made.enter_context(make_host(h, f"training.distributed.hosts[{i}]"))
        for i, h in enumerate(d.hosts)
    ]


def _launch(d, hosts: list, output_dir: str) -> _Launch:
    """training.distributed's launch on these hosts; a local one imports this checkout's eyas."""
    from eyas.server.hosts import LocalHost

    local = all(isinstance(h, LocalHost) for h in hosts)
    env = {"PYTHONPATH": str(Path(eyas.__file__).resolve().parents[1])} if local else {}
    env.update(d.env)
    return _Launch(
        hosts,
        local,
        d.nproc_per_node,
        "127.0.0.1" if local else (d.hosts[0].hostname or d.hosts[0].name),
        d.master_port,
        d.python or (sys.executable if local else "python3"),
        env,
        Path(output_dir) / "launch",
    )


def _write_job(launch: _Launch, cfg, target, shard_paths, target_config_json, stop_at_step) -> None:
    """The job file every process reads; the last launch's result removed."""
    from eyas.files import write_json_atomic

    write_json_atomic(
        launch.job,
        {
            "training": cfg.model_dump(mode="json"),
            "target": target.model_dump(mode="json"),
            "shards": [str(p) for p in shard_paths],
            "target_config_json": target_config_json,
            "result": str(launch.result),
            "progress": str(launch.progress),
            "stop_at_step": stop_at_step,
        },
    )
    if launch.result.exists():
        launch.result.unlink()


def launch_training(
    cfg,
    target,
    shard_paths: list[Path],
    *,
    target_config_json: dict | None = None,
    log: Callable[[str], None] = print,
    warn: Callable[[str], None] | None = None,
    poll_s: float = 1.0,
    hosts=None,
    stop_at_step: int | None = None,
    on_step: Callable | None = None,
):
    """Run train_drafter under torchrun on the configured hosts -> TrainResult (rank 0's).

    on_step gets rank 0's StepStats as they reach launch/progress.jsonl (up to poll_s late). warn
    (default: log) gets the damaged checkpoints rank 0 set aside, from its result."""
    d = cfg.distributed
    with (
        contextlib.ExitStack() as made
    ):  # hosts made here are closed at the end; passed-in ones are the caller's
        launch = _launch(d, hosts if hosts is not None else _make_hosts(d, made), cfg.output_dir)
        _write_job(launch, cfg, target, shard_paths, target_config_json, stop_at_step)
        nodes = []  # (host, pid, log path, rc path)
        try:
            for i in range(len(launch.hosts)):
                nodes.append(launch.start_node(i, log))
            _wait(nodes, d.timeout_s, poll_s, log, launch.progress, on_step)
        finally:
            for host, pid, _, _ in nodes:
                if host.is_alive(pid):
                    host.kill_group(pid)
        for i, node in enumerate(nodes):
            _check_exit(i, *node)
        result = _fetch_result(launch, nodes[0][2])
    for q in result.quarantined:
        (warn or log)(
            f"checkpoint {q['checkpoint']} is damaged: {q['why']}; moved to {q['moved_to']}, "
            f"resumed from the newest intact one"
        )
    return result


def _fetch_result(launch: _Launch, log0: Path):
    """Rank 0's TrainResult, fetched from node 0's host when that is another machine."""
    from eyas.server.hosts import HostError
    from eyas.training.train import TrainResult

    if not launch.local:  # rank 0 wrote it on node 0's host
        try:
            launch.hosts[0].get(launch.result, launch.result)
        except (OSError, HostError):
            pass
    if not launch.result.exists():
        raise TrainingLaunchError(
            f"every node exited 0 but rank 0 wrote no {launch.result}; see {log0}"
        )
    return TrainResult(**json.loads(launch.result.read_text()))


def _check_exit(i: int, host, pid: int, log_path: Path, rc_path: Path) -> None:
    """Node i's torchrun exited 0, or TrainingLaunchError with its log's last lines."""
    rc_text, _ = host.read_from(rc_path, 0)
    rc = int(rc_text.decode().strip() or -1) if rc_text else None
    if rc != 0:
        tail = host.read_from(log_path, 0, 1 << 24)[0].decode(errors="replace")[-3000:]
        raise TrainingLaunchError(
            f"[{host.name}] training node {i}: torchrun exited "
            f"{'without an exit code' if rc is None else rc}; see {log_path}\n{tail}"
        )


class _Tail:
    """The complete lines a file on a host gained since the last call."""

    def __init__(self, host, path: Path):
        self.host, self.path, self.offset, self.partial = host, path, 0, b""

    def lines(self) -> list[str]:
        data = b""
        for _ in range(64):  # read_from returns at most 1 MiB a call
            chunk, self.offset = self.host.read_from(self.path, self.offset)
            data += chunk
            if not chunk:
                break
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [line.decode(errors="replace") for line in lines]


def _wait(nodes, timeout_s: float, poll_s: float, log, progress: Path, on_step) -> None:
    """Until every node has exited; node 0's log lines go to `log`, rank 0's steps to `on_step`."""
    from eyas.training.progress import StepStats

    host0, _, log0, _ = nodes[0]
    deadline, logs, steps = time.monotonic() + timeout_s, _Tail(host0, log0), _Tail(host0, progress)
    running = True
    while running:
        running = any(h.is_alive(pid) for h, pid, _, _ in nodes)  # then one last read after the end
        if time.monotonic() > deadline:
            raise TrainingLaunchError(
                f"training did not finish within {timeout_s:.0f}s; see {log0}"
            )
        for line in logs.lines():
            log(line)
        for line in steps.lines() if on_step is not None else []:
            try:
                stats = StepStats.from_json(json.loads(line))
            except (ValueError, TypeError):  # progress is a view: a line it cannot read is skipped
                continue
            on_step(stats)
        if running:
            time.sleep(poll_s)


def main(argv: list[str] | None = None) -> None:
    """One torchrun process: set the device, join the group, train, rank 0 writes the result."""
    from eyas.config import TargetConfig, TrainingConfig
    from eyas.files import write_json_atomic
    from eyas.training.train import train_drafter

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit(
            "usage: python -m torch.distributed.run ... -m eyas.training.distributed JOB.json"
        )
    job = json.loads(Path(args[0]).read_text())
    cfg, target = (
        TrainingConfig.model_validate(job["training"]),
        TargetConfig.model_validate(job["target"]),
    )
    gpu = cfg.device != "cpu" and torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if gpu else "gloo")
    progress = job.get("progress")

    def on_step(stats) -> None:  # rank 0 only (train_drafter's rule): one JSON line per step
        with open(progress, "a") as f:
            f.write(json.dumps(stats.to_json()) + "\n")

    try:
        result = train_drafter(
            cfg,
            target,
            [Path(p) for p in job["shards"]],
            target_config_json=job.get("target_config_json"),
            log=lambda m: print(m, flush=True),
            stop_at_step=job.get("stop_at_step"),
            on_step=on_step if progress else None,
        )
        if dist.get_rank() == 0:
            write_json_atomic(job["result"], asdict(result))
        dist.barrier()  # every rank is done before any tears the group down
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # After a clean run gloo's threads can abort the interpreter's own teardown ("terminate called
    # without an active exception", seen under load); all output is written, so leave directly.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
