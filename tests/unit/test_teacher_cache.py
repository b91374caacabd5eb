"""The teacher cache lays out a batch's labels exactly as the teacher computes them per batch."""

import pytest
import torch

from eyas.training.batches import ShardData, collate
from eyas.training.kernels import KernelOptions
from eyas.training.losses import draft_first_order, teacher_labels
from eyas.training.target_head import TargetHead
from eyas.training.teacher_cache import TeacherCache

VD = 128


@pytest.fixture(scope="module")
def uneven(sharp_target, tmp_path_factory):
    """Shards of 24- and 40-token sequences: batches of both are right-padded."""
    from tests.helpers_training import write_shards
    return [write_shards(sharp_target, tmp_path_factory.mktemp(f"len{n}"), num_shards=1, per_shard=4, length=n,
                         seed=n)[0] for n in (24, 40)]


@pytest.mark.parametrize("kernels", [KernelOptions(), KernelOptions(skip_rows=False),
                                     KernelOptions(skip_unscored=False)], ids=["rows", "span", "everywhere"])
def test_cached_labels_equal_the_teachers_on_every_scored_position(uneven, sharp_target, kernels):
    data = ShardData(uneven, num_heldout=2)
    head = TargetHead.from_checkpoint(sharp_target, last_hidden_norm="post")
    V = head.weight.shape[0]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=torch.Generator().manual_seed(0))[:VD]] = True
    head.reorder(draft_first_order(t2d))
    teacher = lambda b: teacher_labels(head, b["last"], b["loss_mask"], VD, kernels=kernels)  # noqa: E731
    cache = TeacherCache.build(data, teacher, VD, torch.float32, budget_gb=1.0, kernels=kernels)
    assert cache is not None and len(cache.probs) == len(data.lengths)
    ids = [5, 0, 4, 1]  # 40, 24, 40, 24 tokens: right padding in the batch
    assert sorted({data.lengths[i] for i in ids}) == [24, 40]
    batch = collate([data.sample(i) for i in ids], torch.device("cpu"), ids=ids)
    want, got = teacher(batch), cache.labels(batch)
    assert torch.equal(got.scored, want.scored) and torch.equal(got.valid, want.valid) and got.span == want.span
    s = want.scored
    assert torch.equal(got.target[s], want.target[s])
    assert torch.equal(got.probs.view(*s.shape, VD)[s], want.probs.view(*s.shape, VD)[s])
    if kernels.skip_unscored:  # the sequence alone: nothing where it scores nothing
        assert float(got.probs.view(*s.shape, VD)[~s].abs().sum()) == 0.0


def test_over_budget_gives_none(shards):
    data = ShardData(shards, num_heldout=2)
    need = TeacherCache.nbytes(data, VD, torch.float32)
    assert need == sum(data.lengths) * VD * 4
    assert TeacherCache.build(data, lambda b: None, VD, torch.float32, budget_gb=need / 2**30 / 2,
                              kernels=KernelOptions()) is None
