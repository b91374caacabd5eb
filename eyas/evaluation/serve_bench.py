"""Serving speed with and without the drafter: the number a drafter is trained for.

    result = run_serve_bench(cfg, drafter_dir, prompts)   # launches, measures, stops, twice
    result["speedup"]["single_stream_tokens_per_s"]        # > 1.0: the drafter pays off

The target server is launched twice through the pipeline's own launch, readiness and stop code
(eyas.server.launch, eyas.server.readiness), from config copies that differ only in their launch arguments:
once plain, once with `--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR` and the
configured steps / top-k / draft tokens. Both get the same held-out prompts and sampling settings.
Per server: `num_warmup` requests first (left out), then `num_repeats` passes of
- single stream: the prompts one after another; output tokens / wall seconds,
- concurrent: the prompts with `concurrency` requests in flight; output tokens / wall seconds,
- time to first token: the latency of a max_new_tokens=1 request per prompt (the responses are
  not streamed, so this is prefill plus the first token, the same for both servers),
and the figures are medians over the passes. With `interleave` (for small targets on a shared
machine) both servers are up at once on adjacent ports and their passes alternate, so a change in
the machine's load hits both alike; otherwise (one server's GPUs) plain runs first, then the other. The acceptance length is the server's own:
sum(completion_tokens) / sum(spec_verify_ct) over the single-stream responses (SGLang's counters).
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from eyas.server import launch, readiness
from eyas.config import BenchmarkConfig, PipelineConfig
from eyas.evaluation.export import drafter_digest
from eyas.server.hosts import Host, make_host


def heldout_prompts(cfg: PipelineConfig) -> list[list[int]]:
    """The evaluation prompts, prepared exactly as the pipeline's prepare stage does (no files written)."""
    from eyas.extraction import data
    from eyas.target import load_tokenizer, target_dims

    folder = cfg.data.tokenizer or cfg.target.checkpoint
    _, vocab = target_dims(folder, cfg.target.checkpoint)
    records, skipped = data.load_records(cfg.data.path, vocab_size=vocab, bad_lines=cfg.data.bad_lines)
    return data.prepare(records, load_tokenizer(folder), cfg.data, vocab_size=vocab,
                        skipped=skipped).heldout_prompts


def speculative_args(b: BenchmarkConfig, drafter_dir: str | Path) -> list[str]:
    """SGLang's speculative flags for the configured chain (eyas-local takes the same)."""
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(drafter_dir),
            "--speculative-num-steps", str(b.speculative_num_steps),
            "--speculative-eagle-topk", str(b.speculative_eagle_topk),
            "--speculative-num-draft-tokens", str(b.speculative_num_draft_tokens),
            *b.speculative_launch_args]


def server_config(cfg: PipelineConfig, label: str, drafter_dir: str | Path | None,
                  port_offset: int = 0) -> PipelineConfig:
    """A copy of cfg whose server serves plainly (no capture), with the drafter if one is given."""
    s = cfg.server
    extra = ["--disable-radix-cache"]  # repeats of the same prompts must not skip their prefill
    if drafter_dir is not None:
        extra += speculative_args(cfg.benchmark, drafter_dir)
    server = s.model_copy(update={"capture_aux": False, "port": s.port + port_offset, "launch_args": [*s.launch_args, *extra],
                                  "workdir": Path(s.workdir) / f"bench-{label}",
                                  "dump_dir": Path(s.workdir) / f"bench-{label}" / "dump"})
    return cfg.model_copy(update={"server": server})


# ---------------------------------------------------------------------------------------------
# Measuring one running server
# ---------------------------------------------------------------------------------------------

def _generate(client: httpx.Client, ids: list[int], b: BenchmarkConfig, max_new: int) -> tuple[dict, float]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new, "temperature": b.temperature,
                                                  "ignore_eos": b.ignore_eos}}
    t0 = time.perf_counter()
    r = client.post("/generate", json=body)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    return r.json(), seconds


class Meter:
    """One running server's figures, a pass at a time (so two servers' passes can alternate)."""

    def __init__(self, url: str, prompts: list[list[int]], b: BenchmarkConfig, headers: dict | None = None):
        self.prompts, self.b = prompts, b
        limits = httpx.Limits(max_connections=b.concurrency, max_keepalive_connections=b.concurrency)
        self.client = httpx.Client(base_url=url, timeout=b.request_timeout_s, limits=limits, headers=headers)
        self.single: list[float] = []
        self.concurrent: list[float] = []
        self.ttft: list[float] = []
        self.completion = self.verify = 0
        self.outputs: list[list[int]] = []

    def warm_up(self) -> None:
        for i in range(self.b.num_warmup):
            _generate(self.client, self.prompts[i % len(self.prompts)], self.b, self.b.max_new_tokens)

    def one_pass(self) -> None:
        b, client = self.b, self.client
        t0, tokens, first = time.perf_counter(), 0, not self.single
        for ids in self.prompts:
            res, _ = _generate(client, ids, b, b.max_new_tokens)
            meta = res["meta_info"]
            tokens += meta["completion_tokens"]
            self.verify += meta.get("spec_verify_ct") or 0
            if first:
                self.outputs.append(res["output_ids"])
        self.single.append(tokens / (time.perf_counter() - t0))
        self.completion += tokens

        t0 = time.perf_counter()
        with ThreadPoolExecutor(b.concurrency) as pool:
            results = list(pool.map(lambda ids: _generate(client, ids, b, b.max_new_tokens)[0], self.prompts))
        self.concurrent.append(sum(r["meta_info"]["completion_tokens"] for r in results)
                               / (time.perf_counter() - t0))
        self.ttft.append(statistics.median(_generate(client, ids, b, 1)[1] for ids in self.prompts))

    def summary(self) -> dict[str, Any]:
        """Medians over the passes; acceptance = completion tokens / verify steps (single stream)."""
        internal = (self.client.get("/server_info").json().get("internal_states") or [{}])[0]
        self.client.close()
        return {
            "single_stream_tokens_per_s": round(statistics.median(self.single), 2),
            "concurrent_tokens_per_s": round(statistics.median(self.concurrent), 2),
            "ttft_s": round(statistics.median(self.ttft), 4),
            "acceptance_length": round(self.completion / self.verify, 3) if self.verify else None,
            "server_avg_spec_accept_length": internal.get("avg_spec_accept_length"),
            "single_stream_runs": [round(x, 2) for x in self.single],
            "concurrent_runs": [round(x, 2) for x in self.concurrent],
            "outputs": self.outputs,
        }


def measure(url: str, prompts: list[list[int]], b: BenchmarkConfig, headers: dict | None = None) -> dict[str, Any]:
    """Warm up, then num_repeats passes; medians of tokens/s and TTFT, the server's acceptance."""
    meter = Meter(url, prompts, b, headers)
    meter.warm_up()
    for _ in range(b.num_repeats):
        meter.one_pass()
    return meter.summary()


# ---------------------------------------------------------------------------------------------
# Launch, measure, stop: plain, then with the drafter (or both at once, passes alternating)
# ---------------------------------------------------------------------------------------------

def _start(host: Host, cfg: PipelineConfig, log, owner=None) -> tuple[launch.ServerHandle, float]:
    handle = launch.start_server(host, cfg, owner)
    log(f"launched pid {handle.pid}: {handle.command}")
    try:
        s = cfg.sensor
        ready = readiness.wait_until_ready(
            host, log_path=handle.log_path, pid=handle.pid, url=handle.url, start_offset=handle.log_offset,
            poll_interval_s=s.poll_interval_s, stall_timeout_s=s.stall_timeout_s, deadline_s=s.deadline_s,
            http_timeout_s=s.http_timeout_s)
    except BaseException:
        launch.stop_server(host, cfg, handle)
        raise
    return handle, round(ready.seconds, 2)


def bench_server(host: Host, cfg: PipelineConfig, prompts: list[list[int]], log=print,
                 owner=None) -> dict[str, Any]:
    """Start the server cfg describes, wait until ready, measure it, and always stop it."""
    handle, ready_s = _start(host, cfg, log, owner)
    try:
        figures = measure(handle.url, prompts, cfg.benchmark, launch.auth_headers(cfg))
    finally:
        launch.stop_server(host, cfg, handle)
    return {**figures, "ready_seconds": ready_s, "command": handle.command}


def bench_interleaved(host: Host, cfgs: list[PipelineConfig], prompts: list[list[int]],
                      log=print, owner=None) -> list[dict[str, Any]]:
    """Both servers up at once, their passes alternating, so a load change hits both alike."""
    started: list[tuple[PipelineConfig, launch.ServerHandle, float]] = []
    try:
        for c in cfgs:
            started.append((c, *_start(host, c, log, owner)))
        meters = [Meter(h.url, prompts, c.benchmark, launch.auth_headers(c)) for c, h, _ in started]
        for m in meters:
            m.warm_up()
        for _ in range(cfgs[0].benchmark.num_repeats):
            for m in meters:
                m.one_pass()
        return [{**m.summary(), "ready_seconds": r, "command": h.command}
                for m, (_, h, r) in zip(meters, started)]
    finally:
        for c, h, _ in started:
            launch.stop_server(host, c, h)


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


DRAFTER_FILES = ("config.json", "model.safetensors")


def stage_drafter(host: Host, cfg: PipelineConfig, drafter_dir: str | Path) -> Path:
    """The drafter's path as the server host sees it: the same folder on this machine; on an SSH
    host, a copy under <server.workdir>/drafters/<digest> (uploaded once, whole, then renamed)."""
    if cfg.server.host.kind == "local":
        return Path(drafter_dir)
    remote = Path(cfg.server.workdir) / "drafters" / drafter_digest(drafter_dir)[:16]
    if host.run(f"test -f {shlex.quote(str(remote / DRAFTER_FILES[0]))}", check=False).ok:
        return remote  # named by its content: present means complete
    tmp = remote.with_name(f".{remote.name}.partial")
    host.run(f"rm -rf {shlex.quote(str(tmp))}")
    for name in DRAFTER_FILES:
        host.put(Path(drafter_dir) / name, tmp / name)
    host.run(f"rm -rf {shlex.quote(str(remote))} && mv {shlex.quote(str(tmp))} {shlex.quote(str(remote))}")
    return remote


def run_serve_bench(cfg: PipelineConfig, drafter_dir: str | Path, prompts: list[list[int]],
                    host: Host | None = None, log=print, owner=None) -> dict[str, Any]:
    """Both servers, side by side -> figures, speed-up ratios, machine and settings. `owner`
    (ownership.Owner): who launches them, recorded with each launch."""
    b = cfg.benchmark
    if not prompts:
        raise ValueError("run_serve_bench: no prompts (the held-out set is empty)")
    prompts = prompts[: b.num_prompts]
    t0 = time.monotonic()
    own_host = host is None
    host = host or make_host(cfg.server.host)
    try:
        served = stage_drafter(host, cfg, drafter_dir)
        if str(served) != str(drafter_dir):
            log(f"drafter uploaded to {cfg.server.host.name}:{served}")
        plain_cfg = server_config(cfg, "plain", None)
        spec_cfg = server_config(cfg, "speculative", served, port_offset=1 if b.interleave else 0)
        if b.interleave:
            plain, spec = bench_interleaved(host, [plain_cfg, spec_cfg], prompts, log, owner)
        else:
            plain = bench_server(host, plain_cfg, prompts, log, owner)
            spec = bench_server(host, spec_cfg, prompts, log, owner)
    finally:
        if own_host:
            host.close()
    identical = plain.pop("outputs") == spec.pop("outputs")
    speedup = {k: _ratio(spec[k], plain[k]) for k in ("single_stream_tokens_per_s", "concurrent_tokens_per_s")}
    speedup["ttft"] = _ratio(plain["ttft_s"], spec["ttft_s"])  # > 1: the drafter made it faster
    # Interleaved passes ran at the same moment's load: their pairwise ratios are the cleaner figure.
    speedup["single_stream_per_pass"] = [_ratio(x, y) for x, y in
                                         zip(spec["single_stream_runs"], plain["single_stream_runs"])]
    al, ratio = spec["acceptance_length"], speedup["single_stream_tokens_per_s"]
    return {
        "plain": plain, "speculative": spec, "speedup": speedup,
        "acceptance_length": al,
        # The acceptance length at which this machine's verify-plus-draft round would break even:
        # tokens/s scale with AL at a fixed cost per round, so AL / speed-up.
        "break_even_acceptance_length": round(al / ratio, 3) if al and ratio else None,
        # Greedy outputs must match token for token; sampled ones need not.
        "identical_outputs": identical if b.temperature == 0 else None,
        "drafter_dir": str(drafter_dir),
        "seconds": round(time.monotonic() - t0, 1),
        "settings": {**b.model_dump(), "num_prompts": len(prompts), "backend": cfg.server.backend,
                     "target": str(cfg.target.checkpoint), "server_env": cfg.server.env},
        "machine": machine() if cfg.server.host.kind == "local" else {"host": cfg.server.host.name},
    }


def markdown(result: dict[str, Any]) -> str:
    """The Prefect artifact: one table, plain vs speculative."""
    p, s, r = result["plain"], result["speculative"], result["speedup"]
    b = result["settings"]
    rows = [("single-stream output tokens/s", "single_stream_tokens_per_s", r["single_stream_tokens_per_s"]),
            (f"output tokens/s at concurrency {b['concurrency']}", "concurrent_tokens_per_s",
             r["concurrent_tokens_per_s"]),
            ("time to first token (s)", "ttft_s", r["ttft"])]
    table = "\n".join(f"| {name} | {p[k]} | {s[k]} | {ratio} |" for name, k, ratio in rows)
    return (f"# Serving with the drafter\n\n"
            f"**Single-stream speed-up: {r['single_stream_tokens_per_s']}x**, acceptance length "
            f"{result['acceptance_length']} ({b['speculative_num_steps']}/{b['speculative_eagle_topk']}/"
            f"{b['speculative_num_draft_tokens']}), outputs identical: {result['identical_outputs']}\n\n"
            f"| figure | plain | with drafter | ratio |\n|---|---|---|---|\n{table}\n\n"
            f"{b['num_prompts']} prompts, {b['max_new_tokens']} new tokens, temperature {b['temperature']}, "
            f"medians of {b['num_repeats']} passes after {b['num_warmup']} warm-up requests; "
            f"machine: {result['machine']}\n")
