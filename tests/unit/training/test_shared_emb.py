"""SharedEmb: each TTT step's rows of the embedding's share, their gradients summed in place."""

import torch

from eyas.training.kernels import KernelOptions
from eyas.training.shared_emb import SharedEmb, rows_of
from tests.unit.training.test_ttt_step import LAYOUTS, assert_same_step, loss_and_grads

torch.set_num_threads(1)


def test_gradients_summed_in_place_equal_autograds_sums_bit_for_bit():
    """The in-place sums against autograd summing zero-padded slices (KernelOptions.emb_inplace
    off): bit for bit (same adds, same order) on the gathered rows, the span and no skipping, fp32
    and the CPU's bf16 GEMMs."""
    for gemm_dtype in (None, torch.bfloat16):
        for layout in LAYOUTS.values():
            a = loss_and_grads(KernelOptions(**layout), gemm_dtype)
            b = loss_and_grads(KernelOptions(**layout, emb_inplace=False), gemm_dtype)
            assert_same_step(a, b, atol=0, rtol=0)


def test_one_buffer_per_projection_rows_shifted_where_q_starts_later():
    g = torch.Generator().manual_seed(0)
    pe = {
        n: torch.randn(2, 9, 4, generator=g, requires_grad=True)
        for n in ("q_proj", "k_proj", "v_proj")
    }
    q_late = pe["q_proj"][:, 3:].detach().requires_grad_()
    emb = SharedEmb({**pe, "q_proj": q_late}, {"q_proj": 3})
    b, t = torch.tensor([0, 1, 1]), torch.tensor([4, 2, 7])
    parts = [
        emb.step(slice(3, 8), slice(0, 8)),
        emb.step(slice(4, 9), slice(4, 9)),
        emb.step((b, t + 1), (b, t + 1)),
    ]
    torch.testing.assert_close(
        parts[0]["q_proj"], pe["q_proj"][:, 3:8]
    )  # token positions, not q's own rows
    torch.testing.assert_close(parts[2]["k_proj"], pe["k_proj"][b, t + 1][None])
    ws = {n: torch.randn(2, 9, 4, generator=g) for n in pe}
    q_rows, kv_rows = [slice(3, 8), slice(4, 9), (b, t + 1)], [slice(0, 8), slice(4, 9), (b, t + 1)]
    loss = sum(
        (p[n] * rows_of(ws[n], r)).sum()
        for p, r in zip(parts, kv_rows)
        for n in ("k_proj", "v_proj")
    )
    loss = loss + sum((p["q_proj"] * rows_of(ws["q_proj"], r)).sum() for p, r in zip(parts, q_rows))
    got = torch.autograd.grad(loss, [pe["k_proj"], q_late])
    want = torch.zeros(2, 9, 4)
    want[:, 0:8] += ws["k_proj"][:, 0:8]
    want[:, 4:9] += ws["k_proj"][:, 4:9]
    want[b, t + 1] += ws["k_proj"][b, t + 1]
    torch.testing.assert_close(got[0], want)
    want_q = torch.zeros(2, 9, 4)
    want_q[:, 3:8] += ws["q_proj"][:, 3:8]
    want_q[:, 4:9] += ws["q_proj"][:, 4:9]
    want_q[b, t + 1] += ws["q_proj"][b, t + 1]
    torch.testing.assert_close(got[1], want_q[:, 3:])
    assert emb.sums.bufs == {}  # each buffer handed on and dropped
