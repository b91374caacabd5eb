import pytest
import torch

from eyas.config import EvaluationConfig, ExportConfig
from eyas.evaluation.evaluate import evaluate_acceptance
from eyas.evaluation.export import export_drafter
from eyas.training.train import train_drafter
from tests.helpers_training import (
    CAPTURE,
    shard_meta,
    sharpen_target,
    target_config,
    target_samples,
    training_config,
    write_shards,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(random_target, tmp_path_factory):
    target = sharpen_target(random_target, tmp_path_factory.mktemp("sharp"))
    shards = write_shards(
        target, tmp_path_factory.mktemp("shards"), num_shards=1, per_shard=16, length=32
    )
    r = train_drafter(
        training_config(tmp_path_factory.mktemp("train"), max_steps=20),
        target_config(target),
        shards,
        log=lambda _: None,
    )
    drafter = export_drafter(
        r,
        tmp_path_factory.mktemp("x") / "drafter",
        target=target_config(target),
        export=ExportConfig(dtype="bfloat16"),
        shard_meta=shard_meta(),
    )
    prompts = [s.input_ids[:10].tolist() for s in target_samples(target, 3, 10, seed=5)]
    return target, drafter, prompts


@pytest.mark.parametrize("draft_steps", [1, 3])
def test_output_is_identical_to_target_only_greedy(setup, draft_steps):
    target, drafter, prompts = setup
    res = evaluate_acceptance(
        drafter,
        target,
        prompts,
        EvaluationConfig(draft_steps=draft_steps, max_new_tokens=12),
        CAPTURE,
    )
    assert res.identical_to_target and all(p["identical"] for p in res.per_prompt)
    assert res.num_prompts == 3 and res.total_new_tokens == 36
    # every verify step yields 1..draft_steps+1 tokens; the prefill yields the first
    assert 33 / (draft_steps + 1) <= res.verify_steps <= 33
    assert (
        res.acceptance_length == pytest.approx(36 / res.verify_steps)
        and res.acceptance_length >= 1.0
    )


def test_3_1_4_and_7_1_8_in_one_evaluation(setup):
    target, drafter, prompts = setup
    res = evaluate_acceptance(
        drafter, target, prompts, EvaluationConfig(draft_steps=[3, 7], max_new_tokens=10), CAPTURE
    )
    assert list(res.settings) == ["3/1/4", "7/1/8"] and res.setting == "3/1/4"
    for s in res.settings.values():
        assert s["identical_to_target"] and s["total_new_tokens"] == 30
        assert 1.0 <= s["acceptance_length"] <= 8.0
    assert res.acceptance_length == res.settings["3/1/4"]["acceptance_length"]


def test_single_token_needs_no_verify_and_layers_must_match(setup):
    target, drafter, prompts = setup
    res = evaluate_acceptance(
        drafter, target, prompts[:1], EvaluationConfig(max_new_tokens=1), CAPTURE
    )
    assert res.verify_steps == 0 and res.total_new_tokens == 1 and res.identical_to_target
    with pytest.raises(ValueError, match="reads layers"):
        evaluate_acceptance(drafter, target, prompts, EvaluationConfig(), [2, 4, 6])
