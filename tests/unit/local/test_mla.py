"""The absorbed MLA path against transformers' own DeepseekV3Attention: bit for bit where nothing is
cached, to fp32 rounding where keys are (decode steps of left-padded rows, a verify of several
tokens, a later prefill chunk), with the same greedy tokens."""

from __future__ import annotations

import pytest
import torch

from eyas.local.mla import absorb_mla
from tests.local_reference import prompt, reference_model
from tests.tiny_llama import write_tiny_llama


@pytest.fixture(scope="module")
def models(random_target):
    absorbed = reference_model(random_target)
    assert absorb_mla(absorbed) == absorbed.config.num_hidden_layers
    return reference_model(random_target), absorbed


def _two_forwards(model, ids, mask, cached: int):
    """A prefill of ids[:, :cached], then a forward of the rest over its cache -> the second's
    logits."""
    with torch.no_grad():
        first = model(input_ids=ids[:, :cached], attention_mask=mask[:, :cached], use_cache=True)
        positions = (mask.cumsum(1) - 1).clamp(min=0)[:, cached:]
        return first.logits, model(
            input_ids=ids[:, cached:],
            attention_mask=mask,
            position_ids=positions,
            past_key_values=first.past_key_values,
            use_cache=True,
        ).logits


@pytest.mark.parametrize(
    "rows, cached, new",
    [(1, 30, 1), (4, 40, 1), (3, 25, 4), (1, 16, 16)],
    ids=["decode", "decode-padded-rows", "verify", "prefill-chunk"],
)
def test_absorbed_attention_computes_what_transformers_does(models, rows, cached, new):
    plain, absorbed = models
    ids = torch.tensor([prompt(cached + new, seed=10 + r) for r in range(rows)])
    mask = torch.ones_like(ids)
    if rows > 1:
        mask[0, :5] = 0  # a left-padded row, as the decode batch lays its rows out
    first_p, want = _two_forwards(plain, ids, mask, cached)
    first_a, got = _two_forwards(absorbed, ids, mask, cached)
    assert torch.equal(first_a, first_p)  # nothing cached: transformers' own code
    assert not torch.equal(got, want)  # the cached forward took the other path ...
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # ... to the same function
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_model_without_mla_is_left_alone(tmp_path):
    model = reference_model(write_tiny_llama(tmp_path / "llama"))
    assert absorb_mla(model) == 0
