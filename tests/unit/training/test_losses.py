"""The objective against plain autograd math: fused head loss, teacher labels, the TTT unroll
(against reference_ttt_loss, the plain unroll) and its skipping."""

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

from eyas.training import gemm
from eyas.training.batches import Batch
from eyas.training.kernels import DEFAULT, KernelOptions
from eyas.training.losses import (
    TTTObjective,
    draft_first_order,
    head_soft_ce,
    reference_ttt_loss,
    scored_counts,
    teacher_labels,
)
from eyas.training.step_rows import ttt_rows, ttt_span
from eyas.training.target_head import TargetHead
from eyas.training.train import optimizer_step
from tests.helpers_training import shift_left
from tests.unit.training.test_drafter import make

torch.set_num_threads(1)


def test_fused_head_loss_matches_log_softmax_cross_entropy():
    g = torch.Generator().manual_seed(0)
    N, H, V, M = 50, 16, 40, 30
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    probs = torch.softmax(torch.randn(M, V, generator=g) * 2, -1)
    rows = torch.randint(0, M, (N,), generator=g)
    row_w = torch.rand(N, generator=g) * (torch.rand(N, generator=g) > 0.3)
    loss, pred = head_soft_ce(h, w, probs, rows, row_w, chunk=16)  # 4 chunks, the last one short
    logits = h @ w.T
    want = -(row_w[:, None] * probs[rows] * F.log_softmax(logits, -1)).sum()
    torch.testing.assert_close(loss, want)
    assert torch.equal(pred, logits.argmax(-1))
    for a, b in zip(torch.autograd.grad(loss * 3, [h, w]), torch.autograd.grad(want * 3, [h, w])):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        again, pred2 = head_soft_ce(h, w, probs, rows, row_w, chunk=7)
    torch.testing.assert_close(again, want.detach())
    assert torch.equal(pred2, pred)


def test_cpu_bf16_gemms_pad_rows_and_stay_close_to_fp32():
    """The CPU's bf16 GEMM mode: rows padded to a few cached kernel shapes (zeros that change
    nothing), loss and gradients within bf16 rounding of the fp32 ones, the argmax nearly always the
    same."""
    x = torch.randn(130, 7)
    p = gemm.rows_padded(x, torch.bfloat16)
    assert p.shape == (256, 7) and p.dtype == torch.bfloat16 and not p[130:].any()
    torch.testing.assert_close(p[:130].float(), x, atol=0.02, rtol=0.01)
    assert gemm.rows_padded(torch.randn(256, 3), torch.float32).shape == (256, 3)
    g = torch.Generator().manual_seed(5)
    N, H, V, M = 300, 32, 96, 40
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    probs = torch.softmax(torch.randn(M, V, generator=g), -1)
    rows, row_w = torch.randint(0, M, (N,), generator=g), torch.rand(N, generator=g)
    want, want_pred = head_soft_ce(h, w, probs, rows, row_w, chunk=128)
    loss, pred = head_soft_ce(
        h, w, probs, rows, row_w, chunk=128, gemm_dtype=torch.bfloat16
    )  # 300 -> 384 rows
    assert pred.shape == (N,) and (pred == want_pred).float().mean() > 0.9
    torch.testing.assert_close(loss, want, rtol=1e-2, atol=0)
    for a, b in zip(torch.autograd.grad(loss, [h, w]), torch.autograd.grad(want, [h, w])):
        assert a.dtype == b.dtype and float((a - b).norm() / b.norm()) < 2e-2
    m, ids, aux, labels = _objective_case(torch.ones(3, 23, dtype=torch.bool))
    params = [p for p in m.parameters() if p.requires_grad]
    ref, _, n_ref = TTTObjective(m)(ids, aux, labels, 3, 0.8)
    got, _, n_got = TTTObjective(m, gemm_dtype=torch.bfloat16)(ids, aux, labels, 3, 0.8)
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=0)
    assert torch.equal(n_got, n_ref)
    for a, b in zip(torch.autograd.grad(got, params), torch.autograd.grad(ref, params)):
        assert a.dtype == b.dtype == torch.float32 and float((a - b).norm() / b.norm()) < 3e-2


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_chunked_teacher_equals_the_full_vocab_head(norm):
    g = torch.Generator().manual_seed(1)
    V, H, Vd = 60, 8, 20
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:Vd]] = True
    weight, nw = torch.randn(V, H, generator=g), torch.rand(H, generator=g) + 0.5
    head = TargetHead(weight, nw if norm == "pre" else None, 1e-6)
    last, mask = torch.randn(3, 11, H, generator=g), torch.rand(3, 11, generator=g) > 0.3
    full = head(last)  # (B, T, V) in target-id order
    head.reorder(draft_first_order(t2d))
    torch.testing.assert_close(head(last), full)  # reordering keeps forward's meaning
    lab = teacher_labels(head, last, mask, Vd, chunk=4)
    top = full.argmax(-1)
    draft_of = torch.cumsum(t2d.long(), 0) - 1
    assert torch.equal(lab.scored, shift_left(mask, 1))
    at = lab.scored  # labels are read (and computed) only where scored
    assert torch.equal(lab.target[at], torch.where(t2d[top], draft_of[top], -1)[at])
    torch.testing.assert_close(lab.probs.view(3, 11, Vd)[at], torch.softmax(full[..., t2d], -1)[at])
    assert torch.equal(lab.valid, lab.scored & t2d[top])
    assert lab.probs.isfinite().all()


def gathered_rows(monkeypatch, taken: list):
    """Each objective call's number of gathered rows appended to `taken` (nothing for a span)."""
    from eyas.training import losses

    real = losses.step_rows

    def spy(*args):
        at = real(*args)
        if at.gathered:
            taken.append(at.rows[0].numel())
        return at

    monkeypatch.setattr(losses, "step_rows", spy)


def test_ttt_objective_equals_the_reference_unroll():
    m = make(seed=2)
    g = torch.Generator().manual_seed(2)
    B, T, K = 2, 13, 3
    ids = torch.randint(0, 64, (B, T), generator=g)
    aux = torch.randn(B, T, 96, generator=g)
    t2d = m.t2d.clone()
    t2d[torch.randperm(64, generator=g)[:40]] = True
    head = TargetHead(torch.randn(64, 32, generator=g), None, 1e-6).reorder(draft_first_order(t2d))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, :3] = False
    labels = teacher_labels(head, torch.randn(B, T, 32, generator=g), mask, 40)
    params = [p for p in m.parameters() if p.requires_grad]
    loss, correct, scored = TTTObjective(m)(ids, aux, labels, K, 0.8)
    want, want_correct, want_scored = reference_ttt_loss(m, ids, aux, labels, K, 0.8)
    torch.testing.assert_close(loss, want)
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert torch.equal(correct, want_correct) and torch.equal(scored, want_scored)
    counts = torch.tensor([50.0, 40.0, 30.0], dtype=torch.float64)  # a global batch's, say
    torch.testing.assert_close(
        TTTObjective(m)(ids, aux, labels, K, 0.8, counts)[0],
        reference_ttt_loss(m, ids, aux, labels, K, 0.8, counts)[0],
    )
    assert scored.tolist() == [int(labels.scored[:, 1 + k :].sum()) for k in range(K)]
    assert torch.equal(scored.double(), scored_counts(list(mask), K))  # known from the masks alone
    assert (correct <= scored).all()


def _objective_case(mask, K=3, seed=4):
    m = make(seed=seed)
    g = torch.Generator().manual_seed(seed)
    B, T = mask.shape
    ids = torch.randint(0, 64, (B, T), generator=g)
    aux = torch.randn(B, T, 96, generator=g)
    t2d = m.t2d.clone()
    t2d[torch.randperm(64, generator=g)[:40]] = True
    head = TargetHead(torch.randn(64, 32, generator=g), None, 1e-6).reorder(draft_first_order(t2d))
    return m, ids, aux, teacher_labels(head, torch.randn(B, T, 32, generator=g), mask, 40, chunk=5)


@pytest.mark.parametrize(
    "layout", ["prompts_and_padding", "interleaved_turns", "nothing_scored", "everything"]
)
def test_ttt_objective_skips_unscored_positions_with_the_same_loss_and_gradients(
    layout, monkeypatch
):
    """Steps >= 1 and the head run only on the positions some step scores, gathered position by
    position or as one span: long prompts, right padding of different lengths, several turns per
    sequence; loss, gradients and statistics stay those of the unskipped objective and the
    reference."""
    B, T, K = 3, 23, 3
    mask = torch.zeros(B, T, dtype=torch.bool)
    if layout == "prompts_and_padding":
        mask[0, 9:20], mask[1, 12:19], mask[2, 10:15] = True, True, True
    elif layout == "interleaved_turns":
        mask[0, 8:11], mask[0, 15:18], mask[1, 11:13], mask[1, 21:], mask[2, 9:20] = (
            True,
            True,
            True,
            True,
            True,
        )
    elif layout == "everything":
        mask[:] = True
    m, ids, aux, labels = _objective_case(mask, K)
    first, end = labels.span
    if layout == "prompts_and_padding":
        assert (first, end) == (8, 19)
        assert ttt_span(labels, T, K) == (5, 18)  # the span: steps >= 1 run on 13 of 23 positions
        b, t = ttt_rows(labels.scored, K)
        assert t[b == 1].tolist() == list(
            range(8, 17)
        )  # sequence 1 scores tokens 12..18: rows 12-2-2 .. 18-2
    elif layout == "interleaved_turns":
        b, t = ttt_rows(labels.scored, K)
        assert t[b == 0].tolist() == [
            *range(4, 9),
            *range(11, 16),
        ]  # user turn 11..14 drops out between replies
    elif layout == "nothing_scored":
        assert ttt_span(labels, T, K) == (0, T)
        assert (
            ttt_rows(labels.scored, K)[0].numel() == B * T
        )  # every position: the loss is 0 but has a graph
    params = [p for p in m.parameters() if p.requires_grad]
    everywhere = KernelOptions(skip_span=False, gather_under=0.0)  # nothing skipped: one span
    full, c_full, n_full = TTTObjective(m, kernels=everywhere)(ids, aux, labels, K, 0.8)
    g_full = torch.autograd.grad(full, params) if layout != "nothing_scored" else []
    torch.testing.assert_close(full, reference_ttt_loss(m, ids, aux, labels, K, 0.8)[0])
    span = labels.span
    taken = []
    gathered_rows(monkeypatch, taken)
    for labels.span, worth in (
        (span, 1.0),  # gathered wherever anything is skipped
        (span, DEFAULT.gather_under),  # gathered where worth it
        (span, 0.0),  # always the span
        (None, 0.0),
    ):  # None: the span off `scored`
        kernels = KernelOptions(gather_under=worth)
        loss, correct, scored = TTTObjective(m, kernels=kernels)(ids, aux, labels, K, 0.8)
        torch.testing.assert_close(loss, full, atol=1e-7, rtol=1e-6)
        for a, b in zip(torch.autograd.grad(loss, params) if g_full else [], g_full):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
        assert torch.equal(correct, c_full) and torch.equal(scored, n_full)
        assert scored.tolist() == [int(labels.scored[:, 1 + k :].sum()) for k in range(K)]
        assert torch.equal(scored.double(), scored_counts(list(mask), K))
    # gathered wherever it skips more than a tenth of the span's rows (29 of 39, 31 of 60), never
    # where it would skip nothing
    want = {
        "prompts_and_padding": [29, 29],
        "interleaved_turns": [31, 31],
        "nothing_scored": [],
        "everything": [],
    }
    assert taken == want[layout]


def test_training_steps_on_the_reference_as_on_the_fused_objective():
    """KernelOptions.reference: optimizer_step trains on the plain unroll; two steps give the fused
    objective's statistics and move the weights as its steps do."""
    mask = torch.zeros(3, 23, dtype=torch.bool)
    mask[0, 8:11], mask[0, 15:18], mask[1, 11:13], mask[2, 9:20] = True, True, True, True
    m0, ids, aux, labels = _objective_case(mask)
    counts = scored_counts(list(mask), 3)
    out = []
    for m, kernels in ((m0, DEFAULT), (copy.deepcopy(m0), KernelOptions(reference=True))):
        objective = TTTObjective(m, kernels=kernels)
        params = [p for p in m.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        stats = []
        for _ in range(2):
            stats.append(
                optimizer_step(
                    objective,
                    objective,
                    opt,
                    sched,
                    [Batch(ids, mask, aux, last=torch.empty(0))],  # last: unread, labels given
                    lambda batch: labels,
                    ttt_steps=3,
                    decay=0.8,
                    counts=counts,
                    grad_clip=0.5,
                    autocast=contextlib.nullcontext(),
                )
            )
        out.append((torch.stack(stats), torch.cat([p.detach().flatten() for p in params])))
    (s_fused, w_fused), (s_ref, w_ref) = out
    torch.testing.assert_close(s_ref, s_fused)
    torch.testing.assert_close(w_ref, w_fused, atol=1e-6, rtol=1e-5)
    assert s_ref[1, 0] < s_ref[0, 0]  # the steps trained


def test_positions_are_gathered_only_where_they_skip_enough_of_the_span(monkeypatch):
    """A short user turn in one of two sequences skips under a tenth of the span's rows: the span
    runs; a long one skips more: the rows are gathered (KernelOptions.gather_under)."""
    taken = []
    gathered_rows(monkeypatch, taken)
    for gap, gathered in ((range(10, 14), False), (range(6, 16), True)):
        mask = torch.ones(2, 23, dtype=torch.bool)
        mask[1, list(gap)] = False
        m, ids, aux, labels = _objective_case(mask, 3)
        b, _ = ttt_rows(labels.scored, 3)
        s, e = ttt_span(labels, 23, 3)
        assert (b.numel() < 0.9 * 2 * (e - s)) == gathered
        taken.clear()
        TTTObjective(m)(ids, aux, labels, 3, 0.8)
        assert taken == ([b.numel()] if gathered else [])


def test_teacher_labels_run_on_the_scored_positions_only():
    """The teacher on the scored positions only, gathered: the full head's labels wherever a
    position is scored, and nothing (zeros, -1) where none is; its span, the batch's first and last
    scored positions."""
    mask = torch.zeros(3, 23, dtype=torch.bool)
    mask[0, 8:11], mask[0, 15:18], mask[1, 11:13], mask[2, 9:20] = True, True, True, True
    g = torch.Generator().manual_seed(4)
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[torch.randperm(64, generator=g)[:40]] = True
    weight = torch.randn(64, 32, generator=g)
    head = TargetHead(weight, None, 1e-6).reorder(draft_first_order(t2d))
    last = torch.randn(3, 23, 32, generator=g)
    rows = teacher_labels(head, last, mask, 40, chunk=5)
    s = rows.scored
    assert torch.equal(s, shift_left(mask, 1)) and s.sum() == 19 and rows.span == (7, 19)
    full = last @ weight.T  # (B, T, V) in target-id order
    top, draft_of = full.argmax(-1), torch.cumsum(t2d.long(), 0) - 1
    assert torch.equal(rows.target[s], torch.where(t2d[top], draft_of[top], -1)[s])
    torch.testing.assert_close(rows.probs.view(3, 23, 40)[s], torch.softmax(full[..., t2d], -1)[s])
    assert (rows.target[~s] == -1).all() and (rows.probs[~s.view(-1)] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_regions_and_flash_kernels_match_on_a_gpu():
    """bench/train.py's checks, as a test where a GPU is at hand (bf16 against float64 / eager)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_train", Path(__file__).parents[3] / "bench" / "train.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    device = torch.device("cuda")
    errors = {
        **bench.check_kernels(device, torch.bfloat16),
        **bench.check_compiled(device, torch.bfloat16),
    }
    assert all(e < 2e-2 for e in errors.values()), errors
