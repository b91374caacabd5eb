"""Subflow: train the drafter on extracted shards, export it for SGLang (and, for a small target
with `evaluation.method: in_process`, measure its acceptance here).

    prefect deployment run 'eyas-train/train'     # on the shards already in extraction.output_dir

Alone it reads the shard manifests from disk (each checked against its file size) and the
held-out prompts from the data; inside the pipeline it gets both from `extract`. With the default
`evaluation.method: server` the acceptance is measured by serving the drafter
(flows/serve_bench.py), and this flow never loads the target.
"""

# No `from __future__ import annotations`: Prefect builds the run's parameter model from these
# annotations, and from the string `list[ShardManifest]` it fails ("Train_FlowModel is not fully
# defined").
from pathlib import Path

from eyas_prefect.flows.common import (
    DEFAULT_CONFIG,
    ConfigParam,
    Overrides,
    checked_flow,
    resolve_config,
)
from eyas_prefect.flows.serve import run_name
from eyas_prefect.tasks.extract import extraction_context, prepare_data
from eyas_prefect.tasks.preflight import preflight_check
from eyas_prefect.tasks.train import evaluate_for, export, train
from prefect import flow
from prefect.events import emit_event

from eyas.extraction.shards import ShardManifest, verify_shard
from eyas.report import Stopwatch
from eyas.results import Trained


@flow(name="eyas-train", flow_run_name=run_name("train"), log_prints=True)
@checked_flow
def train_flow(
    config: ConfigParam = DEFAULT_CONFIG,
    overrides: Overrides | None = None,
    manifests: list[ShardManifest] | None = None,
    prompts: list[list[int]] | None = None,
) -> Trained:
    """Train (resuming from the newest checkpoint), export, evaluate in process if so configured."""
    cfg, stage = resolve_config(config, overrides), Stopwatch()
    preflight_check(cfg)
    if manifests is None:
        manifests = _manifests_on_disk(Path(cfg.extraction.output_dir))
    in_process = cfg.evaluation.method == "in_process"
    if prompts is None and in_process:
        with (
            extraction_context() as ctx
        ):  # the held-out prompts, planned as the extraction plans them
            prompts = prepare_data(ctx, cfg).prompts
    with stage("train"):
        trained = train(cfg, manifests)
    with stage("export"):
        drafter_dir = export(cfg, trained, manifests[0])
    emit_event(
        event="eyas.training.drafter.exported",
        resource={"prefect.resource.id": f"eyas.run.{cfg.name}"},
        payload={"drafter_dir": drafter_dir},
    )
    evaluation = None  # method server: measured by serving the drafter (flows/serve_bench.py)
    if in_process:
        with stage("evaluate"):
            evaluation = evaluate_for(cfg)(cfg, drafter_dir, prompts)
    return Trained(trained, drafter_dir, evaluation, stage.seconds)


def _manifests_on_disk(folder: Path) -> list[ShardManifest]:
    shards = sorted(folder.glob("shard-*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"no shards in {folder}: run the extract flow first")
    return [ShardManifest.from_json(verify_shard(p, full=False)) for p in shards]
