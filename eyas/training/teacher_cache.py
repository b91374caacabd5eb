"""The teacher's labels of every sequence, computed once, when they fit in memory (CPU training).

    cache = TeacherCache.build(data, teacher, device, dtype, budget_gb=2.0)   # None: too large
    labels = cache.labels(batch)        # batch from collate, with batch["sample_ids"]

The teacher (the target's lm_head over the stored last hidden states, losses.teacher_labels) gives a
sequence the same labels every epoch. The embedded default trains ~15 epochs over 468 sequences, and
the teacher's fp32 GEMM and argmax over the full vocabulary are ~10% of its CPU step: computed once
and gathered per batch, they cost a copy. At production scale the labels would take terabytes
(tokens x draft vocabulary x 4 bytes), and on a GPU the teacher is one GEMM beside the transfer a
cache would need, so there they are computed per batch as before.
"""

from __future__ import annotations

from typing import Callable

import torch

from eyas.training.batches import ShardData, collate
from eyas.training.kernels import KernelOptions
from eyas.training.losses import Labels, label_span


class TeacherCache:
    """Per sequence: the teacher's distribution over the draft vocabulary and its argmax as a draft id."""

    def __init__(self, probs: list[torch.Tensor], target: list[torch.Tensor], kernels: KernelOptions):
        self.probs = probs    # [i] (n_i, V_d): predicting token t+1 of sequence i; zeros where unscored
        self.target = target  # [i] (n_i,): the argmax as a draft id, -1 outside the draft vocab or unscored
        self.kernels = kernels  # the batch's span is what the teacher would have said

    @staticmethod
    def nbytes(data: ShardData, num_draft: int, dtype: torch.dtype) -> int:
        return sum(data.lengths) * num_draft * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def build(cls, data: ShardData, teacher: Callable[[dict], Labels], num_draft: int, dtype: torch.dtype,
              budget_gb: float, kernels: KernelOptions) -> "TeacherCache | None":
        """Every sequence's labels through `teacher` (a batch of one each), or None above budget_gb."""
        if cls.nbytes(data, num_draft, dtype) > budget_gb * 2**30:
            return None
        probs, target = [], []
        for i in range(len(data.lengths)):
            batch = collate([data.sample(i)], torch.device("cpu"), dtype)
            lab = teacher(batch)
            probs.append(lab.probs.clone())   # (n, V_d): B = 1, so rows are positions
            target.append(lab.target[0].clone())
        return cls(probs, target, kernels)

    def labels(self, batch: dict) -> Labels:
        """The batch's labels, laid out as teacher_labels lays them out (right-padded rows)."""
        ids, mask = batch["sample_ids"], batch["loss_mask"]
        B, T = mask.shape
        V = self.probs[0].shape[1]
        probs = torch.zeros(B, T, V, dtype=self.probs[0].dtype)
        target = torch.full((B, T), -1, dtype=torch.long)
        for b, i in enumerate(ids):
            n = len(self.target[i])
            probs[b, :n], target[b, :n] = self.probs[i], self.target[i]
        scored = torch.zeros_like(mask, dtype=torch.bool)
        scored[:, :-1] = mask[:, 1:].bool()  # the target at t predicts token t+1
        return Labels(probs.view(B * T, V), target, scored & (target >= 0), scored, label_span(scored, self.kernels))
