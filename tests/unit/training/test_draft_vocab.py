import pytest
import torch

from eyas.extraction.shards import Sample, ShardReader, write_shard
from eyas.training.draft_vocab import build_draft_vocab, count_tokens


def test_most_frequent_tokens_with_offsets_and_mask():
    counts = torch.zeros(10, dtype=torch.long)
    counts[[7, 2, 9, 4]] = torch.tensor([50, 40, 40, 1])
    d2t, t2d = build_draft_vocab(counts, 10, 3)
    chosen = torch.arange(3) + d2t
    assert chosen.tolist() == [2, 7, 9]  # ascending target ids; the tie 2/9 at 40 both fit
    assert d2t.dtype == torch.long and t2d.dtype == torch.bool
    assert t2d.nonzero().flatten().tolist() == [2, 7, 9]


def test_ties_go_to_the_smaller_id_deterministically():
    counts = torch.tensor([0, 5, 5, 5, 5, 9])
    for _ in range(3):
        d2t, _ = build_draft_vocab(counts, 6, 3)
        assert (torch.arange(3) + d2t).tolist() == [1, 2, 5]


def test_fills_to_exactly_n_when_few_tokens_were_seen():
    d2t, t2d = build_draft_vocab({8: 3, 5: 1}, 10, 4)
    assert (torch.arange(4) + d2t).tolist() == [0, 1, 5, 8]
    assert int(t2d.sum()) == 4 and d2t.shape == (4,)


def test_counts_only_loss_masked_tokens_of_shards(tmp_path):
    ids = torch.tensor([3, 3, 3, 4, 5, 5])
    mask = torch.tensor([1, 1, 1, 0, 0, 1], dtype=torch.bool)
    s = Sample(ids, mask, torch.zeros(6, 6), torch.zeros(6, 2))
    p = tmp_path / "shard-00000.safetensors"
    write_shard(p, [s, s], {})
    assert count_tokens([ShardReader(p)], 8).tolist() == [0, 0, 0, 6, 0, 2, 0, 0]
    d2t, _ = build_draft_vocab([p], 8, 2)
    assert (torch.arange(2) + d2t).tolist() == [3, 5]


def test_bad_input_is_refused(tmp_path):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_draft_vocab(torch.zeros(4, dtype=torch.long), 4, 5)
    with pytest.raises(ValueError, match="outside the target vocab"):
        build_draft_vocab({12: 1}, 10, 2)
    p = tmp_path / "shard-00000.safetensors"
    write_shard(
        p,
        [Sample(torch.tensor([99]), torch.tensor([True]), torch.zeros(1, 6), torch.zeros(1, 2))],
        {},
    )
    with pytest.raises(ValueError, match="outside the target vocab"):
        count_tokens([p], 10)
