"""The local server's command line: SGLang's flags, checked before anything loads."""

from __future__ import annotations

import pytest

from eyas.local.arguments import parse_args
from tests.local_reference import SPEC_FLAGS


def test_parse_args_checks():
    args = parse_args(
        ["--model-path", "m", "--return-aux-hidden-state-layer-ids", "2", "4", "--tp", "2"]
    )
    assert args.return_aux_hidden_state_layer_ids == [2, 4] and args.tp_size == 2
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--chunked-prefill-size", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "m", "--return-aux-hidden-state-layer-ids", "2", "2"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--speculative-num-draft-tokens", "5"], "must be num-steps"),
        (["--speculative-eagle-topk", "2"], "topk 1"),
        (["--enable-return-aux-hidden-states"], "cannot be combined"),
    ],
)
def test_speculative_flags_are_checked(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(
            ["--model-path", "x", *SPEC_FLAGS, "--speculative-draft-model-path", "d", *flags]
        )
    assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model-path", "x", "--speculative-draft-model-path", "d"])  # no EAGLE3
    args = parse_args(
        [
            "--model-path",
            "x",
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            "d",
            "--speculative-num-steps",
            "7",
        ]
    )
    assert args.speculative_num_draft_tokens == 8
