"""TTT attention (one causal flash attention plus diagonal terms) against the masked softmax."""

import pytest
import torch

from eyas.training import attention
from eyas.training.attention import (
    reference_ttt_attention,
    reference_ttt_attention_rows,
    ttt_attention,
)

torch.set_num_threads(1)


@pytest.mark.parametrize("K", [1, 3])
def test_ttt_attention_matches_the_masked_softmax_with_gradients(K):
    g = torch.Generator().manual_seed(K)
    ts = [torch.randn(2, 3, 29, 16, generator=g, requires_grad=True) for _ in range(3 + 2 * K)]
    args = (ts[0], ts[1], ts[2], ts[3 : 3 + K], ts[3 + K :], 0.25)
    y, want = ttt_attention(*args), reference_ttt_attention(*args)
    dy = torch.randn(y.shape, generator=g)
    for a, b in zip(torch.autograd.grad(y, ts, dy), torch.autograd.grad(want, ts, dy)):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(y, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("K", [0, 2])
def test_ttt_attention_of_the_last_query_rows_matches_the_masked_softmax_with_gradients(K):
    """Queries the last L of S key positions (bottom-right causal): the later steps on a span, and
    with K = 0 step 0 itself when only its last rows are read (eyas/training/ttt_step.py): no merge
    then, and the output and dq laid out like q."""
    g = torch.Generator().manual_seed(20 + K)
    B, nh, S, L, hd = 2, 3, 29, 11, 16
    q, *kd = (
        torch.randn(B, S, nh, hd, generator=g)[:, S - L :].transpose(1, 2).requires_grad_()
        for _ in range(1 + 2 * K)
    )
    kd, vd = kd[:K], kd[K:]
    k0, v0 = (torch.randn(B, nh, S, hd, generator=g, requires_grad=True) for _ in range(2))
    ins = [q, k0, v0, *kd, *vd]
    y, want = (
        ttt_attention(q, k0, v0, kd, vd, 0.25),
        reference_ttt_attention(q, k0, v0, kd, vd, 0.25),
    )
    torch.testing.assert_close(y, want, atol=2e-6, rtol=1e-5)
    dy = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, ins, dy)
    for a, c in zip(got, torch.autograd.grad(want, ins, dy)):
        torch.testing.assert_close(a, c, atol=2e-6, rtol=1e-5)
    if K == 0:
        assert y.transpose(1, 2).is_contiguous() and got[0].stride() == torch.empty_like(q).stride()


@pytest.mark.parametrize("K", [0, 1, 3])
def test_ttt_attention_on_gathered_rows_matches_the_whole_batch_with_gradients(K):
    """Queries gathered from a (B, T) batch (uneven per sequence, first and last positions among
    them): the kernel path and the gathered reference equal the whole batch's attention at those
    rows, gradients too."""
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

    whole = reference_ttt_attention(
        spread(q), k0, v0, [spread(k) for k in kd], [spread(v) for v in vd], 0.25
    )
    want = whole.transpose(1, 2)[b, t].transpose(0, 1)[None]
    dy = torch.randn(y.shape, generator=g)
    g_want = torch.autograd.grad(want, ins, dy)
    for got in (y, ref):
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        for a, c in zip(torch.autograd.grad(got, ins, dy), g_want):
            torch.testing.assert_close(a, c, atol=2e-6, rtol=1e-5)


def test_the_cpu_runs_its_own_flash_kernel_and_never_asks_cudnn():
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(2, 3, 17, 8, generator=g, requires_grad=True) for _ in range(7)]  # K = 2
    y = ttt_attention(ts[0], ts[1], ts[2], ts[3:5], ts[5:], 0.3)
    want = reference_ttt_attention(ts[0], ts[1], ts[2], ts[3:5], ts[5:], 0.3)
    torch.testing.assert_close(y, want, atol=2e-6, rtol=1e-5)
    assert (
        y.grad_fn is not None and "TTTAttention" in type(y.grad_fn).__name__
    )  # the kernel path, not the reference
    assert not attention._refused
