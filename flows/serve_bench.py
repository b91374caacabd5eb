"""Subflow: serve the target plainly and with an exported drafter: acceptance length and speed-up.

    python -m eyas_prefect.flows.serve_bench configs/local-tiny.yaml [runs/local-tiny/drafter]
    prefect deployment run 'eyas-serve-bench/serve-bench'    # once deployed

Runnable alone on any exported drafter (default: <run_dir>/drafter), with the held-out prompts
taken from the config's data as the pipeline takes them; inside the pipeline it gets both from the
earlier stages. The target is launched plainly once and once per chain with the drafter
(eyas/evaluation/serve_bench.py): acceptance per chain on the held-out prompts and on each of
`benchmark.suites`, and the speed-up at the benchmark's chain. Holds the server host's lock while a
server lives, stops every launch of the stage if the run fails or crashes, writes
<run_dir>/serve_bench.json and a Prefect artifact, and returns the result; None when there is
nothing to serve for (`evaluation.method: in_process` and `benchmark.enabled: false`).
"""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

from eyas_prefect.flows.common import (
    DEFAULT_CONFIG,
    STOP_ON_FAILURE,
    ConfigParam,
    Overrides,
    checked_flow,
    resolve_config,
)
from eyas_prefect.flows.runtime.host_lock import gpu_host
from eyas_prefect.flows.serve import run_name
from eyas_prefect.tasks.preflight import preflight_check
from eyas_prefect.tasks.serve_bench import benchmark_serving_for
from prefect import flow
from prefect.artifacts import create_markdown_artifact

from eyas.evaluation import serve_bench, suites
from eyas.files import write_json_atomic
from eyas.report import artifact_key


@flow(
    name="eyas-serve-bench",
    flow_run_name=run_name("serve-bench"),
    log_prints=True,
    **STOP_ON_FAILURE,
)
@checked_flow
def serve_bench_flow(
    config: ConfigParam = DEFAULT_CONFIG,
    overrides: Overrides | None = None,
    drafter_dir: str | None = None,
    prompts: list[list[int]] | None = None,
) -> serve_bench.ServeBenchResult | None:
    """Acceptance and speed with vs without the drafter: report.json's `serving` section."""
    cfg = resolve_config(config, overrides)
    if not cfg.benchmark.enabled and cfg.evaluation.method != "server":
        return None
    preflight_check(cfg)
    # 1. The drafter and the prompt sets: held-out prompts (given by the pipeline, or found from the
    #    config alone) and the configured suites, read from the packages that ship them.
    drafter_dir = drafter_dir or str(Path(cfg.run_dir) / "drafter")
    if not (Path(drafter_dir) / "config.json").exists():
        raise FileNotFoundError(
            f"{drafter_dir}: no exported drafter (run the train flow first, or pass one)"
        )
    heldout = serve_bench.heldout_prompts(cfg) if prompts is None else prompts
    sets = {
        "heldout": {
            "prompts": heldout,
            "source": {"file": str(cfg.data.path), "last_conversations": cfg.data.num_heldout},
        },
        **suites.load_suites(cfg),
    }
    # 2. Plain once, then once per chain, through the same launch/readiness/stop code.
    with gpu_host(cfg):
        result = benchmark_serving_for(cfg)(cfg, drafter_dir, sets)
    # 3. Record it beside the run; on eyas-local a changed greedy output fails the run (after
    # recording).
    write_json_atomic(Path(cfg.run_dir) / "serve_bench.json", asdict(result))
    create_markdown_artifact(
        key=artifact_key("serve-bench", cfg.name),
        markdown=serve_bench.markdown(result),
        description="acceptance and serving speed with vs without the drafter",
    )
    serve_bench.check_outputs(cfg, result)
    return result


if __name__ == "__main__":
    serve_bench_flow(sys.argv[1], drafter_dir=sys.argv[2] if len(sys.argv) > 2 else None)
