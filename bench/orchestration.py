"""Orchestration overhead: what Prefect costs per extraction shard, and what a fully cached re-run
costs.

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
    p.add_argument(
        "--skip-pipeline",
        action="store_true",
        help="skip the embedded default's first run and cached re-run (about 3 minutes)",
    )
    p.add_argument(
        "--scale-shards",
        type=int,
        default=1000,
        help="the production-scale bookkeeping simulation: shards (0 skips it)",
    )
    p.add_argument("--scale-sequences", type=int, default=10000, help="... and sequences over them")
    p.add_argument(
        "--scale-only", action="store_true", help="only the scale simulation (no Prefect runs)"
    )
    args = p.parse_args()
    if args.scale_only:
        sc = scale_bookkeeping(args.scale_shards, args.scale_sequences, PREFECT_PER_SHARD_CITED_S)
        print(
            json.dumps(
                {"bench": "orchestration", "figures": {"scale": sc}, "goals": scale_goals(sc)}
            )
        )
        return

    from prefect import flow, task
    from prefect.events import emit_event
    from prefect.futures import as_completed
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect.testing.utilities import prefect_test_harness

    storage = Path(tempfile.mkdtemp(prefix="eyas-bench-orch-"))

    @task(
        task_run_name="extract-shard-{i:05d}-of-{n:05d}@bench",
        persist_result=True,
        result_storage=storage,
        cache_key_fn=lambda ctx, params: f"{params['tag']}-{params['i']}",
        retries=2,
        retry_delay_seconds=[5, 30],
    )
    def empty_shard(i: int, n: int, tag: str) -> dict:
        return {"file": f"shard-{i:05d}.safetensors", "num_tokens": 0}

    @flow(name="bench-extract", task_runner=ThreadPoolTaskRunner(max_workers=2))
    def fan_out(n: int, tag: str) -> int:
        futures = [empty_shard.submit(i, n, tag) for i in range(n)]
        for done, future in enumerate(as_completed(futures), 1):
            m = future.result()
            emit_event(
                event="eyas.shard.done",
                resource={"prefect.resource.id": "eyas.run.bench"},
                payload={"file": m["file"], "done": done, "total": n},
            )
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
    scale = (
        scale_bookkeeping(args.scale_shards, args.scale_sequences, per_shard)
        if args.scale_shards
        else None
    )
    figures = {
        "shards": args.shards,
        "empty_first_run_s": round(first, 2),
        "per_shard_s": round(per_shard, 4),
        "empty_cached_rerun_s": round(cached, 2),
        "cpu_count": os.cpu_count(),
    }
    goals = {
        "per_shard_s": {"value": round(per_shard, 4), "goal": "< 0.15", "met": per_shard < 0.15}
    }
    if scale:
        figures["scale"] = scale
        goals.update(scale_goals(scale))
    print(
        f"{args.shards} empty shards: {first:.1f} s ({per_shard * 1000:.0f} ms/shard); "
        f"all cached: {cached:.1f} s"
    )
    if pipeline:
        figures.update(pipeline)
        r = pipeline["default_cached_over_first"]
        goals["default_cached_over_first"] = {"value": r, "goal": "< 0.10", "met": r < 0.10}
        print(
            f"embedded default: first run {pipeline['default_first_run_s']:.1f} s, cached re-run "
            f"{pipeline['default_cached_rerun_s']:.1f} s ({r:.1%}); stages "
            f"{pipeline['default_rerun_stages']}"
        )
    print(json.dumps({"bench": "orchestration", "figures": figures, "goals": goals}))


# ----------------------------------------------------------------------------- the production scale

PREFECT_PER_SHARD_CITED_S = (
    0.009  # docs/performance.md "Orchestration": 500 empty shards, 9 ms per shard
)
PRODUCTION_TOKENS = 17.3e6  # Kimi-K2.5 run: 10,000 conversations (docs/production.md)
# The production run's expected wall time, seconds (docs/performance.md "At production scale"
# derives each term): server load 600 + extraction 17.3M / 15,000 tokens/s + training 10 epochs of
# 17.3M tokens on 8 H200 at 13,600 tokens/s each + serve-bench (two launches of ~600 s load + ~30 s
# of decoding).
PRODUCTION_RUN_S = 600 + PRODUCTION_TOKENS / 15000 + 10 * PRODUCTION_TOKENS / (8 * 13600) + 2 * 630


def scale_bookkeeping(num_shards: int, num_sequences: int, prefect_per_shard_s: float) -> dict:
    """The extract flow's own bookkeeping at production scale, without a GPU or a server.

    Real eyas code on synthetic data: write_shard_plans over `num_sequences` sequences of the
    production mean length (17.3M / 10,000 = 1,730 tokens; id lists shared to keep memory small, the
    JSON and sha256 work is the real size); tiny shard files (1 token per sequence, H = 8, written
    by eyas's ShardWriter with the real cache key); the cache-key check of every intact shard
    (sha256 of the file, 8 threads, as stage.check_shards), twice; an
    ExtractionRun fed per shard (started, one progress update per sequence, done) through the real
    ExtractionPublisher with Prefect's artifact calls replaced by counters (the writes are counted,
    not sent); dataset.json at the end. Prefect's own per-task cost is added from the fan-out
    measured above (or cited).
    """
    import random
    import shutil
    import sys
    from concurrent.futures import ThreadPoolExecutor

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import eyas_prefect.tasks.progress as tp
    import torch

    from eyas.extraction.data import TokenizedSample, write_shard_plans
    from eyas.extraction.extract import check_shard, shard_cache_key, shard_path
    from eyas.extraction.progress import ExtractionRun
    from eyas.extraction.shards import Sample, write_shard

    writes = {"progress_create": 0, "progress_update": 0, "table": 0}
    tp.create_progress_artifact = lambda **k: (
        writes.__setitem__("progress_create", writes["progress_create"] + 1) or "id"
    )
    tp.update_progress_artifact = lambda **k: writes.__setitem__(
        "progress_update", writes["progress_update"] + 1
    )
    tp.create_table_artifact = lambda **k: writes.__setitem__("table", writes["table"] + 1)

    root = Path(tempfile.mkdtemp(prefix="eyas-bench-scale-"))
    rng = random.Random(0)
    mean = int(PRODUCTION_TOKENS / 10000)
    pool = []
    for _ in range(64):  # 64 distinct sequences, reused: the plan files' bytes are the real size
        n = rng.randint(mean // 2, mean * 3 // 2)
        first = rng.randint(n // 5, n // 2)
        pool.append(
            TokenizedSample(
                [rng.randrange(163840) for _ in range(n)], [0] * first + [1] * (n - first)
            )
        )
    samples = [pool[i % len(pool)] for i in range(num_sequences)]
    tokens = sum(len(s.input_ids) for s in samples)
    out: dict = {"shards": num_shards, "sequences": num_sequences, "plan_tokens": tokens}
    try:
        t0 = time.perf_counter()
        plans = write_shard_plans(samples, num_shards, root / "plans", {"provenance": {}})
        out["plan_write_s"] = round(time.perf_counter() - t0, 3)
        out["plan_mb"] = round(sum(p.path.stat().st_size for p in plans) / 1e6, 1)

        keys = {
            p.name: shard_cache_key(
                p,
                target_checkpoint="/models/Kimi-K2.5",
                target_revision=None,
                capture_ids=[2, 30, 58],
                dtype="bfloat16",
                patch_version="eyas-sglang-0.5.23-r2",
            )
            for p in plans
        }
        t0 = time.perf_counter()
        manifests = {}
        for p in plans:  # stand-ins for the GPU's work: 1 token per sequence
            ss = [
                Sample(
                    torch.tensor([1]),
                    torch.tensor([True]),
                    torch.zeros(1, 24, dtype=torch.bfloat16),
                    torch.zeros(1, 8, dtype=torch.bfloat16),
                )
                for _ in range(p.num_sequences)
            ]
            manifests[p.name] = write_shard(
                shard_path(root / "shards", p),
                ss,
                {"cache_key": keys[p.name], "content_hash": p.content_hash},
            )
        out["tiny_shards_write_s_not_overhead"] = round(time.perf_counter() - t0, 2)

        def check_all() -> float:
            t = time.perf_counter()
            with ThreadPoolExecutor(8) as ex:
                ok = list(
                    ex.map(
                        lambda p: check_shard(root / "shards", p, keys[p.name]).intact,
                        plans,
                    )
                )
            assert all(ok), "a tiny shard failed its check"
            return time.perf_counter() - t

        out["cache_check_first_s"] = round(check_all(), 3)
        out["cache_check_remembered_s"] = round(check_all(), 3)

        t0 = time.perf_counter()
        run = ExtractionRun(
            root / "shards",
            plans,
            plan_info={"provenance": {}},
            on_change=tp.ExtractionPublisher("bench-scale"),
        )
        for p in plans:
            run.shard_started(p.name)
            for k in range(1, p.num_sequences + 1):
                run.shard_progress(p.name, k * mean, k * mean * 57349, k)
            run.shard_done(p, manifests[p.name], reused=False)
        out["progress_and_dataset_s"] = round(time.perf_counter() - t0, 3)
        assert run.dataset is not None and run.dataset["num_shards"] == num_shards
        out["dataset_json_kb"] = round((root / "shards" / "dataset.json").stat().st_size / 1e3, 1)
        out["artifact_writes"] = dict(writes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    own = out["plan_write_s"] + out["cache_check_first_s"] + out["progress_and_dataset_s"]
    out["prefect_per_shard_s"] = round(prefect_per_shard_s, 4)
    out["bookkeeping_s"] = round(own, 3)
    total = own + num_shards * prefect_per_shard_s
    out["overhead_s"] = round(total, 2)
    out["overhead_per_shard_ms"] = round(1e3 * total / num_shards, 2)
    out["production_run_s"] = round(PRODUCTION_RUN_S)
    out["overhead_share_of_run"] = round(total / PRODUCTION_RUN_S, 5)
    print(
        f"scale: {num_shards} shards, {num_sequences} sequences ({tokens / 1e6:.1f}M plan tokens, "
        f"{out['plan_mb']} MB of plans): plans {out['plan_write_s']} s, cache check "
        f"{out['cache_check_first_s']} s "
        f"(remembered {out['cache_check_remembered_s']} s), progress + dataset.json "
        f"{out['progress_and_dataset_s']} s, "
        f"Prefect {num_shards * prefect_per_shard_s:.1f} s: {out['overhead_per_shard_ms']} "
        f"ms/shard, "
        f"{out['overhead_share_of_run']:.3%} of a {PRODUCTION_RUN_S / 3600:.2f} h run; artifact "
        f"writes {writes}"
    )
    return out


def scale_goals(sc: dict) -> dict:
    v = sc["overhead_share_of_run"]
    return {"scale_overhead_share_of_run": {"value": v, "goal": "< 0.01", "met": v < 0.01}}


def _pipeline_twice(tmp: Path) -> dict:
    """The embedded default end to end, then again with the same inputs: extraction all cached
    (no server launched), training already at max_steps, evaluation and report redone."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from eyas_prefect.flows.pipeline import eagle3_pipeline

    from eyas.net import free_port

    overrides = {
        "run_dir": str(tmp / "run"),
        "server.port": free_port(),
        "server.workdir": str(tmp / "server"),
        "server.dump_dir": str(tmp / "server" / "dump"),
        "extraction.output_dir": str(tmp / "shards"),
        "training.output_dir": str(tmp / "train"),
    }
    t0 = time.perf_counter()
    eagle3_pipeline("configs/local-tiny.yaml", overrides)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = eagle3_pipeline("configs/local-tiny.yaml", overrides)
    again = time.perf_counter() - t0
    return {
        "default_first_run_s": round(first, 1),
        "default_cached_rerun_s": round(again, 1),
        "default_cached_over_first": round(again / first, 3),
        "default_rerun_stages": report["stages_seconds"],
    }


if __name__ == "__main__":
    main()
