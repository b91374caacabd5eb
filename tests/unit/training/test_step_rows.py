"""eyas/training/step_rows.py: where a TTT unroll runs. A span and the same positions gathered name
the same token rows, positions and teacher rows, step by step; the choice between them follows
KernelOptions."""

import torch

from eyas.training.kernels import KernelOptions
from eyas.training.losses import Labels
from eyas.training.step_rows import StepRows, step_rows, ttt_rows


def labels_of(scored: torch.Tensor) -> Labels:
    B, T = scored.shape
    return Labels(
        probs=torch.zeros(B * T, 4),
        target=torch.zeros(B, T, dtype=torch.long),
        valid=scored,
        scored=scored,
    )


def test_a_span_and_its_positions_gathered_name_the_same_rows_at_every_step():
    B, T, K, s, e = 2, 11, 3, 3, 9
    span = StepRows(slice(s, e), T)
    b, t = (x.flatten() for x in torch.meshgrid(torch.arange(B), torch.arange(s, e), indexing="ij"))
    rows = StepRows((b, t), T)
    tokens = torch.arange(B * (T + K - 1)).view(B, T + K - 1, 1)  # (B, S, 1): row ids
    for k in range(K):
        a, g = span.at(k), rows.at(k)
        assert torch.equal(tokens[:, a].reshape(-1), tokens[g].reshape(-1))
        if k:
            assert torch.equal(span.positions(k, None).repeat(B), rows.positions(k, None))
    assert span.positions(0, None).tolist() == list(range(e))  # step 0's keys stop at the span
    assert rows.positions(0, None).tolist() == list(range(T))
    (rs, ins), (rg, ing) = span.teacher_rows(K, B, None), rows.teacher_rows(K, B, None)
    assert rs.shape == (K, B, e - s) and ins.shape == (K, 1, e - s) and rg.shape == (K, B * (e - s))
    assert torch.equal(rs.reshape(K, -1), rg)
    assert torch.equal(ins.expand(K, B, e - s).reshape(K, -1), ing)
    assert rg[0, 0] == s + 1 and ing[K - 2, -1] and not ing[K - 1, -1]  # t + 1 + k = T: outside
    assert span.keep == slice(s, None) and span.where is None and span.q_from == s
    assert rows.keep == (b, t) and rows.where == (b, t) and rows.q_from == 0 and rows.keys_end == T
    assert StepRows(slice(0, e), T).keep is None


def test_the_layout_follows_the_kernel_options():
    T, K = 23, 3
    scored = torch.zeros(2, T, dtype=torch.bool)
    scored[0, 8:11], scored[0, 18:21], scored[1, 12:14] = True, True, True
    labels = labels_of(scored)
    b, t = ttt_rows(scored, K)
    gathered = step_rows(labels, 2, T, K, KernelOptions(gather_under=1.0))
    assert gathered.gathered and torch.equal(gathered.rows[1], t)
    span = step_rows(labels, 2, T, K, KernelOptions(gather_under=0.0))
    assert span.rows == slice(5, 20)  # the first scored (8) less K, to the last (20)
    assert step_rows(labels, 2, T, K, KernelOptions(gather_under=0.0, skip_span=False)).rows == (
        slice(0, T)
    )
