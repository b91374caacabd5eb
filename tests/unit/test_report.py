"""eyas/report.py: what a re-run reports of the work it reused, and the figures' honesty."""

from eyas.report import build_report, extraction_summary, training_summary
from eyas.results import Extracted, Trained
from eyas.training.progress import StepStats


def _manifest(i: int, reused: bool) -> dict:
    return {"file": f"shard-{i:05d}.safetensors", "num_samples": 2, "num_tokens": 100, "bytes": 1000,
            "dtype": "bfloat16", "reused": reused}


def _report(manifests, resumed_from=0):
    evaluation = {"method": "in_process", "setting": "3/1/4", "acceptance_length": 2.0, "num_prompts": 1}
    trained = Trained({"final_loss": 1.0, "first_loss": 2.0, "steps": 10, "tokens": 1, "seconds": 1.0,
                       "resumed_from_step": resumed_from, "history": []}, "/d", evaluation)
    return build_report(name="t", config_source=None, extracted=Extracted(manifests, [], {}, {}),
                        trained=trained, serving=None, stages={"extract": 4.0})


def test_a_rerun_on_intact_shards_says_so_instead_of_a_rate():
    x = _report([_manifest(i, True) for i in range(4)])["extraction"]
    assert (x["summary"], x["shards_reused"], x["tokens_per_s"]) == ("4/4 shards reused", 4, None)
    x = _report([_manifest(0, False), *(_manifest(i, True) for i in range(1, 4))])["extraction"]
    assert x["summary"] == "1 shards extracted, 3 reused" and x["tokens_per_s"] == 100 / 4.0  # the new one only
    assert extraction_summary([_manifest(0, False)]) == "1 shards extracted"


def test_a_resumed_training_says_from_which_step():
    t = _report([_manifest(0, False)], resumed_from=600)["training"]
    assert t["resumed_from_step"] == 600 and training_summary(t) == "training resumed from step 600, 10 steps"
    assert training_summary({"steps": 10, "resumed_from_step": 0}) == "10 steps"


def test_no_eta_before_the_rate_is_known():
    def at(step, seconds):
        return StepStats(step=step, max_steps=100, loss=1.0, accuracies=(0.5,), lr=1e-3, tokens=step * 10,
                         seconds=seconds, start_step=0)
    assert at(1, 30.0).eta_s is None and "ETA -" in at(1, 30.0).describe()  # the first step: compiling
    assert at(2, 32.0).eta_s == 98 * 16.0
