"""The teacher, remembered across epochs: its whole labels where they fit (CPU training), else the
one bit per position a later epoch cannot get from the draft vocabulary's rows alone.

    cache = TeacherCache.build(data, teacher, device, dtype, budget_gb=2.0)   # None: too large
    labels = cache.labels(batch)        # a Batch from collate, with sample_ids

    memo = ArgmaxMemo(data.lengths, device)             # 1 byte a token
    labels = memo.labels(batch, teacher)  # teacher(batch, outside=None | (B, T) bool) -> Labels
    memo.share()                          # at an epoch's end, on every rank: all ranks' bits to all

The teacher (the target's lm_head over the stored last hidden states, losses.teacher_labels) gives a
sequence the same labels every epoch. The embedded default trains ~15 epochs over 468 sequences, and
the teacher's fp32 GEMM and argmax over the full vocabulary are ~10% of its CPU step: computed once
and gathered per batch, they cost a copy. At production scale the labels would take terabytes
(tokens x draft vocabulary x 4 bytes), and on a GPU the teacher is one GEMM beside the transfer a
cache would need, so there they are computed per batch, and ArgmaxMemo keeps what makes most of
that GEMM needless after the first epoch (below).
"""

from __future__ import annotations

import itertools
from typing import Callable

import torch
import torch.distributed as dist

from eyas.training.batches import Batch, ShardData, collate
from eyas.training.losses import Labels
from eyas.training.step_rows import scored_span


class TeacherCache:
    """Per sequence: the teacher's distribution over the draft vocabulary and its argmax as a draft
    id."""

    def __init__(self, probs: list[torch.Tensor], target: list[torch.Tensor]):
        self.probs = (
            probs  # [i] (n_i, V_d): predicting token t+1 of sequence i; zeros where unscored
        )
        self.target = (
            target  # [i] (n_i,): the argmax as a draft id, -1 outside the draft vocab or unscored
        )

    @staticmethod
    def nbytes(data: ShardData, num_draft: int, dtype: torch.dtype) -> int:
        return sum(data.lengths) * num_draft * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def build(
        cls,
        data: ShardData,
        teacher: Callable[[Batch], Labels],
        num_draft: int,
        dtype: torch.dtype,
        budget_gb: float,
    ) -> "TeacherCache | None":
        """Every sequence's labels through `teacher` (a batch of one each), or None above
        budget_gb."""
        if cls.nbytes(data, num_draft, dtype) > budget_gb * 2**30:
            return None
        probs, target = [], []
        for i in range(len(data.lengths)):
            batch = collate([data.sample(i)], torch.device("cpu"), dtype)
            lab = teacher(batch)
            probs.append(lab.probs.clone())  # (n, V_d): B = 1, so rows are positions
            target.append(lab.target[0].clone())
        return cls(probs, target)

    def labels(self, batch: Batch) -> Labels:
        """The batch's labels, laid out as teacher_labels lays them out (right-padded rows)."""
        ids, mask = batch.sample_ids, batch.loss_mask
        B, T = mask.shape
        V = self.probs[0].shape[1]
        probs = torch.zeros(B, T, V, dtype=self.probs[0].dtype)
        target = torch.full((B, T), -1, dtype=torch.long)
        for b, i in enumerate(ids):
            n = len(self.target[i])
            probs[b, :n], target[b, :n] = self.probs[i], self.target[i]
        scored = torch.zeros_like(mask, dtype=torch.bool)
        scored[:, :-1] = mask[:, 1:].bool()  # the target at t predicts token t+1
        return Labels(
            probs.view(B * T, V), target, scored & (target >= 0), scored, scored_span(scored)
        )


class ArgmaxMemo:
    """Per position of every sequence, whether the teacher's full-vocabulary argmax lies outside the
    draft vocabulary, from the first time the teacher labels that sequence.

    The teacher's labels need the draft vocabulary's logits (the softmax) and, of the rest of the
    target's vocabulary, only that bit (whether one of its logits beats the draft vocabulary's
    best): at Kimi-K2.5's 32,000 of 163,840 that bit costs four fifths of the teacher's GEMM, 4-5%
    of a training step, every epoch. The stored last hidden states, the loss mask and the target's
    head do not change between epochs, so neither does the bit: a sequence's later epochs read it
    here (losses.teacher_labels(outside=...)) and get the same labels, bit for bit, wherever a
    position is scored (no other label is read). 1 byte a token on the device (17 MB for 17.3M
    tokens). Empty after a resume: the rest of that epoch computes and remembers again.
    """

    def __init__(self, lengths: list[int], device):
        self.offsets = [
            0,
            *itertools.accumulate(lengths),
        ]  # sequence i holds [offsets[i], offsets[i + 1])
        self.bits = torch.zeros(
            self.offsets[-1], dtype=torch.uint8, device=device
        )  # 1: argmax outside
        self.known = torch.zeros(len(lengths), dtype=torch.bool)  # (N,) on the CPU: no sync to ask

    def labels(self, batch: Batch, teacher: Callable[..., Labels]) -> Labels:
        """The teacher's labels of a collated batch (with sample_ids): the bit from here where every
        sequence of the batch has one, else computed in full and remembered."""
        ids = batch.sample_ids
        if bool(self.known[ids].all()):
            return teacher(batch, outside=self._outside(ids, batch.loss_mask.shape))
        lab = teacher(batch, outside=None)
        # target -1: outside the draft vocabulary, or not labelled at all (then it stays unlabelled)
        self._remember(ids, lab.target < 0)
        return lab

    def _outside(self, ids: list[int], shape) -> torch.Tensor:
        out = torch.ones(
            shape, dtype=torch.bool, device=self.bits.device
        )  # (B, T); padding: nothing to label
        for b, i in enumerate(ids):
            s, e = self.offsets[i], self.offsets[i + 1]
            out[b, : e - s] = self.bits[s:e].bool()
        return out

    def _remember(self, ids: list[int], outside: torch.Tensor) -> None:
        for b, i in enumerate(ids):
            s, e = self.offsets[i], self.offsets[i + 1]
            self.bits[s:e] = outside[b, : e - s]
        self.known[ids] = True

    def share(self) -> None:
        """Every rank's bits to every rank (collective: all ranks call it at the same step). Each
        rank remembers the sequences it labelled; the next epoch deals them out to the ranks
        anew."""
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return
        dist.all_reduce(self.bits, op=dist.ReduceOp.MAX)
        known = self.known.to(self.bits.device, torch.uint8)
        dist.all_reduce(known, op=dist.ReduceOp.MAX)
        self.known = known.cpu().bool()
