"""The teacher cache lays out a batch's labels exactly as the teacher computes them per batch."""

import pytest
import torch

from eyas.training.batches import ShardData, collate
from eyas.training.losses import draft_first_order, teacher_labels
from eyas.training.target_head import TargetHead
from eyas.training.teacher_cache import ArgmaxMemo, TeacherCache

VD = 128


@pytest.fixture(scope="module")
def uneven(sharp_target, tmp_path_factory):
    """Shards of 24- and 40-token sequences: batches of both are right-padded."""
    from tests.helpers_training import write_shards

    return [
        write_shards(
            sharp_target,
            tmp_path_factory.mktemp(f"len{n}"),
            num_shards=1,
            per_shard=4,
            length=n,
            seed=n,
        )[0]
        for n in (24, 40)
    ]


def _head_and_data(sharp_target, uneven, seed: int = 1):
    """The shards, and the target's head reordered draft-first for a random draft vocabulary of
    VD."""
    data = ShardData(uneven, num_validation=2)
    head = TargetHead.from_checkpoint(sharp_target, last_hidden_norm="post")
    V = head.weight.shape[0]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:VD]] = True
    return data, head.reorder(draft_first_order(t2d))


def test_cached_labels_equal_the_teachers_on_every_scored_position(uneven, sharp_target):
    data, head = _head_and_data(sharp_target, uneven, seed=0)
    teacher = lambda b: teacher_labels(head, b.last, b.loss_mask, VD)  # noqa: E731
    cache = TeacherCache.build(data, teacher, VD, torch.float32, budget_gb=1.0)
    assert cache is not None and len(cache.probs) == len(data.lengths)
    ids = [5, 0, 4, 1]  # 40, 24, 40, 24 tokens: right padding in the batch
    assert sorted({data.lengths[i] for i in ids}) == [24, 40]
    batch = collate([data.sample(i) for i in ids], torch.device("cpu"), ids=ids)
    want, got = teacher(batch), cache.labels(batch)
    assert (
        torch.equal(got.scored, want.scored)
        and torch.equal(got.valid, want.valid)
        and got.span == want.span
    )
    s = want.scored
    assert torch.equal(got.target[s], want.target[s])
    assert torch.equal(got.probs.view(*s.shape, VD)[s], want.probs.view(*s.shape, VD)[s])
    assert (
        float(got.probs.view(*s.shape, VD)[~s].abs().sum()) == 0.0
    )  # nothing where nothing is scored


def test_over_budget_gives_none(shards):
    data = ShardData(shards, num_validation=2)
    need = TeacherCache.nbytes(data, VD, torch.float32)
    assert need == sum(data.lengths) * VD * 4
    assert (
        TeacherCache.build(data, lambda b: None, VD, torch.float32, budget_gb=need / 2**30 / 2)
        is None
    )


# ----------------------------------------------------------------------------- ArgmaxMemo


def test_memo_labels_equal_the_full_teachers_and_skip_the_rest_of_the_vocabulary(
    uneven, sharp_target, monkeypatch
):
    """A sequence's second epoch reads the argmax's bit from the memo: the rest of the vocabulary's
    GEMM does not run, and every scored position's labels are the first epoch's, bit for bit."""
    from eyas.training import gemm

    data, head = _head_and_data(sharp_target, uneven)
    widths = []
    mm = gemm.mm_f32
    monkeypatch.setattr(gemm, "mm_f32", lambda a, b: widths.append(b.shape[1]) or mm(a, b))
    calls = []

    def teacher(b, outside=None):
        calls.append(outside is not None)
        return teacher_labels(head, b.last, b.loss_mask, VD, chunk=16, outside=outside)

    memo = ArgmaxMemo(data.lengths, torch.device("cpu"))
    ids = [5, 0, 4, 1]  # 40, 24, 40, 24 tokens: right padding in the batch
    batch = collate([data.sample(i) for i in ids], torch.device("cpu"), ids=ids)
    first = memo.labels(batch, teacher)
    V = head.weight.shape[0]
    assert calls == [False] and set(widths) == {VD, V - VD}  # the first time: the whole vocabulary
    assert memo.known[ids].all() and not memo.known[[2, 3]].any()
    s = first.scored
    outside = s & (first.target < 0)
    assert outside.any() and (s & (first.target >= 0)).any()  # both kinds of position occur here
    widths.clear()
    again = memo.labels(
        collate([data.sample(i) for i in ids], torch.device("cpu"), ids=ids), teacher
    )
    assert calls == [False, True] and set(widths) == {VD}  # the draft vocabulary's rows only
    assert torch.equal(again.scored, first.scored) and torch.equal(again.valid, first.valid)
    assert torch.equal(again.target[s], first.target[s]) and again.span == first.span
    assert torch.equal(again.probs.view(*s.shape, VD)[s], first.probs.view(*s.shape, VD)[s])
    # another order, and a batch with one sequence not yet labelled: computed whole, and remembered
    mixed = [1, 2, 5]
    got = memo.labels(
        collate([data.sample(i) for i in mixed], torch.device("cpu"), ids=mixed), teacher
    )
    assert calls[-1] is False and memo.known[2]
    want = teacher(collate([data.sample(i) for i in mixed], torch.device("cpu"), ids=mixed))
    assert torch.equal(got.target[want.scored], want.target[want.scored])


def test_teacher_labels_with_the_whole_vocabulary_as_draft_vocabulary():
    """No rest of the vocabulary: nothing lies outside."""
    g = torch.Generator().manual_seed(3)
    head = TargetHead(torch.randn(24, 8, generator=g), None, 1e-6)
    mask = torch.ones(2, 9, dtype=torch.bool)
    lab = teacher_labels(head, torch.randn(2, 9, 8, generator=g), mask, 24)
    assert (lab.target[lab.scored] >= 0).all() and torch.equal(lab.valid, lab.scored)


def _share_rank(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        memo = ArgmaxMemo([3, 2, 4], torch.device("cpu"))
        mine = [0] if rank == 0 else [2]  # each rank labelled one sequence; nobody sequence 1
        memo._remember(
            mine,
            torch.tensor([[True, False, True, False]])
            if rank == 0
            else torch.tensor([[False, True, True, True]]),
        )
        memo.share()
        torch.save({"bits": memo.bits, "known": memo.known}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_share_gives_every_rank_every_ranks_bits(tmp_path):
    """At an epoch's end each rank holds the bits of the sequences any rank labelled (two gloo
    processes)."""
    import torch.multiprocessing as mp

    mp.spawn(
        _share_rank, args=(f"file://{tmp_path}/rendezvous", str(tmp_path)), nprocs=2, join=True
    )
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["known"].tolist() == [True, False, True]
        assert got["bits"].tolist() == [1, 0, 1, 0, 0, 0, 1, 1, 1]
