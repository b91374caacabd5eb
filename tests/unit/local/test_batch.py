"""The local server's plain decoding of one sequence: a thinking model played with --think-tokens."""

from __future__ import annotations

import torch

from eyas.local.batch import Sequence, Think


def _take(seq: Sequence, logits: torch.Tensor, n: int) -> list[int]:
    for _ in range(n):
        if seq.take(logits):
            break
    return seq.output


def test_the_local_servers_reasoning_span_closes_after_its_budget():
    logits = torch.zeros(16)
    logits[3] = 5.0   # the stop token: the model's favourite
    logits[12] = 4.0  # then a word
    gen = torch.Generator().manual_seed(0)

    def seq(think):
        return Sequence(logits, None, 4, 8, 0.0, {3}, gen, think=think)

    # Inside the <think> the template opened: 3 reasoning tokens (the stop token is never sampled
    # there), </think>, then the answer, which stops at the stop token.
    think = Think.plan([1, 2, 8], 8, 9, 3)
    assert _take(seq(think), logits, 8) == [12, 12, 12, 9, 3] and think.count == 3
    # A prompt that closed it (thinking off): no span at all.
    assert Think.plan([1, 8, 9], 8, 9, 3) is None
    # A prompt with no open span: the reply opens its own.
    think = Think.plan([1, 8, 9, 12, 3, 2], 8, 9, 2)
    assert _take(seq(think), logits, 8) == [8, 12, 12, 9, 3] and think.count == 2
    # Cut by max_new_tokens inside the span.
    cut = Sequence(logits, None, 4, 2, 0.0, {3}, gen, think=Think.plan([8], 8, 9, 5))
    assert _take(cut, logits, 8) == [12, 12] and cut.finish == {"type": "length", "length": 2}
    # Without --think-tokens the choice is the plain argmax.
    assert _take(seq(None), logits, 8) == [3]
