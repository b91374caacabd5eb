"""The eyas pipeline: patch, launch, sense readiness, extract, train, export, evaluate.

    eyas run configs/local-tiny.yaml
    python -m flows.pipeline configs/local-tiny.yaml

The parameter is the whole typed config (or a path to its YAML), so a run in the Prefect UI shows
exactly what it ran with. The server is stopped as soon as extraction ends, and also when anything
before that fails, so a failed run never leaves GPUs held.
"""

import sys

from prefect import flow, unmapped
from prefect.artifacts import create_markdown_artifact
from prefect.task_runners import ThreadPoolTaskRunner

from eyas.config import PipelineConfig, load_config
from eyas.report import Stopwatch, build_report, write_report
from tasks.extract import extract_shard, prepare_data
from tasks.patch import patch_host
from tasks.server import launch_server, stop_server, wait_until_ready
from tasks.train import evaluate, export, train


@flow(name="eagle3-pipeline", flow_run_name="eagle3-{config.name}", log_prints=True,
      task_runner=ThreadPoolTaskRunner(max_workers=2))
def eagle3_pipeline(config: PipelineConfig) -> dict:
    """Raise an EAGLE-3 drafter for the configured target, end to end."""
    cfg, stage = config, Stopwatch()

    # 1. Data first: a bad input file should fail before a ten-minute server load.
    with stage("prepare"):
        plans, prompts, data_stats = prepare_data(cfg)
    # 2. Patch the server host, 3. launch the server, 4. wait until it is ready.
    with stage("patch"):
        patched = patch_host(cfg)
    with stage("launch"):
        handle = launch_server(cfg)
    try:
        with stage("wait_ready"):
            ready = wait_until_ready(cfg, handle)
        # 5. Extract hidden states, one task per shard.
        with stage("extract"):
            futures = extract_shard.map(unmapped(cfg), plans, unmapped(patched.get("patch_version", "local")))
            manifests = futures.result()
    finally:
        with stage("stop"):
            stop_server(cfg, handle)
    # 6. Train, export in SGLang's format, and measure the exported drafter.
    with stage("train"):
        trained = train(cfg, manifests)
    with stage("export"):
        drafter_dir = export(cfg, trained, manifests[0])
    with stage("evaluate"):
        evaluation = evaluate(cfg, drafter_dir, prompts)

    report = build_report(name=cfg.name, config_source=None, ready=ready, data_stats=data_stats,
                          manifests=manifests, trained=trained, evaluation=evaluation,
                          drafter_dir=drafter_dir, stages=stage.seconds, patch=patched)
    path = write_report(cfg.run_dir, report)
    create_markdown_artifact(key=f"report-{cfg.name}", markdown=_markdown(report, path),
                             description="eyas run report")
    return report


def _markdown(report: dict, path) -> str:
    rows = "\n".join(f"| {k} | {v:.1f} |" for k, v in report["stages_seconds"].items())
    x, t = report["extraction"], report["training"]
    return (f"# eyas run `{report['name']}`\n\n"
            f"**Acceptance length: {report['acceptance_length']:.3f}**\n\n"
            f"- extraction: {x['tokens']} tokens, {x['bytes'] / 1e6:.1f} MB in {x['shards']} shards\n"
            f"- training: loss {t['first_loss']:.3f} -> {t['final_loss']:.3f} in {t['steps']} steps\n"
            f"- drafter: `{report['drafter_dir']}`; report: `{path}`\n\n"
            f"| stage | seconds |\n|---|---|\n{rows}\n")


if __name__ == "__main__":
    eagle3_pipeline(load_config(sys.argv[1]))
