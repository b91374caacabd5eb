"""Layer ids: each conversion between the two conventions and SGLang's readings, pinned by value,
both ways round, and with the start-at-1 rule SGLang applies to DeepSeek-V2's family."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest

from eyas import dump
from eyas.config import TargetConfig
from eyas.errors import EyasError, InvalidInput
from eyas.layers import (
    CONVENTIONS,
    captured_layer_ids,
    eagle_config_capture_ids,
    server_layer_ids,
    to_capture_before,
    to_output_of,
)

LLAMA = "LlamaForCausalLM"
KIMI = "KimiK25ForConditionalGeneration"  # not in the +1 list: DeepSeek-V2's rule


def test_the_conventions_are_the_same_in_the_config_the_dump_writer_and_here():
    assert CONVENTIONS == ("capture-before", "output-of")
    assert dump.LAYER_CONVENTIONS == CONVENTIONS  # the writer's own copy, inside SGLang
    field = TargetConfig.model_fields["layer_convention"]
    assert get_args(field.annotation) == CONVENTIONS and field.default == "capture-before"


def test_to_capture_before_shifts_output_of_ids_by_one():
    assert to_capture_before([1, 29, 57], "output-of") == [2, 30, 58]
    assert to_capture_before([2, 30, 58], "capture-before") == [2, 30, 58]
    assert to_capture_before((0,), "output-of") == [1]  # any iterable; a list comes back
    ids = [2, 4, 5]
    assert to_capture_before(ids, "capture-before") is not ids  # a copy: callers may keep it


def test_an_unknown_convention_is_refused_not_read_as_capture_before():
    for convention in ("capture_before", "output_of", None, ""):
        with pytest.raises(InvalidInput, match=r"unknown layer_convention") as e:
            to_capture_before([2, 4, 5], convention)
        assert isinstance(e.value, EyasError) and isinstance(e.value, ValueError)
        assert "'capture-before', 'output-of'" in str(e.value)


def test_to_output_of_is_one_less_and_the_embeddings_have_no_layer():
    assert to_output_of([2, 30, 58]) == [1, 29, 57]
    assert to_output_of([0, 1]) == [-1, 0]


@pytest.mark.parametrize("ids", [[2, 30, 58], [1, 3, 4], [0, 5], []])
def test_the_conventions_round_trip(ids):
    assert to_capture_before(to_output_of(ids), "output-of") == ids
    assert to_output_of(to_capture_before(ids, "output-of")) == ids
    assert to_capture_before(ids, "capture-before") == ids


def test_deepseek_v2s_rule_shifts_only_a_list_starting_with_1():
    assert captured_layer_ids([1, 29, 57]) == [2, 30, 58]  # read as output-of ids
    assert captured_layer_ids([2, 30, 58]) == [2, 30, 58]
    assert captured_layer_ids([0, 1, 2]) == [0, 1, 2]  # 1, but not first
    assert captured_layer_ids([1]) == [2]
    assert captured_layer_ids([]) == []
    assert captured_layer_ids([1, 29, 57], KIMI) == [2, 30, 58]


@pytest.mark.parametrize("architecture", dump.PLUS_ONE_ARCHITECTURES)
def test_llamas_rule_shifts_every_id(architecture):
    assert captured_layer_ids([1, 3, 4], architecture) == [2, 4, 5]
    assert captured_layer_ids([2, 4, 5], architecture) == [3, 5, 6]
    assert captured_layer_ids([0, 2], architecture) == [1, 3]


def test_the_ids_to_ask_for_are_what_the_architecture_captures_as_wanted():
    assert server_layer_ids([2, 4, 5], LLAMA) == [1, 3, 4]
    assert server_layer_ids([2, 4, 5]) == [2, 4, 5]
    assert server_layer_ids([2, 30, 58], KIMI) == [2, 30, 58]
    for architecture in (None, KIMI, *dump.PLUS_ONE_ARCHITECTURES):
        for wanted in ([2, 4, 5], [2, 30, 58], [3]):
            asked = server_layer_ids(wanted, architecture)
            assert captured_layer_ids(asked, architecture) == wanted


def test_ids_an_architectures_rule_cannot_give_are_refused():
    # DeepSeek-V2: a list starting with 1 would come back shifted
    with pytest.raises(ValueError, match=r"capture-before layers \[1, 3, 4\] cannot be asked"):
        server_layer_ids([1, 3, 4])
    # Llama: capture-before 0 would need output-of -1
    with pytest.raises(ValueError, match=r"LlamaForCausalLM's rule .*every id by \+1"):
        server_layer_ids([0, 3, 4], LLAMA)
    assert server_layer_ids([1, 3, 4], LLAMA) == [0, 2, 3]  # Llama can: it shifts 0 too


def test_an_eagle_config_list_starting_with_1_is_read_shifted():
    assert eagle_config_capture_ids([1, 29, 57]) == [2, 30, 58]
    assert eagle_config_capture_ids([2, 30, 58]) == [2, 30, 58]
    assert eagle_config_capture_ids([3, 31, 59]) == [3, 31, 59]
    assert eagle_config_capture_ids([0, 1, 2]) == [0, 1, 2]
    # so capture-before ids written as they are survive the reading unless they start with 1
    for capture in ([2, 4, 5], [1, 4, 5]):
        assert (eagle_config_capture_ids(capture) == capture) is (capture[0] != 1)


def test_the_config_converts_here_without_loading_torch():
    """dump.py (the SGLang rule's home) loads torch; the config's conversion must not."""
    probe = (
        "import sys\nfrom eyas.config import TargetConfig\n"
        "t = TargetConfig(checkpoint='x', layer_ids=[1, 3, 4], layer_convention='output-of')\n"
        "print(t.capture_ids(), 'torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.stdout.split("\n")[0] == "[2, 4, 5] False", out.stdout + out.stderr
