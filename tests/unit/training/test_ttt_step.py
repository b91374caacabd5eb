"""The fused TTT step computes the plain drafter's unroll: its embedding share once per unroll or
each step's own concatenation (the FP8 path), the span, gathered rows, or every position."""

import torch

from eyas.training.kernels import KernelOptions
from eyas.training.losses import TTTObjective, draft_first_order, teacher_labels
from eyas.training.step_rows import ttt_span
from eyas.training.target_head import TargetHead
from tests.unit.training.test_drafter import make

torch.set_num_threads(1)

B, T, K = 3, 23, 3


def case(seed: int = 4):
    """A drafter, a batch with prompts and right padding of different lengths, and its labels."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 9:20], mask[1, 12:19], mask[2, 10:15] = True, True, True
    m = make(seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids, aux = torch.randint(0, 64, (B, T), generator=g), torch.randn(B, T, 96, generator=g)
    t2d = m.t2d.clone()
    t2d[torch.randperm(64, generator=g)[:40]] = True
    head = TargetHead(torch.randn(64, 32, generator=g), None, 1e-6).reorder(draft_first_order(t2d))
    labels = teacher_labels(head, torch.randn(B, T, 32, generator=g), mask, 40, chunk=5)
    return m, ids, aux, labels


def loss_and_grads(kernels: KernelOptions | None = None, gemm_dtype=None):
    kernels = kernels or KernelOptions()
    m, ids, aux, labels = case()
    params = [p for p in m.parameters() if p.requires_grad]
    loss, correct, scored = TTTObjective(m, gemm_dtype=gemm_dtype, kernels=kernels)(
        ids, aux, labels, K, 0.8
    )
    return loss, torch.autograd.grad(loss, params), correct, scored


def assert_same_step(a, b, atol=1e-7, rtol=1e-5):
    torch.testing.assert_close(a[0], b[0], atol=atol, rtol=1e-6)
    for ga, gb in zip(a[1], b[1]):
        torch.testing.assert_close(ga, gb, atol=atol, rtol=rtol)
    assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


#: how the steps >= 1 run (KernelOptions): gathered rows (where they skip enough), the one span,
#: every position
LAYOUTS = {
    "rows": dict(gather_under=1.0),
    "span": dict(gather_under=0.0),
    "everywhere": dict(gather_under=0.0, skip_span=False),
}


def test_skipping_unscored_positions_or_not_gives_the_same_loss_and_gradients():
    *_, labels = case()
    assert labels.span == (8, 19) and ttt_span(labels, T, K) == (
        5,
        18,
    )  # the teacher ran on 11 of 23 positions
    skipped = loss_and_grads()
    assert_same_step(skipped, loss_and_grads(KernelOptions(skip_span=False)))


def test_shared_embedding_projection_gives_the_same_loss_and_gradients():
    """q/k/v's embedding columns applied once per unroll and shifted per step (with step 0's
    queries, o_proj and MLP only where read), against every step projecting its own concatenation
    (TTTWeights.qkv without halves, the FP8 GEMMs' path): the gathered rows, the span and no
    skipping, in fp32 and in the CPU's bf16 GEMMs."""
    for layout in LAYOUTS.values():
        shared, own = KernelOptions(**layout), KernelOptions(**layout, shared_emb=False)
        assert_same_step(loss_and_grads(shared), loss_and_grads(own), atol=1e-6, rtol=1e-4)
    own_concat = KernelOptions(shared_emb=False)
    a = loss_and_grads(gemm_dtype=torch.bfloat16)
    b = loss_and_grads(own_concat, gemm_dtype=torch.bfloat16)
    torch.testing.assert_close(a[0], b[0], rtol=1e-2, atol=0)
    for ga, gb in zip(a[1], b[1]):
        assert float((ga - gb).norm() / gb.norm()) < 3e-2
