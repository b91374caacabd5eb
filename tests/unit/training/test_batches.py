"""Batches: the length-aware epoch plan, collate and the shift, the training-only aux noise."""

import torch

from eyas.training.batches import Batch, add_aux_noise, collate, epoch_plan
from tests.helpers_training import shift_left

torch.set_num_threads(1)


def test_epoch_plan_is_length_aware_and_the_same_for_any_split():
    lengths = [5, 50, 7, 48, 9, 46, 11, 44, 13, 42, 15, 40, 3]
    ids = list(range(13))
    a = epoch_plan(
        lengths, ids, micro=2, num_micro=2, seed=0, epoch=0, window=3
    )  # 1 rank x 2 accum
    b = epoch_plan(lengths, ids, micro=4, num_micro=1, seed=0, epoch=0, window=3)  # one micro-batch
    assert len(a) == len(b) == 3  # 13 // 4 global batches; the rest is dropped
    assert [sorted(x for m in s for x in m) for s in a] == [sorted(s[0]) for s in b]
    for step in a:
        assert all(len(m) == 2 for m in step)
        ls = [lengths[i] for m in step for i in m]
        assert ls == sorted(ls, reverse=True)  # longest first: a micro-batch pads little
    assert epoch_plan(lengths, ids, 2, 2, seed=0, epoch=1, window=3) != a  # a new order every epoch


def test_aux_noise_is_relative_per_layer_and_off_at_zero():
    g = torch.Generator().manual_seed(0)
    aux = torch.cat(
        [torch.randn(2, 50, 8, generator=g) * s for s in (1.0, 10.0, 100.0)], -1
    )  # 3 layers of H=8
    ids = torch.zeros(2, 50, dtype=torch.long)
    batch = Batch(ids, ids.bool(), aux.clone(), torch.zeros(2, 50, 8))
    assert torch.equal(add_aux_noise(batch, 0.0).aux, aux)
    noisy = add_aux_noise(batch, 0.1).aux
    assert torch.equal(batch.aux, aux)  # a new Batch: the one given is unchanged
    for k, scale in enumerate((1.0, 10.0, 100.0)):  # noise std ~ 0.1 x each layer's own RMS
        d = (noisy - aux)[..., 8 * k : 8 * (k + 1)]
        assert 0.07 * scale < float(d.std()) < 0.13 * scale


def test_collate_and_shift(shards):
    from eyas.extraction.shards import ShardReader

    r = ShardReader(shards[0])
    b = collate([r.sample(0), r.sample(1)], torch.device("cpu"))
    assert (
        b.ids.shape == (2, 40)
        and b.aux.shape == (2, 40, 192)
        and b.aux.dtype == torch.float32
        and b.last.shape[:2] == (2, 40)
        and b.sample_ids is None
    )
    x = torch.arange(5)[None]
    assert shift_left(x, 2).tolist() == [[2, 3, 4, 0, 0]]
