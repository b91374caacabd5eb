"""Orchestration overhead: what Prefect costs per extraction shard, and what a fully cached re-run costs.

    .venv/bin/python bench/orchestration.py [--shards 500]

Runs the extract flow's shard fan-out (flows/extract.py: one task per shard submitted to a
2-thread runner, collected as they finish, one `eyas.shard.done` event each) over empty shards: the
task has extract_shard's Prefect options (run name, cache key function, persisted result, retries)
and a body that does no work, so the wall time is orchestration alone. Then the same flow again:
every shard is a cache hit. Prefect runs against a temporary local server (prefect_test_harness),
heartbeats off. Last line: {"bench": "orchestration", "figures": {...}, "goals": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=500)
    p.add_argument("--skip-pipeline", action="store_true",
                   help="skip the embedded default's first run and cached re-run (about 3 minutes)")
    args = p.parse_args()

    from prefect import flow, task
    from prefect.events import emit_event
    from prefect.futures import as_completed
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect.testing.utilities import prefect_test_harness

    storage = Path(tempfile.mkdtemp(prefix="eyas-bench-orch-"))

    @task(task_run_name="extract-shard-{i:05d}-of-{n:05d}@bench", persist_result=True,
          result_storage=storage, cache_key_fn=lambda ctx, params: f"{params['tag']}-{params['i']}",
          retries=2, retry_delay_seconds=[5, 30])
    def empty_shard(i: int, n: int, tag: str) -> dict:
        return {"file": f"shard-{i:05d}.safetensors", "num_tokens": 0}

    @flow(name="bench-extract", task_runner=ThreadPoolTaskRunner(max_workers=2))
    def fan_out(n: int, tag: str) -> int:
        futures = [empty_shard.submit(i, n, tag) for i in range(n)]
        for done, future in enumerate(as_completed(futures), 1):
            m = future.result()
            emit_event(event="eyas.shard.done", resource={"prefect.resource.id": "eyas.run.bench"},
                       payload={"file": m["file"], "done": done, "total": n})
        return len([f.result() for f in futures])

    with prefect_test_harness(server_startup_timeout=120):
        with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
            fan_out(2, "warm-up")  # imports, first connection
            tag = f"run-{time.time_ns()}"
            t0 = time.perf_counter()
            fan_out(args.shards, tag)
            first = time.perf_counter() - t0
            t0 = time.perf_counter()
            state = fan_out(args.shards, tag, return_state=True)
            cached = time.perf_counter() - t0
            assert state.is_completed()
            pipeline = None if args.skip_pipeline else _pipeline_twice(storage)

    per_shard = first / args.shards
    figures = {"shards": args.shards, "empty_first_run_s": round(first, 2),
               "per_shard_s": round(per_shard, 4), "empty_cached_rerun_s": round(cached, 2),
               "cpu_count": os.cpu_count()}
    goals = {"per_shard_s": {"value": round(per_shard, 4), "goal": "< 0.15", "met": per_shard < 0.15}}
    print(f"{args.shards} empty shards: {first:.1f} s ({per_shard * 1000:.0f} ms/shard); "
          f"all cached: {cached:.1f} s")
    if pipeline:
        figures.update(pipeline)
        r = pipeline["default_cached_over_first"]
        goals["default_cached_over_first"] = {"value": r, "goal": "< 0.10", "met": r < 0.10}
        print(f"embedded default: first run {pipeline['default_first_run_s']:.1f} s, cached re-run "
              f"{pipeline['default_cached_rerun_s']:.1f} s ({r:.1%}); stages {pipeline['default_rerun_stages']}")
    print(json.dumps({"bench": "orchestration", "figures": figures, "goals": goals}))


def _pipeline_twice(tmp: Path) -> dict:
    """The embedded default end to end, then again with the same inputs: extraction all cached
    (no server launched), training already at max_steps, evaluation and report redone."""
    import socket
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from flows.pipeline import eagle3_pipeline

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = {"run_dir": str(tmp / "run"), "server.port": port, "server.workdir": str(tmp / "server"),
                 "server.dump_dir": str(tmp / "server" / "dump"),
                 "extraction.output_dir": str(tmp / "shards"), "training.output_dir": str(tmp / "train")}
    t0 = time.perf_counter()
    eagle3_pipeline("configs/local-tiny.yaml", overrides)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = eagle3_pipeline("configs/local-tiny.yaml", overrides)
    again = time.perf_counter() - t0
    return {"default_first_run_s": round(first, 1), "default_cached_rerun_s": round(again, 1),
            "default_cached_over_first": round(again / first, 3),
            "default_rerun_stages": report["stages_seconds"]}


if __name__ == "__main__":
    main()
