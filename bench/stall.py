"""A stalled server under `eyas run`, frozen from outside: how long until the run fails, and what it
prints.

    python bench/stall.py                         # configs/local-tiny.yaml, stall_timeout_s=60
    python bench/stall.py --stall-timeout 30

Runs `eyas run` on the config (regeneration off, a fresh run directory) and, as soon as its first
shard file is on disk, freezes the target server's whole process group with SIGSTOP: the process
lives and holds its port, but answers nothing, as a wedged GPU server does. Measured: seconds from
the freeze until `eyas run` has exited, its exit code, its last line, the output lines at ERROR
that name the stall (one: the other shards in flight fail pointing at it) and the retry warnings
printed after it. The server is woken and killed afterwards whatever happened.

Goals (issue 37): with extraction.stall_timeout_s=60 the run fails within 70 s of the freeze, its
output has exactly one error naming the stall, its last line is `eyas: run Failed: failed at TASK:
... server stalled: ...`, and no retry warning follows the error. The last line printed is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MARGIN_S = 10  # issue 37: a 60 s stall timeout fails within 70 s
START_TIMEOUT_S = 600  # launch, load and the first shard


def overrides(base: Path, stall_timeout_s: float) -> dict:
    """A fresh run under base, regeneration off (the freeze should land in extraction), the stall
    timeout under test."""
    return {
        "run_dir": str(base / "run"),
        "server.workdir": str(base / "server"),
        "server.dump_dir": str(base / "server" / "dump"),
        "training.output_dir": str(base / "train"),
        "extraction.output_dir": str(base / "shards"),
        "data.regenerate.enabled": "false",
        "extraction.stall_timeout_s": str(stall_timeout_s),
    }


def first_shard(shards: Path, proc: subprocess.Popen) -> Path:
    """Wait for the first finished shard file (written by rename, so never partial)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        found = sorted(shards.glob("*.safetensors")) if shards.is_dir() else []
        if found:
            return found[0]
        if proc.poll() is not None:
            raise RuntimeError(f"eyas run exited {proc.returncode} before its first shard")
        time.sleep(0.1)
    raise RuntimeError(f"no shard after {START_TIMEOUT_S} s")


def server_group(pid_path: Path) -> int:
    """The server's process group: its launch record's pid leads a session of its own."""
    return os.getpgid(json.loads(pid_path.read_text())["pid"])


def count_lines(output: str) -> dict:
    """Errors that name the stall; retry warnings after the first of them; whether the run's last
    line is its failure naming the stall."""
    lines = output.splitlines()
    stall = [i for i, line in enumerate(lines) if "ERROR" in line and "stall" in line]
    after = lines[stall[0] + 1 :] if stall else []
    last = lines[-1] if lines else ""
    return {
        "stall_errors": len(stall),
        "retry_warnings_after": sum("WARNING" in line and "retry" in line for line in after),
        "exit_line_names_the_stall": last.startswith("eyas: run Failed: failed at ")
        and "server stalled: " in last,
        "stall_lines": [lines[i].strip()[:300] for i in stall],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(ROOT / "configs" / "local-tiny.yaml"))
    p.add_argument("--stall-timeout", type=float, default=60.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        sets = [
            a for k, v in overrides(base, args.stall_timeout).items() for a in ("--set", f"{k}={v}")
        ]
        log = base / "eyas-run.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "eyas_prefect.flows.runtime.cli", "run", args.config, *sets],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=ROOT,
            )
        group = None
        try:
            shard = first_shard(base / "shards", proc)
            group = server_group(base / "server" / "server.pid")
            os.killpg(group, signal.SIGSTOP)
            frozen = time.monotonic()
            rc = proc.wait(timeout=args.stall_timeout + 300)
            seconds = time.monotonic() - frozen
        finally:
            if proc.poll() is None:
                proc.kill()
            if group is not None:
                for sig in (signal.SIGCONT, signal.SIGKILL):
                    try:
                        os.killpg(group, sig)
                    except ProcessLookupError:
                        pass
        output = log.read_text(errors="replace")
    print(output, file=sys.stderr)  # the run's whole output, for the record
    counted = count_lines(output)
    goal_s = args.stall_timeout + MARGIN_S
    figures = {
        "stall_timeout_s": args.stall_timeout,
        "frozen_after_shard": shard.name,
        "seconds_freeze_to_exit": round(seconds, 1),
        "exit_code": rc,
        **counted,
        "last_lines": [line[:300] for line in output.splitlines()[-6:]],
    }
    print(
        json.dumps(
            {
                "bench": "stall",
                "figures": figures,
                "goals": {
                    "seconds_freeze_to_exit": {
                        "value": round(seconds, 1),
                        "goal": f"<= {goal_s:g}",
                        "met": seconds <= goal_s and rc != 0,
                    },
                    "stall_errors": {
                        "value": counted["stall_errors"],
                        "goal": "== 1",
                        "met": counted["stall_errors"] == 1,
                    },
                    "exit_line_names_the_stall": {
                        "value": counted["exit_line_names_the_stall"],
                        "goal": "true",
                        "met": counted["exit_line_names_the_stall"],
                    },
                    "retry_warnings_after": {
                        "value": counted["retry_warnings_after"],
                        "goal": "== 0",
                        "met": counted["retry_warnings_after"] == 0,
                    },
                },
            }
        )
    )


if __name__ == "__main__":
    main()
