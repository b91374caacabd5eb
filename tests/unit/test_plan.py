"""The plan's figures: shard bytes per token (FP8 about half), tokens counted as prepare-data counts
them (estimated on a large file), and the training memory model against measured peaks."""

from __future__ import annotations

import pytest

from eyas.extraction import data
from eyas.plan import count_tokens, trainable_params, training_memory
from eyas.preflight import preflight
from eyas.target import load_tokenizer
from tests.tiny_config import CONVERSATIONS, TINY, tiny


def test_fp8_halves_the_bytes(tmp_path):
    plain = preflight(tiny(tmp_path)).plan
    fp8 = preflight(tiny(tmp_path, **{"extraction.encoding": "fp8_e4m3"})).plan
    assert (
        fp8.bytes_per_token == 4 * (256 + 4) + 5
        and 0.5 < fp8.total_bytes / plain.total_bytes < 0.53
    )


def test_tokens_counted_as_prepare_counts_them_and_estimated_when_large(tmp_path):
    cfg = tiny(tmp_path)
    tok = load_tokenizer(TINY)
    records, _ = data.load_records(CONVERSATIONS, vocab_size=4096)
    prepared = data.prepare(records, tok, cfg.data, vocab_size=4096)
    exact = count_tokens(cfg.data, tok, vocab_size=4096)
    assert exact.sequences == len(prepared.train) and exact.tokens == sum(
        len(s.input_ids) for s in prepared.train
    )
    estimated = count_tokens(
        cfg.data, tok, vocab_size=4096, small_bytes=0
    )  # as if the file were large
    assert "estimated" in estimated.source and abs(estimated.tokens / exact.tokens - 1) < 0.15
    assert abs(estimated.sequences - exact.sequences) <= 1
    no_tokenizer = count_tokens(cfg.data, None, vocab_size=4096)  # the documented ratio: errs high
    assert 1.0 < no_tokenizer.tokens / exact.tokens < 1.3


def test_training_memory_matches_the_h200_measurements():
    from eyas.training.drafter import DrafterConfig

    kimi = DrafterConfig(
        hidden_size=7168,
        target_hidden_size=7168,
        num_attention_heads=64,
        num_key_value_heads=64,
        head_dim=128,
        intermediate_size=18432,
        vocab_size=163840,
        draft_vocab_size=32000,
    )
    for batch, measured_gb in [(1, 34.1), (2, 43.2), (4, 61.4), (8, 97.9)]:  # docs/performance.md
        parts = training_memory(
            kimi, vocab_size=163840, batch_size=batch, seq_len=4096, ttt_steps=7, bf16=True
        )
        assert abs(sum(v for _, v in parts) / measured_gb - 1) < 0.07, (batch, parts)
    plain, ema = (
        dict(
            training_memory(
                kimi, vocab_size=163840, batch_size=1, seq_len=4096, ttt_steps=7, bf16=True, ema=e
            )
        )
        for e in (False, True)
    )  # training.ema_decay: 4 B a weight more
    assert ema["weights+Adam"] - plain["weights+Adam"] == pytest.approx(
        4 * trainable_params(kimi) / 1e9, abs=2e-3
    )
