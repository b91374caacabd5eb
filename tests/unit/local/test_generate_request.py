"""A /generate body parsed as SGLang takes it, in process (over HTTP, with the 400 it becomes:
tests/integration/test_local_server.py)."""

from __future__ import annotations

import pytest

from eyas.local.engine import BadRequest
from eyas.local.generate_request import parse_generate, parse_sampling


def test_sampling_defaults_are_sglangs_and_neutral_values_pass():
    assert parse_sampling(None, "sp") == {
        "max_new_tokens": 128,
        "temperature": 1.0,
        "sampling_seed": None,
        "ignore_eos": False,
        "stop_token_ids": [],
        "skip_special_tokens": True,
    }
    assert (
        parse_sampling({"top_p": 1.0, "top_k": -1, "max_new_tokens": 0}, "sp")["max_new_tokens"]
        == 0
    )


@pytest.mark.parametrize(
    "raw, message",
    [
        ([1], "sp must be an object, got list"),
        ({"top_k": 5}, r"sp\.top_k=5 is not supported by eyas-local \(only -1\)"),
        ({"max_new_tokens": True}, r"sp\.max_new_tokens must be an integer >= 0, got True"),
        ({"temperature": -0.5}, r"sp\.temperature must be a number >= 0"),
        ({"sampling_seed": 1.5}, r"sp\.sampling_seed must be an integer"),
        ({"stop_token_ids": [1, "2"]}, r"sp\.stop_token_ids must be a list of integers"),
    ],
)
def test_bad_sampling_params_name_the_field(raw, message):
    with pytest.raises(BadRequest, match=message):
        parse_sampling(raw, "sp")


def test_a_batch_gets_its_rids_and_per_request_sampling():
    reqs, batched = parse_generate(
        {
            "input_ids": [[5, 6], [7]],
            "rid": ["a", "b"],
            "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}],
            "logprob_start_len": -1,
            "log_metrics": True,
        },
        512,
        None,
    )
    assert batched and [(ids, rid, p["max_new_tokens"]) for ids, rid, p in reqs] == [
        ([5, 6], "a", 1),
        ([7], "b", 2),
    ]
    [(ids, rid, _)], batched = parse_generate({"input_ids": [9]}, 512, None)
    assert not batched and ids == [9] and len(rid) == 32  # a fresh rid per request


@pytest.mark.parametrize(
    "body, message",
    [
        ([1], "the request body must be a JSON object, got list"),
        ({"text": "w5"}, "text needs a tokenizer"),
        ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid has 1 entries for 2 sequences"),
        (
            {"input_ids": [[1], [2]], "sampling_params": [{}]},
            "sampling_params has 1 entries for 2 sequences",
        ),
        ({"input_ids": [1], "stream": True}, "stream=True is not supported by eyas-local"),
        ({"input_ids": [[1], []]}, r"input_ids\[1\] must be a non-empty list"),
    ],
)
def test_bad_bodies_are_a_bad_request_naming_the_field(body, message):
    with pytest.raises(BadRequest, match=message):
        parse_generate(body, 512, None)
