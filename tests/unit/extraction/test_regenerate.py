"""A regeneration's parts and summary, without a server: a target without thinking keeps its parts'
parameters (so finished parts stay reusable), and the report counts the replies' reasoning
tokens."""

from __future__ import annotations

import json

from eyas.config import RegenerateConfig
from eyas.extraction.regenerate import _params
from eyas.report import regeneration_section


def test_params_of_a_target_without_thinking_are_unchanged_so_its_finished_parts_stay_reusable():
    legacy = {
        "max_new_tokens": 512,
        "temperature": 0.0,
        "seed": 0,
        "stop_token_ids": [3],
        "max_length": 64,
        "target": "t",
    }
    assert _params(RegenerateConfig(), [3], 64, "t") == legacy
    assert _params(RegenerateConfig(thinking=False), [3], 64, "t") == {
        **legacy,
        "thinking": {"thinking": False},
    }


def test_the_report_counts_the_reasoning_tokens_of_the_regenerated_replies():
    assert regeneration_section({"sequences": 3}) is None  # not regenerated
    stats = {
        "regeneration": {
            "format": "eyas-regen/1",
            "thinking": True,
            "regenerated_turns": 6,
            "output_tokens": 60,
            "reasoning_tokens": 24,
            "server_reasoning_tokens": 24,
            "sequences": 7,
            "parts": 2,
        }
    }
    section = regeneration_section(stats)
    assert (
        section["reasoning_tokens"] == 24
        and section["output_tokens"] == 60
        and section["thinking"] is True
    )
    assert "format" not in section and json.dumps(section)
