"""A real `eyas run` of the embedded default, reduced and pointed at temp dirs, for process
tests."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from eyas.net import free_port

ROOT = Path(__file__).resolve().parents[1]


def small_data(tmp: Path, lines: int = 34) -> Path:
    data = tmp / "conversations.jsonl"
    text = (ROOT / "fixtures" / "data" / "conversations.jsonl").read_text().splitlines()[:lines]
    data.write_text("\n".join(text) + "\n")
    return data


def overrides(tmp: Path, data: Path, port: int | None = None, **extra) -> dict:
    return {
        "run_dir": tmp / "run",
        "server.port": port or free_port(),
        "server.workdir": tmp / "server",
        "server.dump_dir": tmp / "server" / "dump",
        "extraction.output_dir": tmp / "shards",
        "training.output_dir": tmp / "train",
        "data.path": data,
        "data.num_heldout": 2,
        "extraction.num_shards": 8,
        "extraction.concurrency": 2,
        "training.max_steps": 2,
        "training.batch_size": 2,
        "training.warmup_steps": 0,
        "evaluation.num_prompts": 1,
        "evaluation.max_new_tokens": 4,
        "sensor.poll_interval_s": 0.1,
        "benchmark.enabled": False,
        "data.regenerate.enabled": False,
        "server.dp_size": "null",
        **extra,
    }  # one replica


def command(verb: str, sets: dict) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "eyas_prefect.flows.runtime.cli",
        verb,
        str(ROOT / "configs" / "local-tiny.yaml"),
    ]  # the `eyas` script
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    return cmd


def env(tmp: Path, api_url: str | None) -> dict:
    """A clean Prefect environment: its own PREFECT_HOME; PREFECT_API_URL only if given."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    out.update(
        PREFECT_HOME=str(tmp / "prefect"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(ROOT),
    )
    if api_url:
        out["PREFECT_API_URL"] = api_url
    return out


def wait_for_server(tmp: Path, log: Path, proc, timeout: float = 240) -> dict:
    """The launch record once the run's server answered ready (the run's log says so)."""
    record, deadline = tmp / "server" / "server.pid", time.monotonic() + timeout
    while not (record.exists() and "server ready after" in log.read_text()):
        assert proc.poll() is None, f"the run ended ({proc.returncode}):\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, (
            f"no ready server within {timeout} s:\n{log.read_text()[-4000:]}"
        )
        time.sleep(0.1)
    text = record.read_text().strip()
    return json.loads(text) if text.startswith("{") else {"pid": int(text)}
