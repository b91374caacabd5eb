"""The fast training paths against plain autograd math: TTT attention, fused head loss, teacher, unroll."""

import pytest
import torch
import torch.nn.functional as F

from eyas.training import kernels as fused, losses
from eyas.training.attention import reference_ttt_attention, reference_ttt_attention_rows, ttt_attention
from eyas.training.batches import epoch_plan, shift_left
from eyas.training.drafter import causal_mask
from eyas.training.kernels import KernelOptions
from eyas.training.losses import (TTTObjective, draft_first_order, head_soft_ce, scored_counts, teacher_labels,
                                  ttt_rows, ttt_span)
from eyas.training.target_head import TargetHead
from tests.unit.test_drafter import make

torch.set_num_threads(1)


@pytest.mark.parametrize("K", [1, 3])
def test_ttt_attention_matches_the_masked_softmax_with_gradients(K):
    g = torch.Generator().manual_seed(K)
    ts = [torch.randn(2, 3, 29, 16, generator=g, requires_grad=True) for _ in range(3 + 2 * K)]
    args = (ts[0], ts[1], ts[2], ts[3:3 + K], ts[3 + K:], 0.25)
    y, want = ttt_attention(*args), reference_ttt_attention(*args)
    dy = torch.randn(y.shape, generator=g)
    for a, b in zip(torch.autograd.grad(y, ts, dy), torch.autograd.grad(want, ts, dy)):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(y, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("K", [0, 2])
def test_ttt_attention_of_the_last_query_rows_matches_the_masked_softmax_with_gradients(K):
    """Queries the last L of S key positions (bottom-right causal): the later steps on a span, and with
    K = 0 step 0 itself when only its last rows are read (KernelOptions.shared_emb): no merge then, and
    the output and dq laid out like q."""
    g = torch.Generator().manual_seed(20 + K)
    B, nh, S, L, hd = 2, 3, 29, 11, 16
    q, *kd = (torch.randn(B, S, nh, hd, generator=g)[:, S - L:].transpose(1, 2).requires_grad_() for _ in range(1 + 2 * K))
    kd, vd = kd[:K], kd[K:]
    k0, v0 = (torch.randn(B, nh, S, hd, generator=g, requires_grad=True) for _ in range(2))
    ins = [q, k0, v0, *kd, *vd]
    y, want = ttt_attention(q, k0, v0, kd, vd, 0.25), reference_ttt_attention(q, k0, v0, kd, vd, 0.25)
    torch.testing.assert_close(y, want, atol=2e-6, rtol=1e-5)
    dy = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, ins, dy)
    for a, c in zip(got, torch.autograd.grad(want, ins, dy)):
        torch.testing.assert_close(a, c, atol=2e-6, rtol=1e-5)
    if K == 0:
        assert y.transpose(1, 2).is_contiguous() and got[0].stride() == torch.empty_like(q).stride()


@pytest.mark.parametrize("L", [1, 11, 28])  # 28: a single key before the first query
def test_split_attention_of_the_last_query_rows_matches_the_masked_softmax_with_gradients(L):
    """KernelOptions.span_split's two calls (the keys before the first query unmasked, the rest causal,
    merged by log-sum-exp; cuDNN's on a GPU) here through the CPU's kernel: the bottom-right causal
    attention and its gradients, dk and dv laid out like k and v (position-major)."""
    from eyas.training import attention
    g = torch.Generator().manual_seed(30 + L)
    B, nh, S, hd = 2, 3, 29, 16
    q, k, v = (torch.randn(B, S, nh, hd, generator=g).transpose(1, 2) for _ in range(3))  # position-major
    q = q[:, :, S - L:].detach().requires_grad_()
    k, v = k.detach().requires_grad_(), v.detach().requires_grad_()
    y, lse, states = attention._split_fwd(q, k, v, 0.25, attention._cpu_fwd)
    want = reference_ttt_attention(q, k, v, [], [], 0.25)
    torch.testing.assert_close(y, want, atol=2e-6, rtol=1e-5)
    dy = torch.randn(y.shape, generator=g)
    dq, dk, dv = attention._split_bwd(dy, q.detach(), k.detach(), v.detach(), y, lse, states, 0.25, attention._cpu_bwd)
    for a, c in zip((dq, dk, dv), torch.autograd.grad(want, (q, k, v), dy)):
        torch.testing.assert_close(a, c, atol=2e-6, rtol=1e-5)
    assert dk.stride() == k.stride() and dv.stride() == v.stride()


@pytest.mark.parametrize("K", [0, 1, 3])
def test_ttt_attention_on_gathered_rows_matches_the_whole_batch_with_gradients(K):
    """Queries gathered from a (B, T) batch (uneven per sequence, first and last positions among them): the
    kernel path and the gathered reference equal the whole batch's attention at those rows, gradients too."""
    g = torch.Generator().manual_seed(10 + K)
    B, nh, T, hd = 2, 3, 29, 16
    b = torch.tensor([0, 0, 0, 0, 1, 1, 1])
    t = torch.tensor([0, 5, 6, 28, 3, 17, 27])
    q, *kd = (torch.randn(1, nh, 7, hd, generator=g, requires_grad=True) for _ in range(1 + 2 * K))
    kd, vd = kd[:K], kd[K:]
    k0, v0 = (torch.randn(B, nh, T, hd, generator=g, requires_grad=True) for _ in range(2))
    ins = [q, k0, v0, *kd, *vd]
    y = ttt_attention(q, k0, v0, kd, vd, 0.25, where=(b, t))
    ref = reference_ttt_attention_rows(q, k0, v0, kd, vd, 0.25, b, t)

    def spread(x):  # (1, nh, N, hd) -> (B, nh, T, hd), zeros elsewhere
        out = torch.zeros(B, T, nh, hd)
        out[b, t] = x[0].transpose(0, 1)
        return out.transpose(1, 2)
    whole = reference_ttt_attention(spread(q), k0, v0, [spread(k) for k in kd], [spread(v) for v in vd], 0.25)
    want = whole.transpose(1, 2)[b, t].transpose(0, 1)[None]
    dy = torch.randn(y.shape, generator=g)
    g_want = torch.autograd.grad(want, ins, dy)
    for got in (y, ref):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        for a, c in zip(torch.autograd.grad(got, ins, dy), g_want):
            torch.testing.assert_close(a, c, atol=2e-6, rtol=1e-5)


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
    """The CPU's bf16 GEMM mode: rows padded to a few cached kernel shapes (zeros that change nothing),
    loss and gradients within bf16 rounding of the fp32 ones, the argmax nearly always the same."""
    x = torch.randn(130, 7)
    p = fused.rows_padded(x, torch.bfloat16)
    assert p.shape == (256, 7) and p.dtype == torch.bfloat16 and not p[130:].any()
    torch.testing.assert_close(p[:130].float(), x, atol=0.02, rtol=0.01)
    assert fused.rows_padded(torch.randn(256, 3), torch.float32).shape == (256, 3)
    g = torch.Generator().manual_seed(5)
    N, H, V, M = 300, 32, 96, 40
    h = torch.randn(N, H, generator=g, requires_grad=True)
    w = torch.randn(V, H, generator=g, requires_grad=True)
    probs = torch.softmax(torch.randn(M, V, generator=g), -1)
    rows, row_w = torch.randint(0, M, (N,), generator=g), torch.rand(N, generator=g)
    want, want_pred = head_soft_ce(h, w, probs, rows, row_w, chunk=128)
    loss, pred = head_soft_ce(h, w, probs, rows, row_w, chunk=128, gemm_dtype=torch.bfloat16)  # 300 -> 384 rows
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


def reference_loss(m, ids, aux, labels, K, decay):
    """The skeleton's unroll: explicit masks, logits for every position, CE averaged per step."""
    B, T = ids.shape
    h, kv, loss = aux, [], 0.0
    for k in range(K):
        logits, h = m(shift_left(ids, 1 + k), h, torch.arange(T) + k, causal_mask(T), ttt=kv)
        v = labels.valid[:, 1 + k:]
        p = labels.probs.view(B, T, -1)[:, 1 + k:][v]
        ce = -(p * F.log_softmax(logits[:, :T - 1 - k][v], -1)).sum()
        loss = loss + decay ** k * ce / labels.scored[:, 1 + k:].sum()
    return loss


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
    want = reference_loss(m, ids, aux, labels, K, 0.8)
    torch.testing.assert_close(loss, want)
    for a, b in zip(torch.autograd.grad(loss, params), torch.autograd.grad(want, params)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert scored.tolist() == [int(labels.scored[:, 1 + k:].sum()) for k in range(K)]
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


@pytest.mark.parametrize("layout", ["prompts_and_padding", "interleaved_turns", "nothing_scored", "everything"])
def test_ttt_objective_skips_unscored_positions_with_the_same_loss_and_gradients(layout, monkeypatch):
    """Steps >= 1 and the head run only on the positions some step scores, gathered position by position
    (skip_rows) or as one span: long prompts, right padding of different lengths, several turns per
    sequence; loss, gradients and statistics stay those of the unskipped objective and the reference."""
    B, T, K = 3, 23, 3
    mask = torch.zeros(B, T, dtype=torch.bool)
    if layout == "prompts_and_padding":
        mask[0, 9:20], mask[1, 12:19], mask[2, 10:15] = True, True, True
    elif layout == "interleaved_turns":
        mask[0, 8:11], mask[0, 15:18], mask[1, 11:13], mask[1, 21:], mask[2, 9:20] = True, True, True, True, True
    elif layout == "everything":
        mask[:] = True
    m, ids, aux, labels = _objective_case(mask, K)
    first, end = labels.span
    if layout == "prompts_and_padding":
        assert (first, end) == (8, 19)
        assert ttt_span(labels, T, K) == (5, 18)  # the span: steps >= 1 run on 13 of 23 positions
        b, t = ttt_rows(labels.scored, K)
        assert t[b == 1].tolist() == list(range(8, 17))  # sequence 1 scores tokens 12..18: rows 12-2-2 .. 18-2
    elif layout == "interleaved_turns":
        b, t = ttt_rows(labels.scored, K)
        assert t[b == 0].tolist() == [*range(4, 9), *range(11, 16)]  # user turn 11..14 drops out between replies
    elif layout == "nothing_scored":
        assert ttt_span(labels, T, K) == (0, T)
        assert ttt_rows(labels.scored, K)[0].numel() == B * T  # every position: the loss is 0 but has a graph
    params = [p for p in m.parameters() if p.requires_grad]
    full, c_full, n_full = TTTObjective(m, kernels=KernelOptions(skip_unscored=False))(ids, aux, labels, K, 0.8)
    g_full = torch.autograd.grad(full, params) if layout != "nothing_scored" else []
    if layout != "nothing_scored":  # the reference divides by zero there
        torch.testing.assert_close(full, reference_loss(m, ids, aux, labels, K, 0.8))
    span = labels.span
    taken = []
    real = TTTObjective._forward_rows
    monkeypatch.setattr(TTTObjective, "_forward_rows", lambda *a: taken.append(a[-2].numel()) or real(*a))
    for kernels, labels.span, worth in ((KernelOptions(), span, 1.0),  # gathered wherever anything is skipped
                                        (KernelOptions(), span, losses.ROWS_WORTH),  # gathered where worth it
                                        (KernelOptions(skip_rows=False), span, 1.0),
                                        (KernelOptions(skip_rows=False), None, 1.0)):  # None: the span off `scored`
        monkeypatch.setattr(losses, "ROWS_WORTH", worth)
        loss, correct, scored = TTTObjective(m, kernels=kernels)(ids, aux, labels, K, 0.8)
        torch.testing.assert_close(loss, full, atol=1e-7, rtol=1e-6)
        for a, b in zip(torch.autograd.grad(loss, params) if g_full else [], g_full):
            torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-5)
        assert torch.equal(correct, c_full) and torch.equal(scored, n_full)
        assert scored.tolist() == [int(labels.scored[:, 1 + k:].sum()) for k in range(K)]
        assert torch.equal(scored.double(), scored_counts(list(mask), K))
    # gathered wherever it skips more than a tenth of the span's rows (29 of 39, 31 of 60), never where
    # it would skip nothing
    want = {"prompts_and_padding": [29, 29], "interleaved_turns": [31, 31], "nothing_scored": [], "everything": []}
    assert taken == want[layout]


def test_positions_are_gathered_only_where_they_skip_enough_of_the_span(monkeypatch):
    """A short user turn in one of two sequences skips under a tenth of the span's rows: the span runs; a long
    one skips more: the rows are gathered (KernelOptions.skip_rows, losses.ROWS_WORTH)."""
    taken = []
    real = TTTObjective._forward_rows
    monkeypatch.setattr(TTTObjective, "_forward_rows", lambda *a: taken.append(a[-2].numel()) or real(*a))
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


def test_teacher_labels_gathered_equal_the_span_and_the_whole_batch():
    """The teacher on the scored positions only (skip_rows) gives the labels the span and the whole batch give
    wherever a position is scored, and nothing (zeros, -1) where none is."""
    mask = torch.zeros(3, 23, dtype=torch.bool)
    mask[0, 8:11], mask[0, 15:18], mask[1, 11:13], mask[2, 9:20] = True, True, True, True
    g = torch.Generator().manual_seed(4)
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[torch.randperm(64, generator=g)[:40]] = True
    head = TargetHead(torch.randn(64, 32, generator=g), None, 1e-6).reorder(draft_first_order(t2d))
    last = torch.randn(3, 23, 32, generator=g)
    rows = teacher_labels(head, last, mask, 40, chunk=5)
    span = teacher_labels(head, last, mask, 40, chunk=5, kernels=KernelOptions(skip_rows=False))
    every = teacher_labels(head, last, mask, 40, chunk=5, kernels=KernelOptions(skip_unscored=False))
    s = rows.scored
    assert torch.equal(s, every.scored) and s.sum() == 19
    for other in (span, every):
        assert torch.equal(rows.target[s], other.target[s]) and torch.equal(rows.valid, other.valid)
        torch.testing.assert_close(rows.probs[s.view(-1)], other.probs[s.view(-1)])
    assert (rows.target[~s] == -1).all() and (rows.probs[~s.view(-1)] == 0).all()


def test_epoch_plan_is_length_aware_and_the_same_for_any_split():
    lengths = [5, 50, 7, 48, 9, 46, 11, 44, 13, 42, 15, 40, 3]
    ids = list(range(13))
    a = epoch_plan(lengths, ids, micro=2, num_micro=2, seed=0, epoch=0, window=3)  # 1 rank x 2 accum
    b = epoch_plan(lengths, ids, micro=4, num_micro=1, seed=0, epoch=0, window=3)  # one micro-batch
    assert len(a) == len(b) == 3  # 13 // 4 global batches; the rest is dropped
    assert [sorted(x for m in s for x in m) for s in a] == [sorted(s[0]) for s in b]
    for step in a:
        assert all(len(m) == 2 for m in step)
        ls = [lengths[i] for m in step for i in m]
        assert ls == sorted(ls, reverse=True)  # longest first: a micro-batch pads little
    assert epoch_plan(lengths, ids, 2, 2, seed=0, epoch=1, window=3) != a  # a new order every epoch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_regions_and_flash_kernels_match_on_a_gpu():
    """bench/train.py's checks, as a test where a GPU is at hand (bf16 against float64 / eager)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("bench_train", Path(__file__).parents[2] / "bench" / "train.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    device = torch.device("cuda")
    errors = {**bench.check_kernels(device, torch.bfloat16), **bench.check_compiled(device, torch.bfloat16)}
    assert all(e < 2e-2 for e in errors.values()), errors
