"""eyas/report.py: what a re-run reports of the work it reused, and the figures' honesty."""

import json

from eyas.evaluation.evaluate import EvalResult
from eyas.extraction.shards import ShardManifest
from eyas.report import build_report, extraction_summary, training_summary
from eyas.results import Extracted, Trained
from eyas.server.readiness import ReadyReport
from eyas.server.sglang_patch import PatchReport
from eyas.training.progress import StepStats
from eyas.training.train import TrainResult


def _manifest(i: int, reused: bool) -> ShardManifest:
    return ShardManifest(
        file=f"shard-{i:05d}.safetensors",
        num_samples=2,
        num_tokens=100,
        bytes=1000,
        sha256="0" * 64,
        dtype="bfloat16",
        encoding="plain",
        hidden_size=8,
        num_aux_layers=3,
        reused=reused,
    )


LOCAL_PATCH = PatchReport(
    "local", "localhost", "not needed", reason="eyas serve-local writes hidden-state dumps itself"
)


def _report(manifests, resumed_from=0, ready=None):
    evaluation = EvalResult(
        acceptance_length=2.0,
        num_prompts=1,
        total_new_tokens=4,
        verify_steps=2,
        identical_to_target=True,
        seconds=1.0,
        setting="3/1/4",
    )
    result = TrainResult(
        final_loss=1.0,
        first_loss=2.0,
        losses=[2.0, 1.0],
        accuracies=[[0.5], [0.6]],
        steps=10,
        tokens=1,
        seconds=1.0,
        checkpoint_dir="/c",
        draft_vocab_size=32,
        resumed_from_step=resumed_from,
    )
    return build_report(
        name="t",
        config_source=None,
        extracted=Extracted(manifests, [], {}, LOCAL_PATCH, ready),
        trained=Trained(result, "/d", evaluation),
        serving=None,
        stages={"extract": 4.0},
    )


def test_the_stages_records_become_json_in_the_report():
    ready = ReadyReport(seconds=3.5, shards_total=8, last_progress=None, log_offset=100)
    report = _report([_manifest(0, False)], ready=ready)
    assert json.loads(json.dumps(report)) == report  # plain JSON, nothing left as a dataclass
    assert report["server"] == {"ready_seconds": 3.5, "shards_total": 8}
    assert report["patch"] == {
        "backend": "local",
        "host": "localhost",
        "status": "not needed",
        "actions": {},
        "reason": "eyas serve-local writes hidden-state dumps itself",
    }
    assert report["evaluation"]["setting"] == "3/1/4" and report["acceptance_length"] == 2.0
    assert report["training"]["steps"] == 10 and report["training"]["history"] == []
    assert _report([_manifest(0, True)])["server"] == {"ready_seconds": None, "shards_total": None}


def test_a_rerun_on_intact_shards_says_so_instead_of_a_rate():
    x = _report([_manifest(i, True) for i in range(4)])["extraction"]
    assert (x["summary"], x["shards_reused"], x["tokens_per_s"]) == ("4/4 shards reused", 4, None)
    x = _report([_manifest(0, False), *(_manifest(i, True) for i in range(1, 4))])["extraction"]
    assert (
        x["summary"] == "1 shards extracted, 3 reused" and x["tokens_per_s"] == 100 / 4.0
    )  # the new one only
    assert extraction_summary([_manifest(0, False)]) == "1 shards extracted"


def test_a_resumed_training_says_from_which_step():
    t = _report([_manifest(0, False)], resumed_from=600)["training"]
    assert (
        t["resumed_from_step"] == 600
        and training_summary(t) == "training resumed from step 600, 10 steps"
    )
    assert training_summary({"steps": 10, "resumed_from_step": 0}) == "10 steps"


def test_no_eta_before_the_rate_is_known():
    def at(step, seconds):
        return StepStats(
            step=step,
            max_steps=100,
            loss=1.0,
            accuracies=(0.5,),
            lr=1e-3,
            tokens=step * 10,
            seconds=seconds,
            start_step=0,
        )

    assert (
        at(1, 30.0).eta_s is None and "ETA -" in at(1, 30.0).describe()
    )  # the first step: compiling
    assert at(2, 32.0).eta_s == 98 * 16.0
