"""The soft cross-entropy of logits against the teacher's rows: loss, argmax and gradient."""

import torch

from eyas.training.soft_ce import _triton_ce_ready, soft_ce_rows, soft_ce_rows_nograd

torch.set_num_threads(1)


def test_soft_ce_matches_log_softmax_with_its_gradient():
    g = torch.Generator().manual_seed(1)
    z, probs = torch.randn(9, 12, generator=g), torch.softmax(torch.randn(5, 12, generator=g), -1)
    rows, w = torch.randint(0, 5, (9,), generator=g), torch.rand(9, generator=g)
    assert not _triton_ce_ready(z)  # the CPU: the PyTorch math
    zr = z.clone().requires_grad_()
    want = -(w[:, None] * probs[rows] * torch.log_softmax(zr, -1)).sum()
    loss, pred, dz = soft_ce_rows(
        z.clone(), probs, rows, w, torch.float32
    )  # works in place on its z
    torch.testing.assert_close(loss, want.detach())
    assert torch.equal(pred, z.argmax(-1))
    torch.testing.assert_close(dz, torch.autograd.grad(want, zr)[0])
    loss2, pred2 = soft_ce_rows_nograd(z, probs, rows, w)
    torch.testing.assert_close(loss2, want.detach())
    assert torch.equal(pred2, pred)
