"""One serving launch of the target, plain or with the drafter, and what is measured on it.

    spec_3 = serving_launch(cfg, Chain.of(3).label, drafter_dir, chain=Chain.of(3))
    with running(host, spec_3, cfg.sensor, log) as (handle, ready_s):
        meter = Meter(handle.url, cfg.benchmark)
        meter.warm_up()
        served = meter.serve_set(prompts, max_new_tokens=48)   # acceptance: greedy, to the eos
        # speed: single stream, concurrent, TTFT
        meter.one_pass(prompts); figures = meter.summary()

Every launch goes through the pipeline's own launch, readiness and stop code (eyas.server.launch,
eyas.server.readiness): a serving Launch whose server section is a copy of the configured one with
its own launch arguments, environment, port and workdir.
eyas/evaluation/serve_bench.py decides which launches happen and assembles the figures.
"""

from __future__ import annotations

import os
import platform
import shlex
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx

from eyas.config import BenchmarkConfig, PipelineConfig, SensorConfig
from eyas.evaluation.acceptance import chain_name
from eyas.evaluation.export import drafter_digest
from eyas.server import readiness
from eyas.server.hosts import Host
from eyas.server.launch import Launch, ServerHandle, start_server, stop_server


@dataclass(frozen=True)
class Chain:
    """SGLang's three speculative flags: draft steps, top-k (1: a chain), tokens per verify."""

    steps: int
    topk: int
    draft_tokens: int  # a chain's (top-k 1): steps + 1

    @classmethod
    def of(cls, steps: int) -> "Chain":
        """The chain of `steps` drafts: steps/1/steps+1."""
        return cls(steps, 1, steps + 1)

    @property
    def name(self) -> str:  # 3/1/4
        return chain_name(self.steps, self.topk, self.draft_tokens)

    @property
    def label(self) -> str:  # spec-3-1-4: the launch's workdir
        return "spec-" + self.name.replace("/", "-")

    def args(self, drafter_dir: str | Path, extra: list[str]) -> list[str]:
        """SGLang's speculative flags for this chain (eyas-local takes the same)."""
        return [
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            str(drafter_dir),
            "--speculative-num-steps",
            str(self.steps),
            "--speculative-eagle-topk",
            str(self.topk),
            "--speculative-num-draft-tokens",
            str(self.draft_tokens),
            *extra,
        ]


def serving_launch(
    cfg: PipelineConfig,
    label: str,
    drafter_dir: str | Path | None,
    *,
    chain: Chain | None = None,
    port_offset: int = 0,
) -> Launch:
    """The launch that serves cfg's target plainly (no capture), with the drafter if one is given,
    in <server.workdir>/bench-<label>: server.launch_args and benchmark.launch_args
    (server.capture_launch_args are the capture's only), server.env under benchmark.server_env."""
    s = cfg.server
    # repeats of the same prompts must not skip their prefill
    extra = ["--disable-radix-cache", *cfg.benchmark.launch_args]
    if drafter_dir is not None:
        extra += chain.args(drafter_dir, cfg.benchmark.speculative_launch_args)
    server = s.model_copy(
        update={
            "port": s.port + port_offset,
            "env": {**s.env, **cfg.benchmark.server_env},
            "launch_args": [*s.launch_args, *extra],
            "workdir": Path(s.workdir) / f"bench-{label}",
            "dump_dir": Path(s.workdir) / f"bench-{label}" / "dump",
        }
    )
    return Launch("serve", server, cfg.target, cfg.name)


@contextmanager
def running(
    host: Host, served: Launch, sensor: SensorConfig, log, owner=None
) -> Iterator[tuple[ServerHandle, float]]:
    """Start the launch (recorded as `owner`'s, ownership.Owner), wait until it is ready, and
    always stop it afterwards."""
    handle = start_server(host, served, owner)
    log(f"launched pid {handle.pid}: {handle.command}")
    try:
        ready = readiness.wait_for_server(host, handle, sensor)
        yield handle, round(ready.seconds, 2)
    finally:
        stop_server(host, served, handle)


# ---------------------------------------------------------------------------------------------
# Measuring one running server
# ---------------------------------------------------------------------------------------------


def _generate(client: httpx.Client, ids: list[int], sampling: dict) -> tuple[dict, float]:
    t0 = time.perf_counter()
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": sampling})
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    return r.json(), seconds


class Meter:
    """One running server's figures, a pass at a time (so two servers' passes can alternate)."""

    def __init__(
        self,
        url: str,
        b: BenchmarkConfig,
        headers: dict | None = None,
        on_answer: Callable[[str, int, int, float | None], None] | None = None,
    ):
        """on_answer(what, done, total, acceptance so far) after each prompt of a pass."""
        self.b, self.on_answer = b, on_answer
        limits = httpx.Limits(
            max_connections=b.concurrency, max_keepalive_connections=b.concurrency
        )
        self.client = httpx.Client(
            base_url=url, timeout=b.request_timeout_s, limits=limits, headers=headers
        )
        self.sampling = {
            "max_new_tokens": b.max_new_tokens,
            "temperature": b.temperature,
            "ignore_eos": b.ignore_eos,
        }
        self.single: list[float] = []
        self.concurrent: list[float] = []
        self.ttft: list[float] = []
        self.windows: list[list] = []  # [phase, start, end] per phase run, epoch seconds
        self.completion = self.verify = 0
        self.outputs: list[list[int]] = []

    def warm_up(self, prompts: list[list[int]]) -> None:
        for i in range(self.b.num_warmup):
            _generate(self.client, prompts[i % len(prompts)], self.sampling)

    def serve_set(
        self, prompts: list[list[int]], max_new_tokens: int, what: str = "prompts"
    ) -> dict[str, Any]:
        """The acceptance pass over the prompt set `what`: each prompt alone, greedy, to the
        target's eos or max_new_tokens.

        Per prompt the output ids and the server's verify steps (meta_info.spec_verify_ct; absent
        on a plain server); over the pass, output tokens / wall seconds.
        """
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": False}
        outputs, verify, t0 = [], [], time.perf_counter()
        for ids in prompts:
            res, _ = _generate(self.client, ids, sampling)
            outputs.append(res["output_ids"])
            verify.append(res["meta_info"].get("spec_verify_ct") or 0)
            self._answered(what, len(outputs), len(prompts), sum(map(len, outputs)), sum(verify))
        seconds = time.perf_counter() - t0
        return {
            "outputs": outputs,
            "verify_steps": verify,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(sum(map(len, outputs)) / seconds, 2),
        }

    def _answered(self, what: str, done: int, total: int, tokens: int, verify: int) -> None:
        if self.on_answer is not None:  # acceptance so far: tokens per verify step (None: plain)
            self.on_answer(what, done, total, tokens / verify if verify else None)

    #: a speed pass's phases, in order: two servers measured side by side run each phase at the
    #: same time (eyas/evaluation/serve_bench.py), so neither's single streams share the machine
    #: with the other's heavier concurrent phase
    PHASES = ("single_stream", "concurrent", "ttft")

    def one_pass(self, prompts: list[list[int]]) -> None:
        """The speed pass: single stream, then `concurrency` in flight, then time to first token."""
        for phase in self.PHASES:
            self.phase(phase, prompts)

    def phase(self, name: str, prompts: list[list[int]]) -> None:
        """One phase of the speed pass (PHASES) over the prompts, its wall-clock window noted."""
        run = {
            "single_stream": self._single_stream,
            "concurrent": self._concurrent,
            "ttft": self._ttft,
        }
        start = time.time()
        run[name](prompts)
        self.windows.append([name, round(start, 3), round(time.time(), 3)])

    def _single_stream(self, prompts: list[list[int]]) -> None:
        t0, tokens, first = time.perf_counter(), 0, not self.single
        for done, ids in enumerate(prompts, 1):
            res, _ = _generate(self.client, ids, self.sampling)
            meta = res["meta_info"]
            tokens += meta["completion_tokens"]
            self.verify += meta.get("spec_verify_ct") or 0
            if first:
                self.outputs.append(res["output_ids"])
            self._answered("speed pass", done, len(prompts), self.completion + tokens, self.verify)
        self.single.append(tokens / (time.perf_counter() - t0))
        self.completion += tokens

    def _concurrent(self, prompts: list[list[int]]) -> None:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(self.b.concurrency) as pool:
            results = list(
                pool.map(lambda ids: _generate(self.client, ids, self.sampling)[0], prompts)
            )
        self.concurrent.append(
            sum(r["meta_info"]["completion_tokens"] for r in results) / (time.perf_counter() - t0)
        )

    def _ttft(self, prompts: list[list[int]]) -> None:
        one = {**self.sampling, "max_new_tokens": 1}
        self.ttft.append(statistics.median(_generate(self.client, ids, one)[1] for ids in prompts))

    def summary(self) -> dict[str, Any]:
        """Medians over the speed passes; acceptance = completion tokens / verify steps (single
        stream)."""
        internal = (self.client.get("/server_info").json().get("internal_states") or [{}])[0]
        return {
            "single_stream_tokens_per_s": round(statistics.median(self.single), 2),
            "concurrent_tokens_per_s": round(statistics.median(self.concurrent), 2),
            "ttft_s": round(statistics.median(self.ttft), 4),
            "acceptance_length": round(self.completion / self.verify, 3) if self.verify else None,
            "server_avg_spec_accept_length": internal.get("avg_spec_accept_length"),
            "single_stream_runs": [round(x, 2) for x in self.single],
            "concurrent_runs": [round(x, 2) for x in self.concurrent],
            "phase_windows": self.windows,
            "outputs": self.outputs,
        }

    def close(self) -> None:
        self.client.close()


# ---------------------------------------------------------------------------------------------
# The machine and the drafter's place on the server host
# ---------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }


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
    host.run(
        f"rm -rf {shlex.quote(str(remote))} && mv {shlex.quote(str(tmp))} "
        f"{shlex.quote(str(remote))}"
    )
    return remote
