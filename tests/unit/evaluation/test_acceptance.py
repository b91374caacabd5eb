"""The acceptance arithmetic shared by in-process and served evaluation
(eyas/evaluation/acceptance.py)."""

import pytest

from eyas.evaluation.acceptance import chain_name, pooled, prompt_record


def test_chain_names_are_sglangs_steps_topk_draft_tokens():
    assert chain_name(3) == "3/1/4" and chain_name(7) == "7/1/8" and chain_name(5, 4, 8) == "5/4/8"


def test_one_prompt_is_completion_tokens_over_verify_steps():
    rec = prompt_record(
        prompt_tokens=9, output=list(range(10)), verify_steps=4, reference=list(range(10))
    )
    assert rec == {
        "prompt_tokens": 9,
        "new_tokens": 10,
        "verify_steps": 4,
        "acceptance_length": 2.5,
        "identical": True,
        "same_prefix": 10,
    }
    differs = prompt_record(9, [1, 2], 1, reference=[1, 3])
    assert differs["identical"] is False and differs["same_prefix"] == 1
    assert prompt_record(9, [1, 2, 3], 1, reference=[1, 2])["same_prefix"] == 2  # an earlier eos
    assert prompt_record(9, [1, 2], 1)["identical"] is None  # nothing to compare with
    # the prefill's token alone: no verify step, no per-prompt figure
    assert prompt_record(9, [5], 0)["acceptance_length"] is None


def test_pooled_is_the_ratio_of_sums_not_the_mean_of_ratios():
    a = prompt_record(5, [0] * 10, 2, reference=[0] * 10)  # 5.0
    b = prompt_record(5, [0] * 30, 20, reference=[0] * 30)  # 1.5
    fig = pooled([a, b])
    assert fig["acceptance_length"] == pytest.approx(40 / 22)  # not (5.0 + 1.5) / 2
    assert fig["num_prompts"] == 2 and fig["total_new_tokens"] == 40 and fig["verify_steps"] == 22
    # drafts accepted per verify: the prefill token of each prompt and each verify's bonus left out
    assert fig["accepted_per_verify"] == pytest.approx((40 - 2) / 22 - 1)
    assert fig["identical_to_target"] is True and fig["per_prompt"] == [a, b]


def test_pooled_equality_and_the_degenerate_cases():
    same, other = (
        prompt_record(3, [1, 2, 3], 1, reference=[1, 2, 3]),
        prompt_record(3, [1, 2], 1, reference=[1, 9]),
    )
    assert pooled([same, other])["identical_to_target"] is False
    assert (
        pooled([prompt_record(3, [1, 2], 1)])["identical_to_target"] is None
    )  # no reference anywhere
    one_token = pooled([prompt_record(3, [1], 0), prompt_record(4, [2], 0)])
    assert one_token["acceptance_length"] == 1.0 and one_token["accepted_per_verify"] == 0.0
