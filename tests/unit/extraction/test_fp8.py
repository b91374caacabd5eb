"""FP8 (e4m3) hidden states with one scale per token and layer (written in a shard:
test_shards.py)."""

from __future__ import annotations

import pytest
import torch

from eyas.extraction.fp8 import E4M3, E4M3_MAX, Fp8Error, dequantize, quantize


def test_each_token_and_layer_gets_its_own_scale():
    x = torch.tensor([[1.0, -2.0, 300.0, 0.5], [0.0, 0.0, 1e-3, -4e-3]])
    q, scale = quantize(x, groups=2)
    assert q.dtype == E4M3 and scale.shape == (2, 2)
    # the largest magnitude of each row group maps to the largest e4m3 value, and back exactly
    assert scale.flatten().tolist() == pytest.approx(
        [2.0 / E4M3_MAX, 300.0 / E4M3_MAX, 1.0, 4e-3 / E4M3_MAX]
    )
    back = dequantize(q, scale)
    assert (
        back[0, 2] == pytest.approx(300.0)
        and back[1, 3] == pytest.approx(-4e-3)
        and back[1, :2].eq(0).all()
    )
    assert ((back - x).abs() <= x.abs() * 2**-4 + 1e-12).all()  # 3 mantissa bits
    with pytest.raises(ValueError, match="width 4 is not a multiple of 3 groups"):
        quantize(x, groups=3)


def test_the_error_is_measured_per_layer_and_merged():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 2 * 8, generator=g), torch.randn(7, 2 * 8, generator=g)
    whole, left, right = Fp8Error(2), Fp8Error(2), Fp8Error(2)
    whole.add(torch.cat([a, b]), *quantize(torch.cat([a, b]), 2))
    left.add(a, *quantize(a, 2))
    right.add(b, *quantize(b, 2))
    left.merge(right)
    assert left.summary() == whole.summary()
    s = whole.summary()
    assert s["tokens"] == 12 and len(s["rel_rms"]) == 2 and all(0 < r < 2**-4 for r in s["rel_rms"])
    assert 0.99 < s["min_cosine"] <= 1.0 and s["max_token_rel"] >= max(s["rel_rms"])
