"""The run report: runs/<name>/report.json, the one summary every later tool reads.

The stages' records (eyas/results.py) become JSON here and nowhere earlier."""

from __future__ import annotations

import re
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eyas import __version__
from eyas.files import write_json_atomic
from eyas.results import Extracted, Trained

if TYPE_CHECKING:  # both modules import torch; the report needs only their records' shapes
    from eyas.evaluation.serve_bench import ServeBenchResult
    from eyas.extraction.shards import ShardManifest


def artifact_key(prefix: str, name: str) -> str:
    """A Prefect artifact key for a run name: Prefect takes lowercase letters, digits and dashes
    only, while run names may also hold capitals, '_' and '.' ("Kimi_K2.5" -> "load-kimi-k2-5")."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{prefix}-{name}".lower())


class Stopwatch:
    """Seconds per named stage, in the order the stages first ran (a stage run twice adds up)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str):
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.seconds[stage] = round(self.seconds.get(stage, 0.0) + time.monotonic() - t0, 3)


def served_evaluation(serving: ServeBenchResult) -> dict[str, Any]:
    """The evaluation section of a served measurement: the held-out prompts' figures per chain."""
    settings = {chain: c["sets"]["heldout"] for chain, c in serving.chains.items()}
    head = settings[serving.headline_chain]
    return {
        "method": "server",
        "setting": serving.headline_chain,
        **{
            k: head[k]
            for k in (
                "acceptance_length",
                "num_prompts",
                "total_new_tokens",
                "verify_steps",
                "accepted_per_verify",
            )
        },
        "identical_to_target": all(
            s["identical_to_target"] is not False for s in settings.values()
        ),
        "settings": settings,
    }


def regeneration_section(data_stats: dict) -> dict[str, Any] | None:
    """report.json's `regeneration`: what data.regenerate made of the training data (None: not
    regenerated).

    `reasoning_tokens` are the tokens of the target's replies inside their <think> spans, counted
    from the token ids the server returned (0 for a target served without thinking); `output_tokens`
    all of the replies' tokens, so reasoning_tokens / output_tokens is the share of training replies
    that is reasoning. `server_reasoning_tokens`: SGLang's own count where its responses carried
    one."""
    regen = (data_stats or {}).get("regeneration")
    if not regen:
        return None
    keys = (
        "thinking",
        "conversations",
        "regenerated_turns",
        "kept_original_turns",
        "dropped_turns",
        "sequences",
        "output_tokens",
        "reasoning_tokens",
        "unfinished_reasoning_turns",
        "server_reasoning_tokens",
        "parts",
        "parts_reused",
    )
    return {k: regen.get(k) for k in keys if k in regen}


def extraction_section(extracted: Extracted, extract_s: float) -> dict[str, Any]:
    """report.json's `extraction`: the shards, their sequences, tokens and bytes; extract_s is the
    extract stage's seconds."""
    manifests, tokens = extracted.manifests, extracted.num_tokens
    reused = [m for m in manifests if m.reused]
    new_tokens = tokens - sum(m.num_tokens for m in reused)
    return {
        "shards": len(manifests),
        "shards_reused": len(reused),  # intact on disk from an earlier run: not extracted again
        "summary": extraction_summary(manifests),
        "sequences": sum(m.num_samples for m in manifests),
        "tokens": tokens,
        "bytes": sum(m.bytes for m in manifests),
        # over the shards this run extracted; None when it extracted none
        "tokens_per_s": round(new_tokens / extract_s, 1) if extract_s and new_tokens else None,
        "dtype": manifests[0].dtype if manifests else None,
        "relaunches": extracted.relaunches,  # why the server died, each time it was relaunched
    }


#: report.json's `training`: these fields of the TrainResult
TRAINING_KEYS = (
    "final_loss",
    "first_loss",
    "steps",
    "tokens",
    "seconds",
    "draft_vocab_size",
    "simulated_acceptance_length",
    "init_from",
    "resumed_from_step",
    "quarantined",  # damaged checkpoints moved aside before resuming
    "history",
)


def build_report(
    *,
    name: str,
    config_source: str | None,
    extracted: Extracted,
    trained: Trained,
    serving: ServeBenchResult | None,
    stages: dict[str, float],
) -> dict[str, Any]:
    """report.json from the stages' results; `stages` are the seconds of every stage of this run.

    The acceptance figures come from the training flow when it evaluated in process
    (evaluation.method in_process), else from the serving stage.
    """
    from eyas.evaluation.serve_bench import benchmarks

    ready = extracted.ready
    evaluation = asdict(trained.evaluation) if trained.evaluation else served_evaluation(serving)
    return {
        "name": name,
        "eyas_version": __version__,
        "config": config_source,
        "acceptance_length": evaluation["acceptance_length"],  # the first chain's, held-out prompts
        # Single-stream decoding speed with the drafter over without (None: benchmark disabled).
        "speedup": serving.speedup["single_stream_tokens_per_s"]
        if serving and serving.speedup
        else None,
        # Per prompt set (held-out, and each suite): its source, and per chain acceptance and
        # speed-up.
        "benchmarks": benchmarks(serving) if serving else None,
        "serving": asdict(serving) if serving else None,
        "patch": extracted.patch.to_json(),
        "server": {
            "ready_seconds": ready.seconds if ready else None,
            "shards_total": ready.shards_total if ready else None,
        },
        "data": extracted.data_stats,
        # data.regenerate: turns the target answered, and of their tokens the reasoning (<think>)
        # ones
        "regeneration": regeneration_section(extracted.data_stats),
        "extraction": extraction_section(extracted, stages.get("extract") or 0.0),
        # history: the loss table (~100 rows: step, loss, acc per TTT step, lr, tokens/s, held-out)
        "training": {k: getattr(trained.result, k) for k in TRAINING_KEYS},
        "evaluation": evaluation,  # method, the headline chain, every chain's figures
        "drafter_dir": trained.drafter_dir,
        "stages_seconds": stages,
        "total_seconds": round(sum(stages.values()), 3),
    }


def extraction_summary(manifests: list[ShardManifest]) -> str:
    """What this run did of the extraction: "4/4 shards reused", "3 extracted, 1 reused"."""
    reused = sum(1 for m in manifests if m.reused)
    if reused == len(manifests):
        return f"{reused}/{len(manifests)} shards reused"
    return f"{len(manifests) - reused} shards extracted" + (f", {reused} reused" if reused else "")


def training_summary(training: dict) -> str:
    """ "1400 steps", or "training resumed from step 600, 1400 steps"."""
    steps, resumed = training.get("steps"), training.get("resumed_from_step") or 0
    return f"training resumed from step {resumed}, {steps} steps" if resumed else f"{steps} steps"


def write_report(run_dir: str | Path, report: dict[str, Any]) -> Path:
    path = Path(run_dir) / "report.json"
    write_json_atomic(path, report)
    return path
