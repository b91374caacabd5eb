"""Extraction benchmark: throughput against plain prefill, bytes on disk, memory while writing 2 GB.

    python bench/extract.py [--rounds 5] [--sequences 48] [--rss-gb 2.0] [--skip-rss]

(a) Throughput. One real local server on the tiny target (fixtures/tiny-target, capture [2, 4, 5],
    single-threaded) gets the same sequences (held-out-free fixture conversations, tokenized with
    the chat template) two ways, alternating order over `--rounds` rounds: plain prefill (rids
    starting with WARMUP_, which the dump writer skips: no hidden states kept, nothing written,
    nothing collected) and full extraction (eyas.extraction.extract: capture, dump records, collect,
    validate, write the shard, sha256, fsync). Both go through the same ServerPool with the same
    requests in flight. Figure: median over rounds of extraction tokens/s / plain tokens/s. Goal >=
    0.90.
(b) Bytes per token of the shards of (a), divided by the bf16 minimum 4 x H x 2 + 4 + 1 (three aux
    layers and the last layer in bf16, an int32 id and a uint8 mask); then the same sequences in
    FP8 (e4m3, per-token scales), with its reconstruction error against the bf16 shard as the
    reader returns it. Goals <= 1.02 (bf16), <= 0.53 (FP8).
(c) Peak memory of the extraction process (a subprocess: client, collector, writer; not the
    server) while it writes `--rss-gb` GB of shards, from a server on a random target as wide as
    Kimi-K2.5 (H = 7168, 57 KB per token, so 2 GB is about 35k tokens) with sequences of 1k-4k
    tokens (production max_length 4096). Goal < 1.5 GB. The same server first gives (a) again at
    that width (8 sequences of 512 tokens, 2 rounds), where dump bytes weigh far more against
    compute.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eyas.extraction.client import Endpoint, ServerPool  # noqa: E402
from eyas.extraction.data import TokenizedSample, load_conversations, prepare, write_shard_plans  # noqa: E402
from eyas.extraction.extract import SAMPLING, extract_shard, shard_path  # noqa: E402
from eyas.extraction.shards import ShardReader, bytes_per_token  # noqa: E402
from eyas.net import free_port  # noqa: E402
from eyas.server import readiness  # noqa: E402
from eyas.server.hosts import LocalHost  # noqa: E402

TARGET = ROOT / "fixtures" / "tiny-target"
CAPTURE = [2, 4, 5]
META = {"layer_ids": CAPTURE, "layer_convention": "capture-before", "cache_key": "bench"}


def dump_dir(workdir: Path) -> Path:
    """On tmpfs when there is one, as in production (server.dump_dir: /dev/shm/eyas-dump): records
    live for milliseconds, and this machine's disk writes at ~0.1 GB/s against ~1 GB/s for tmpfs."""
    if Path("/dev/shm").is_dir():
        return Path(tempfile.mkdtemp(prefix="eyas-bench-dump-", dir="/dev/shm"))
    return workdir / "dump"


def start_server(host: LocalHost, model: Path, workdir: Path, *flags: str) -> tuple[int, str, Path]:
    port, log, dump = free_port(), workdir / "server.log", dump_dir(workdir)
    cmd = shlex.join(
        [
            sys.executable,
            "-m",
            "eyas.local.server",
            "--model-path",
            str(model),
            "--port",
            str(port),
            "--enable-return-aux-hidden-states",
            "--return-aux-hidden-state-layer-ids",
            *map(str, CAPTURE),
            "--disable-radix-cache",
            *flags,
        ]
    )
    pid = host.start(
        cmd, log_path=log, env={"OMP_NUM_THREADS": "1", "EYAS_DUMP_DIR": str(dump)}, cwd=ROOT
    )
    url = f"http://127.0.0.1:{port}"
    readiness.wait_until_ready(
        host,
        log_path=log,
        pid=pid,
        url=url,
        poll_interval_s=0.2,
        stall_timeout_s=120,
        deadline_s=600,
        http_timeout_s=10,
    )
    return pid, url, dump


def fixture_samples(n: int) -> list[TokenizedSample]:
    from eyas.config import DataConfig
    from eyas.target import load_tokenizer

    convs = load_conversations(ROOT / "fixtures" / "data" / "conversations.jsonl")[: n + 1]
    cfg = DataConfig(
        path=ROOT / "fixtures" / "data" / "conversations.jsonl", max_length=384, num_heldout=1
    )
    return prepare(convs, load_tokenizer(TARGET), cfg).train[:n]


# ---------------------------------------------------------------------------------------------
# (a) and (b)
# ---------------------------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, from /proc (the server's CPU seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Meter:
    """Wall seconds, server CPU seconds and this process's CPU seconds over a block."""

    def __init__(self, server_pid: int):
        self.pid = server_pid

    def __enter__(self):
        self.t, self.s, self.c = time.monotonic(), proc_cpu_s(self.pid), self_cpu_s()
        return self

    def __exit__(self, *exc):
        self.wall = time.monotonic() - self.t
        self.server_cpu, self.client_cpu = proc_cpu_s(self.pid) - self.s, self_cpu_s() - self.c


def plain_pass(pool: ServerPool, samples: list[TokenizedSample], tag: str) -> float:
    """Seconds to prefill every sample without capture or dump (same pool, same in-flight bound)."""
    t0 = time.monotonic()
    futures = [
        pool.generate(s.input_ids, f"WARMUP_plain-{tag}-{i:05d}", SAMPLING)
        for i, s in enumerate(samples)
    ]
    for f in futures:
        f.result()
    return time.monotonic() - t0


def extract_pass(pool: ServerPool, plan, out: Path, encoding: str = "plain") -> tuple[float, dict]:
    t0 = time.monotonic()
    m = extract_shard(
        plan, out, capture_ids=CAPTURE, dtype="bfloat16", meta=META, pool=pool, encoding=encoding
    )
    return time.monotonic() - t0, m


def throughput_and_bytes(tmp: Path, rounds: int, num_sequences: int, concurrency: int) -> dict:
    host = LocalHost()
    samples = fixture_samples(num_sequences)
    tokens = sum(len(s.input_ids) for s in samples)
    plan = write_shard_plans(samples, 1, tmp / "plan")[0]
    pid, url, dump = start_server(host, TARGET, tmp / "server", "--chunked-prefill-size", "128")
    fig: dict = {
        "sequences": len(samples),
        "tokens": tokens,
        "concurrency": concurrency,
        "rounds": [],
    }
    try:
        with ServerPool(
            [Endpoint(url, dump, concurrency)], request_timeout_s=600, retries=0
        ) as pool:
            plain_pass(pool, samples[:4], "warm")  # first requests pay lazy initialisation
            for r in range(rounds):
                order = ("plain", "extract") if r % 2 == 0 else ("extract", "plain")
                row = {}
                for kind in order:
                    with Meter(pid) as meter:
                        if kind == "plain":
                            plain_pass(pool, samples, str(r))
                        else:
                            _, m = extract_pass(pool, plan, tmp / f"bf16-{r}")
                    row[f"{kind}_s"] = meter.wall
                    row[f"{kind}_server_cpu_ms_per_ktok"] = 1e6 * meter.server_cpu / tokens
                    row[f"{kind}_client_cpu_ms_per_ktok"] = 1e6 * meter.client_cpu / tokens
                row["plain_tok_s"] = round(tokens / row["plain_s"], 1)
                row["extract_tok_s"] = round(tokens / row["extract_s"], 1)
                row["ratio"] = round(row["extract_tok_s"] / row["plain_tok_s"], 4)
                fig["rounds"].append({k: round(v, 3) for k, v in row.items()})
                print(
                    f"round {r}: plain {row['plain_tok_s']:.0f} tok/s, extraction "
                    f"{row['extract_tok_s']:.0f} "
                    f"tok/s, ratio {row['ratio']:.3f}; server CPU ms/ktok "
                    f"{row['plain_server_cpu_ms_per_ktok']:.0f} "
                    f"vs {row['extract_server_cpu_ms_per_ktok']:.0f}",
                    flush=True,
                )
            fp8_s, m8 = extract_pass(pool, plan, tmp / "fp8", encoding="fp8_e4m3")
    finally:
        host.kill_group(pid, 9)
        shutil.rmtree(dump, ignore_errors=True)
    fig["ratio_median"] = statistics.median(r["ratio"] for r in fig["rounds"])
    fig["plain_tok_s_median"] = statistics.median(r["plain_tok_s"] for r in fig["rounds"])
    fig["extract_tok_s_median"] = statistics.median(r["extract_tok_s"] for r in fig["rounds"])
    for kind in ("plain", "extract"):
        for who in ("server", "client"):
            key = f"{kind}_{who}_cpu_ms_per_ktok"
            fig[f"{key}_median"] = round(statistics.median(r[key] for r in fig["rounds"]), 1)
    fig["loadavg_1min_after"] = os.getloadavg()[0]

    # (b) bytes per token against the bf16 minimum, and FP8's error as the reader returns it.
    H = m["hidden_size"]
    minimum = bytes_per_token(H, len(CAPTURE))  # 4 x H x 2 + 4 + 1
    fig["hidden_size"] = H
    fig["bf16_min_bytes_per_token"] = minimum
    fig["bf16_bytes_per_token"] = round(m["bytes"] / m["num_tokens"], 3)
    fig["fp8_bytes_per_token"] = round(m8["bytes"] / m8["num_tokens"], 3)
    fig["bf16_ratio"] = round(fig["bf16_bytes_per_token"] / minimum, 4)
    fig["fp8_ratio"] = round(fig["fp8_bytes_per_token"] / minimum, 4)
    fig["fp8_tok_s"] = round(tokens / fp8_s, 1)
    fig["fp8_error_manifest"] = m8["fp8_error"]
    a, b = ShardReader(shard_path(tmp / "bf16-0", plan)), ShardReader(shard_path(tmp / "fp8", plan))
    rel, cos = [], []
    for x, y in zip(a, b):
        xa, ya = x.aux_hidden_states.float(), y.aux_hidden_states.float()
        rel += ((xa - ya).norm(dim=-1) / xa.norm(dim=-1)).tolist()
        cos += ((xa * ya).sum(-1) / (xa.norm(dim=-1) * ya.norm(dim=-1))).tolist()
    fig["fp8_vs_bf16_reader"] = {
        "token_rel_error_mean": round(statistics.mean(rel), 5),
        "token_rel_error_max": round(max(rel), 5),
        "cosine_min": round(min(cos), 6),
    }
    # The same formula at Kimi-K2.5's width (H = 7168), where the per-token overhead is smallest.
    fig["at_h7168"] = {
        "bf16_min": bytes_per_token(7168, 3),
        "fp8_ratio": round(
            bytes_per_token(7168, 3, encoding="fp8_e4m3") / bytes_per_token(7168, 3), 4
        ),
    }
    return fig


# ---------------------------------------------------------------------------------------------
# (c) memory while writing 2 GB
# ---------------------------------------------------------------------------------------------

WIDE = dict(
    vocab_size=512,
    hidden_size=7168,
    intermediate_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=6,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=6,
    n_group=1,
    topk_group=1,
    max_position_embeddings=8192,
)


def wide_target(folder: Path) -> Path:
    """A random DeepSeek-V3 as wide as Kimi-K2.5 (H = 7168) but cheap: 6 thin layers, 13M params."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**WIDE))
    model.save_pretrained(folder)
    return folder


def rss_child(args) -> None:
    """The extraction process of (c): plan, extract into shards, report its own peak RSS."""
    rng = random.Random(0)
    per_token = bytes_per_token(WIDE["hidden_size"], len(CAPTURE))
    samples, total = [], 0
    while total * per_token < args.rss_gb * 1e9:
        n = rng.randint(1024, 4096)
        samples.append(
            TokenizedSample(
                [rng.randrange(3, 512) for _ in range(n)], [0] * (n // 2) + [1] * (n - n // 2)
            )
        )
        total += n
    out = Path(args.out)
    plans = write_shard_plans(samples, 2, out / "plan")
    t0, written = time.monotonic(), 0
    with ServerPool(
        [Endpoint(args.url, Path(args.dump), 2)], request_timeout_s=900, retries=0
    ) as pool:
        for plan in plans:
            m = extract_shard(
                plan, out, capture_ids=CAPTURE, dtype="bfloat16", meta=META, pool=pool
            )
            written += m["bytes"]
            print(f"  {plan.name}: {m['num_tokens']} tokens, {m['bytes'] / 1e9:.3f} GB", flush=True)
    hwm_kb = next(
        int(line.split()[1])
        for line in Path("/proc/self/status").read_text().splitlines()
        if line.startswith("VmHWM:")
    )
    print(
        json.dumps(
            {
                "bytes_written": written,
                "tokens": total,
                "sequences": len(samples),
                "seconds": round(time.monotonic() - t0, 1),
                "peak_rss_bytes": hwm_kb * 1024,
                "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            }
        )
    )


def wide_ratio(url: str, dump: Path, tmp: Path, pid: int, rounds: int = 2) -> dict:
    """(a) again on the wide target, where 57 KB of dump per token weighs far more against
    compute."""
    rng = random.Random(1)
    samples = [
        TokenizedSample([rng.randrange(3, 512) for _ in range(512)], [0] * 256 + [1] * 256)
        for _ in range(8)
    ]
    tokens, plan = 8 * 512, write_shard_plans(samples, 1, tmp / "wide-plan")[0]
    ratios, cpu = [], []
    with ServerPool([Endpoint(url, dump, 2)], request_timeout_s=900, retries=0) as pool:
        plain_pass(pool, samples[:1], "wide-warm")
        for r in range(rounds):
            with Meter(pid) as plain:
                plain_pass(pool, samples, f"wide-{r}")
            with Meter(pid) as ext:
                extract_pass(pool, plan, tmp / f"wide-ratio-{r}")
            ratios.append(round(plain.wall / ext.wall, 4))
            cpu.append(
                {
                    "plain_server_cpu_s": round(plain.server_cpu, 2),
                    "extract_server_cpu_s": round(ext.server_cpu, 2),
                    "plain_client_cpu_s": round(plain.client_cpu, 2),
                    "extract_client_cpu_s": round(ext.client_cpu, 2),
                }
            )
            print(
                f"wide round {r}: plain {tokens / plain.wall:.0f} tok/s, extraction "
                f"{tokens / ext.wall:.0f} tok/s, ratio {ratios[-1]:.3f}; {cpu[-1]}",
                flush=True,
            )
    return {
        "tokens": tokens,
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "cpu": cpu,
    }


def peak_memory(tmp: Path, gb: float) -> tuple[dict, dict]:
    host = LocalHost()
    target = wide_target(tmp / "wide-target")
    pid, url, dump = start_server(
        host, target, tmp / "wide-server", "--chunked-prefill-size", "8192"
    )
    try:
        wide = wide_ratio(url, dump, tmp, pid)
        p = subprocess.run(
            [
                sys.executable,
                __file__,
                "--rss-child",
                "--url",
                url,
                "--dump",
                str(dump),
                "--out",
                str(tmp / "wide-shards"),
                "--rss-gb",
                str(gb),
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        host.kill_group(pid, 9)
        shutil.rmtree(dump, ignore_errors=True)
    print(p.stdout.rstrip(), flush=True)
    if p.returncode != 0:
        raise RuntimeError(f"extraction process failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1]), wide


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sequences", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--rss-gb", type=float, default=2.0)
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--dump", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rss_child:
        return rss_child(args)

    with tempfile.TemporaryDirectory(prefix="eyas-bench-extract-") as d:
        tmp = Path(d)
        figures = throughput_and_bytes(tmp, args.rounds, args.sequences, args.concurrency)
        goals = {
            "extract_over_prefill_tok_s": {
                "value": round(figures["ratio_median"], 4),
                "goal": ">= 0.90",
                "met": figures["ratio_median"] >= 0.90,
            },
            "bf16_bytes_over_min": {
                "value": figures["bf16_ratio"],
                "goal": "<= 1.02",
                "met": figures["bf16_ratio"] <= 1.02,
            },
            "fp8_bytes_over_bf16_min": {
                "value": figures["fp8_ratio"],
                "goal": "<= 0.53",
                "met": figures["fp8_ratio"] <= 0.53,
            },
        }
        if not args.skip_rss:
            mem, wide = peak_memory(tmp, args.rss_gb)
            figures["memory"], figures["wide_h7168_ratio"] = mem, wide
            gb = max(mem["peak_rss_bytes"], mem["ru_maxrss_bytes"]) / 1e9
            goals["peak_rss_gb_writing_2gb"] = {
                "value": round(gb, 3),
                "goal": "< 1.5",
                "met": gb < 1.5 and mem["bytes_written"] >= args.rss_gb * 1e9,
            }
    print(json.dumps({"bench": "extract", "figures": figures, "goals": goals}))


if __name__ == "__main__":
    main()
