"""The local server's decoding: one sequence of a thinking model played with --think-tokens, and
continuous batching, where concurrent requests decode in shared forwards and get exactly the tokens
they get one at a time (greedy, seeded sampling, stop tokens, uneven lengths)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from eyas.local.batch import Sequence, Think
from eyas.local.engine import Engine, load_model
from tests.local_reference import prompt

PARAMS = dict(
    temperature=0.0,
    ignore_eos=False,
    stop_token_ids=[],
    sampling_seed=None,
    skip_special_tokens=True,
)


def _take(seq: Sequence, logits: torch.Tensor, n: int) -> list[int]:
    for _ in range(n):
        if seq.take(logits):
            break
    return seq.output


def test_the_local_servers_reasoning_span_closes_after_its_budget():
    logits = torch.zeros(16)
    logits[3] = 5.0  # the stop token: the model's favourite
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


@pytest.fixture(scope="module")
def model(random_target):
    torch.set_num_threads(1)
    return load_model(random_target)


def _requests() -> list[tuple[list[int], dict]]:
    """Uneven prompts and lengths; two seeded sampled requests; one stops at a stop token."""
    reqs = [
        (prompt(n, seed), dict(PARAMS, max_new_tokens=m))
        for seed, (n, m) in enumerate([(40, 12), (7, 20), (90, 5), (3, 16), (61, 9), (25, 14)])
    ]
    reqs[1][1].update(temperature=0.9, sampling_seed=11)
    reqs[4][1].update(temperature=1.3, sampling_seed=5)
    return reqs


def test_batched_decoding_gives_the_one_at_a_time_tokens(model):
    reqs = _requests()
    alone = Engine(model, None, chunk_size=16, writer=None, capture_ids=[2])
    want = [alone.generate(ids, f"a{i}", p)["output_ids"] for i, (ids, p) in enumerate(reqs)]
    # a request that stops early: its own greedy output's 3rd token made a stop token
    stop_req = (reqs[0][0], dict(PARAMS, max_new_tokens=12, stop_token_ids=[want[0][2]]))
    reqs.append(stop_req)
    want.append(alone.generate(*stop_req[:1], "stop", stop_req[1])["output_ids"])
    assert want[-1] == want[0][:3]

    batched = Engine(model, None, chunk_size=16, writer=None, capture_ids=[2], max_running=4)
    with ThreadPoolExecutor(len(reqs)) as ex:
        got = list(
            ex.map(lambda ir: batched.generate(ir[1][0], f"b{ir[0]}", ir[1][1]), enumerate(reqs))
        )
    assert [g["output_ids"] for g in got] == want
    assert got[-1]["meta_info"]["finish_reason"] == {"type": "stop", "matched": want[0][2]}
    assert got[2]["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    b = batched.batch
    # every token after a request's first came from a shared step; with 7 requests on 4 rows the
    # steps must have held several rows at once
    assert b.tokens == sum(len(w) - 1 for w in want)
    assert b.steps < b.tokens / 2
    assert batched.num_completion_tokens == sum(len(w) for w in want)


def test_a_failing_step_fails_its_requests_and_the_batch_goes_on(model):
    engine = Engine(model, None, chunk_size=16, writer=None, capture_ids=[2], max_running=2)
    forward, calls = engine.batch.model, []

    def broken_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom in a decode step")
        return forward(*args, **kwargs)

    engine.batch.model = broken_once
    with pytest.raises(RuntimeError, match="boom in a decode step"):
        engine.generate(prompt(10, 1), "x", dict(PARAMS, max_new_tokens=4))
    ok = engine.generate(prompt(10, 1), "y", dict(PARAMS, max_new_tokens=4))["output_ids"]
    assert (
        ok
        == Engine(model, None, chunk_size=16, writer=None, capture_ids=[2]).generate(
            prompt(10, 1), "z", dict(PARAMS, max_new_tokens=4)
        )["output_ids"]
    )


def _prefilled(engine: Engine, ids: list[int], max_new: int, cls=None):
    from eyas.local.batch import Sequence

    logits, cache = engine.prefill(ids, "p")
    return (cls or Sequence)(logits, cache, len(ids), max_new, 0.0, set(), torch.Generator())


def test_a_request_that_cannot_join_fails_instead_of_hanging(model):
    engine = Engine(model, None, chunk_size=16, writer=None, capture_ids=[2], max_running=2)
    bad = _prefilled(engine, prompt(8, 2), 5)
    bad.cache = object()  # no KV layers: laying out the batch cache fails
    with ThreadPoolExecutor(1) as ex:
        with pytest.raises(AttributeError):
            ex.submit(engine.batch.decode, bad).result(timeout=60)
        good = ex.submit(engine.batch.decode, _prefilled(engine, prompt(8, 2), 5)).result(
            timeout=60
        )
    assert (
        good[0]
        == Engine(model, None, chunk_size=16, writer=None, capture_ids=[2]).generate(
            prompt(8, 2), "z", dict(PARAMS, max_new_tokens=5)
        )["output_ids"]
    )


def test_one_requests_sampling_error_fails_that_request_only(model):
    from eyas.local.batch import Sequence

    class FailsOnThirdToken(Sequence):
        def take(self, logits):
            if len(self.output) == 2:
                raise ValueError("bad sampling")
            return super().take(logits)

    engine = Engine(model, None, chunk_size=16, writer=None, capture_ids=[2], max_running=2)
    bad, good = (
        _prefilled(engine, prompt(9, 3), 6, FailsOnThirdToken),
        _prefilled(engine, prompt(12, 4), 6),
    )
    with ThreadPoolExecutor(2) as ex:
        fb, fg = ex.submit(engine.batch.decode, bad), ex.submit(engine.batch.decode, good)
        with pytest.raises(ValueError, match="bad sampling"):
            fb.result(timeout=60)
        assert len(fg.result(timeout=60)[0]) == 6
