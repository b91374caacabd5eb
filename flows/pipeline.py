"""The eyas pipeline: extract (patch, launch, sense readiness, extract, stop), then train, export,
serve plainly and with the drafter (acceptance length per chain and prompt set, speed-up), report.

    eyas run configs/local-tiny.yaml
    python -m eyas_prefect.flows.pipeline configs/local-tiny.yaml
    prefect deployment run 'eagle3-pipeline/pipeline' --params '{"overrides": {"training.max_steps":
    50}}'

`config` is a path to a YAML config, an inline mapping, or a loaded PipelineConfig; `overrides` are
dotted fields on top (flows/common.py). The stages are subflows an operator can also run alone
(flows/extract.py, flows/train.py, flows/serve.py). The server is stopped as soon as extraction
ends, and by a hook whenever the run fails or crashes, so a failed run never leaves GPUs held.
"""

from __future__ import annotations

import sys

from eyas_prefect.flows.common import (
    DEFAULT_CONFIG,
    STOP_ON_FAILURE,
    ConfigParam,
    Overrides,
    checked_flow,
    resolve_config,
)
from eyas_prefect.flows.extract import extract
from eyas_prefect.flows.serve import run_name
from eyas_prefect.flows.serve_bench import serve_bench_flow
from eyas_prefect.flows.train import train_flow
from eyas_prefect.tasks.preflight import preflight_check
from prefect import flow
from prefect.artifacts import create_markdown_artifact

from eyas.evaluation import suites
from eyas.evaluation.serve_bench import benchmarks_markdown
from eyas.report import Stopwatch, artifact_key, build_report, training_summary, write_report


@flow(name="eagle3-pipeline", flow_run_name=run_name("eagle3"), log_prints=True, **STOP_ON_FAILURE)
@checked_flow
def eagle3_pipeline(
    config: ConfigParam = DEFAULT_CONFIG, overrides: Overrides | None = None
) -> dict:
    """Raise an EAGLE-3 drafter for the configured target, end to end."""
    cfg, stage = resolve_config(config, overrides), Stopwatch()
    # 0. Check the config against the target, hosts and disks before any GPU is touched.
    preflight_check(cfg)
    suites.check_available(cfg)  # a benchmark suite's missing package fails now, not after training
    # 1. Patch, launch, sense readiness, extract the shards, stop the server.
    extracted = extract(cfg)
    # 2. Train, export for SGLang (a small target's acceptance measured in process, if so
    # configured).
    trained = train_flow(cfg, manifests=extracted.manifests, prompts=extracted.prompts)
    # 3. Serve plainly and with the drafter per chain: acceptance per chain and prompt set,
    # speed-up.
    with stage("serve_bench"):  # the wall time of this run (a cached benchmark takes a moment)
        serving = serve_bench_flow(cfg, drafter_dir=trained.drafter_dir, prompts=extracted.prompts)
    # 4. Report: report.json and the run's markdown artifact.
    report = build_report(
        name=cfg.name,
        config_source=config if isinstance(config, str) else None,
        extracted=extracted,
        trained=trained,
        serving=serving,
        stages={**extracted.stages, **trained.stages, **(stage.seconds if serving else {})},
    )
    path = write_report(cfg.run_dir, report)
    create_markdown_artifact(
        key=artifact_key("report", cfg.name),
        markdown=_markdown(report, path),
        description="eyas run report",
    )
    return report


def _markdown(report: dict, path) -> str:
    rows = "\n".join(f"| {k} | {v:.1f} |" for k, v in report["stages_seconds"].items())
    x, t, e = report["extraction"], report["training"], report["evaluation"]
    per_set = benchmarks_markdown(report["benchmarks"]) if report["benchmarks"] else ""
    return (
        f"# eyas run `{report['name']}`\n\n"
        f"**Acceptance length: {report['acceptance_length']:.3f}** at {e['setting']} on "
        f"{e['num_prompts']} held-out prompts ({e['method'].replace('_', '-')})\n\n"
        f"Single-stream speed-up with the drafter: **{report['speedup']}x**\n\n{per_set}\n"
        f"- extraction: {x['summary']}: {x['tokens']} tokens, {x['bytes'] / 1e6:.1f} MB"
        + (f" ({x['tokens_per_s']} tokens/s extracted)" if x["tokens_per_s"] else "")
        + "\n"
        f"- training: loss {t['first_loss']:.3f} -> {t['final_loss']:.3f}, "
        f"{training_summary(t)}\n"
        f"- drafter: `{report['drafter_dir']}`; report: `{path}`\n\n"
        f"| stage | seconds |\n|---|---|\n{rows}\n"
    )


if __name__ == "__main__":
    eagle3_pipeline(sys.argv[1])
