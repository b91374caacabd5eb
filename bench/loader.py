"""CPU benchmark of the training data path alone at Kimi-K2.5 size (docs/performance.md, "The data
path").

    python bench/loader.py --out .perf/loader            # shards in a temp folder beside --out
    python bench/loader.py --tiny                        # a smoke run (tests)

Writes shards with eyas's own ShardWriter (H 7168, 3 aux layers, sequences of 4096 tokens, random
states with per-token norms spread over decades, prompt masks of --prompt-fraction), bf16 and FP8,
then times, per encoding:

- `sync_collate`: the synchronous path, collate([data.sample(i) ...]) (what the step did before the
loader);
- `worker`: one loader worker's host work for a GPU run (eyas/training/loader.py
BatchLoader.host_batch:
  read each sample's rows straight into the batch's buffer; FP8 stays FP8), warm (page cache) and
  cold (each file's pages dropped first): GB/s read and batches/s;
- `worker_reused_buffers`: the same into buffers used before (a GPU run's page-locked buffers come
  back from CUDA's caching host allocator, already mapped; fresh memory costs a page fault per 4
  KB);
- `workers_N`: N threads at once over distinct batches, warm, reused buffers: batches/s (the
  machine's cores and memory bandwidth bound it);
- `disk_probe`: eyas's preflight probe (disk_read_rate) on one shard.

GB/s count the bytes a micro-batch needs (states, ids, mask). A GPU step needs a micro-batch every
step_s, so workers >= (bytes per batch / step_s) / per-worker GB/s. Needs torch and safetensors.
The last line is one JSON object {"bench": "loader", "figures": {...}, "goals": {...}}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench import masks  # noqa: E402  (numpy only)
from bench.disk import disk_read_rate, drop_cache  # noqa: E402
from eyas.extraction.shards import ShardWriter  # noqa: E402
from eyas.training.batches import ShardData, collate  # noqa: E402
from eyas.training.loader import BatchLoader  # noqa: E402

KIMI = dict(hidden_size=7168, num_aux=3, seq=4096)
TINY = dict(hidden_size=64, num_aux=3, seq=64)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_shards(
    folder: Path,
    sequences: int,
    *,
    hidden_size: int,
    num_aux: int,
    seq: int,
    encoding: str,
    per_shard: int = 8,
    prompt_fraction: float = 0.3,
    seed: int = 0,
    device: str = "cpu",
    vocab: int = 163840,
) -> list[Path]:
    """Shards of random states (bf16; each token's norm drawn over four decades, as a residual
    stream's vary) and chat-shaped masks (a leading prompt of prompt_fraction unscored), written by
    ShardWriter with a thread per sample. device: where the random states are drawn (a GPU draws
    them faster)."""
    folder.mkdir(parents=True, exist_ok=True)
    H, K, T = hidden_size, num_aux, seq
    mask = torch.from_numpy(masks.prefix_masks(1, T, prompt_fraction))[0]
    meta = {
        "layer_ids": [1, 29, 57],
        "layer_convention": "capture-before",
        "capture_ids": [1, 29, 57],
        "last_hidden_norm": "post",
        "content_hash": f"bench-{seed}-{sequences}-{encoding}",
    }
    paths, done = [], 0
    while done < sequences:
        n = min(per_shard, sequences - done)
        path = folder / f"shard-{len(paths):05d}.safetensors"
        w = ShardWriter(
            path,
            [T] * n,
            hidden_size=H,
            num_aux=K,
            dtype=torch.bfloat16,
            meta=meta,
            encoding=encoding,
        )

        def put(i, base=done):
            g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + base + i)
            norm = torch.logspace(-1, 3, T, device=device)[
                torch.randperm(T, generator=g, device=device)
            ]
            aux = (
                (torch.randn(T, K * H, generator=g, device=device) * norm[:, None])
                .to(torch.bfloat16)
                .cpu()
            )
            last = (
                (torch.randn(T, H, generator=g, device=device) * norm[:, None])
                .to(torch.bfloat16)
                .cpu()
            )
            ids = torch.randint(0, vocab, (T,), generator=g, device=device).cpu()
            w.put_rows(i, 0, ids, mask, aux, last)

        with ThreadPoolExecutor(min(n, os.cpu_count() or 1)) as pool:
            list(pool.map(put, range(n)))
        w.close()
        paths.append(path)
        done += n
    return paths


def batch_bytes(data: ShardData, ids: list[int]) -> int:
    """Bytes a micro-batch reads: its rows of every tensor (states as stored, ids, mask)."""
    return sum(data.lengths[i] for i in ids) * _bytes_per_token(data)


def _bytes_per_token(data: ShardData) -> int:
    from eyas.extraction.shards import bytes_per_token

    r = data.readers[0]
    return bytes_per_token(data.hidden_size, data.num_aux, "bfloat16", r.encoding)


def timed(fn, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_encoding(paths: list[Path], B: int, repeat: int, workers: list[int]) -> dict:
    data = ShardData(paths, num_validation=0)
    n = len(data.lengths)
    batches = [list(range(s, s + B)) for s in range(0, n - B + 1, B)]
    nbytes = batch_bytes(data, batches[0])
    loader = BatchLoader(data, [], "cpu", torch.bfloat16, workers=0)
    loader.cuda = (
        True  # the GPU path's host work: the states stay as stored (FP8 as FP8), unpinned here
    )
    out: dict = {"batch": B, "batch_bytes": nbytes, "sequences": n}
    k = [0]

    def next_batch():
        b = batches[k[0] % len(batches)]
        k[0] += 1
        return b

    def cold(fn):
        def run():
            for p in paths:
                drop_cache(p)
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0

        return run

    one = lambda: loader.host_batch(next_batch())  # noqa: E731
    cache = threading.local()

    def reused(
        shape, dtype, pin_memory=False
    ):  # as CUDA's caching host allocator hands a freed block back
        key = (tuple(shape), dtype)
        bufs = cache.__dict__.setdefault("bufs", {})
        if key not in bufs:
            bufs[key] = torch.zeros(shape, dtype=dtype)
        return bufs[key]

    def one_reused():
        loader.empty = reused
        try:
            loader.host_batch(next_batch())
        finally:
            loader.empty = torch.empty

    sync = lambda: collate([data.sample(i) for i in next_batch()], "cpu", torch.bfloat16)  # noqa: E731
    for name, fn in (
        ("sync_collate", sync),
        ("worker", one),
        ("worker_reused_buffers", one_reused),
    ):
        fn()  # warm: every page read once
        warm = statistics.median(timed(fn, repeat))
        c = statistics.median([cold(fn)() for _ in range(max(2, repeat // 2))])
        out[name] = {
            "warm_s": round(warm, 4),
            "warm_gb_s": round(nbytes / warm / 1e9, 3),
            "warm_batches_s": round(1 / warm, 3),
            "cold_s": round(c, 4),
            "cold_gb_s": round(nbytes / c / 1e9, 3),
            "cold_batches_s": round(1 / c, 3),
        }
        log(
            f"{paths[0].parent.name} {name}: warm {warm:.3f} s/batch ({nbytes / warm / 1e9:.2f} "
            f"GB/s), cold {c:.3f} s ({nbytes / c / 1e9:.2f} GB/s)"
        )
    for w in workers:
        jobs = [next_batch() for _ in range(w * repeat)]
        t0 = time.perf_counter()
        loader.empty = reused  # the GPU path: pinned buffers come back from the allocator's cache
        with ThreadPoolExecutor(w) as pool:
            list(pool.map(loader.host_batch, jobs))
        loader.empty = torch.empty
        s = time.perf_counter() - t0
        out[f"workers_{w}"] = {
            "batches_s": round(len(jobs) / s, 3),
            "gb_s": round(len(jobs) * nbytes / s / 1e9, 3),
        }
        log(
            f"{paths[0].parent.name} {w} worker(s): {len(jobs) / s:.2f} batches/s "
            f"({len(jobs) * nbytes / s / 1e9:.2f} GB/s)"
        )
    rate, nread = disk_read_rate(paths[0], 256 << 20)
    out["disk_probe"] = {"gb_s": round(rate / 1e9, 3), "bytes": nread}
    log(f"{paths[0].parent.name} disk probe: {rate / 1e9:.2f} GB/s over {nread / 1e6:.0f} MB")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes (a smoke run)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument(
        "--sequences", type=int, default=8, help="sequences per encoding (8 = 1.88 GB in bf16)"
    )
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--workers", type=int, nargs="*", default=[1, 2])
    ap.add_argument(
        "--encodings", nargs="+", default=["plain", "fp8_e4m3"], choices=["plain", "fp8_e4m3"]
    )
    ap.add_argument(
        "--dir", default=None, help="where to write the shards (default: a temp folder)"
    )
    ap.add_argument("--out", default=None, help="folder for bench_loader.json")
    args = ap.parse_args()
    size = TINY if args.tiny else KIMI
    threads = torch.get_num_threads()
    root = Path(tempfile.mkdtemp(prefix="eyas-bench-loader-", dir=args.dir))
    figures: dict = {
        "size": size,
        "cpus": os.cpu_count(),
        "torch_threads": threads,
        "torch": torch.__version__,
        "threads_per_worker": 1,
    }
    try:
        for enc in args.encodings:
            t0 = time.perf_counter()
            paths = write_shards(root / enc, args.sequences, encoding=enc, **size)
            log(
                f"wrote {args.sequences} sequences ({enc}) in {time.perf_counter() - t0:.1f}s: "
                f"{sum(p.stat().st_size for p in paths) / 1e9:.2f} GB"
            )
            torch.set_num_threads(1)  # a worker is one thread
            figures[enc] = bench_encoding(paths, args.batch, args.repeat, args.workers)
            torch.set_num_threads(threads)
            shutil.rmtree(root / enc)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    goals = {}
    if "plain" in figures and not args.tiny:
        # one worker feeds the H200's batch-4 step (0.78 s at prompt 0.3) from the page cache
        v = figures["plain"]["worker"]["warm_s"]
        goals["one_worker_feeds_b4_step"] = {"value": v, "goal": "<= 0.78", "met": v <= 0.78}
    line = {"bench": "loader", "figures": figures, "goals": goals}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "bench_loader.json").write_text(json.dumps(line, indent=2) + "\n")
    print(json.dumps(line, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main()
