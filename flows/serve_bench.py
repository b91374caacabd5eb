"""Subflow: serve the target with and without an exported drafter, and measure the speed-up.

    python -m flows.serve_bench configs/local-tiny.yaml [runs/local-tiny/drafter]
    prefect deployment run 'eyas-serve-bench/serve-bench'    # once deployed

Runnable alone on any exported drafter (default: <run_dir>/drafter), with the held-out prompts
taken from the config's data as the pipeline takes them; inside the pipeline it gets both from the
train stage. Holds the server host's lock while a server lives, stops both benchmark servers if
the run fails or crashes, writes <run_dir>/serve_bench.json and a Prefect artifact, and returns
the result (figures, speed-up ratios, machine and settings), or None if `benchmark.enabled` is off.
"""

from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from eyas.evaluation import serve_bench
from eyas.server.hosts import make_host
from eyas.server.launch import stop_server
from eyas.report import artifact_key
from eyas.extraction.shards import write_json_atomic
from flows.common import DEFAULT_CONFIG, ConfigParam, Overrides, checked_flow, gpu_host, resolve_config
from flows.serve import run_name
from tasks.preflight import preflight_check
from tasks.serve_bench import benchmark_serving_for


def stop_bench_servers(flow, flow_run, state) -> None:
    """on_failure / on_crashed / on_cancellation: stop the benchmark servers this run launched that
    are still recorded as running (another run's are left alone)."""
    p = flow_run.parameters
    cfg = resolve_config(p["config"], p.get("overrides"))
    host = make_host(cfg.server.host)
    try:
        for label, offset in (("plain", 0), ("speculative", 1 if cfg.benchmark.interleave else 0)):
            print(f"serve-bench hook ({state.name}): {label}:",
                  stop_server(host, serve_bench.server_config(cfg, label, None, port_offset=offset),
                              runs={str(flow_run.id)}))
    finally:
        host.close()


@flow(name="eyas-serve-bench", flow_run_name=run_name("serve-bench"), log_prints=True,
      on_failure=[stop_bench_servers], on_crashed=[stop_bench_servers], on_cancellation=[stop_bench_servers])
@checked_flow
def serve_bench_flow(config: ConfigParam = DEFAULT_CONFIG, overrides: Overrides | None = None,
                     drafter_dir: str | None = None, prompts: list[list[int]] | None = None) -> dict | None:
    """Serving speed with vs without the drafter: report.json's `serving` section."""
    cfg = resolve_config(config, overrides)
    if not cfg.benchmark.enabled:
        return None
    preflight_check(cfg)
    # 1. The drafter and the prompts: given by the pipeline, or found from the config alone.
    drafter_dir = drafter_dir or str(Path(cfg.run_dir) / "drafter")
    if not (Path(drafter_dir) / "config.json").exists():
        raise FileNotFoundError(f"{drafter_dir}: no exported drafter (run the train flow first, or pass one)")
    if prompts is None:
        prompts = serve_bench.heldout_prompts(cfg)
    # 2. Plain server, then the speculative one, through the same launch/readiness/stop code.
    with gpu_host(cfg):
        result = benchmark_serving_for(cfg)(cfg, drafter_dir, prompts)
    # 3. Record it beside the run.
    write_json_atomic(Path(cfg.run_dir) / "serve_bench.json", result)
    create_markdown_artifact(key=artifact_key("serve-bench", cfg.name), markdown=serve_bench.markdown(result),
                             description="serving speed with vs without the drafter")
    return result


if __name__ == "__main__":
    serve_bench_flow(sys.argv[1], drafter_dir=sys.argv[2] if len(sys.argv) > 2 else None)
