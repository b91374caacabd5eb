"""TTTWeights: the unroll's weights cast once, gradients summed in the GEMMs, grouped projections,
FP8."""

import torch

from eyas.training import gemm, ttt_weights
from eyas.training.kernels import KernelOptions
from eyas.training.ttt_weights import TTTWeights, _GradSink
from tests.unit.training.test_ttt_step import LAYOUTS, K, assert_same_step, case, loss_and_grads

torch.set_num_threads(1)


def test_halves_reach_one_gradient_per_weight_the_embedding_columns_first():
    m, *_ = case()
    w = TTTWeights(m, torch.float32, halves=True)
    assert [t.shape for t in w.w["q_proj"]] == [
        (m.cfg.num_attention_heads * m.cfg.head_dim, m.cfg.hidden_size)
    ] * 2
    sink = _GradSink()
    x0, x1, dy = torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 4)
    sink.add(dy.T, x0, 0)
    sink.add(dy.T, x1, 1)
    sink.add(dy.T, x1, 1)
    torch.testing.assert_close(sink.take(torch.float32), torch.cat([dy.T @ x0, 2 * dy.T @ x1], 1))
    assert sink.take(torch.float32) is None  # emptied


def test_grouped_projections_sum_the_input_gradient_in_the_gemms_and_give_the_same_step(
    monkeypatch,
):
    """q/k/v and gate/up as one node where x is in the GEMM dtype (fp32 here): the same step as one
    node each; not used where x and the GEMMs differ (the CPU's bf16 GEMMs)."""
    calls = []
    apply = ttt_weights._SharedLinears.apply
    monkeypatch.setattr(
        ttt_weights._SharedLinears, "apply", lambda *a: calls.append(len(a[1])) or apply(*a)
    )
    for layout, own_concat in ((LAYOUTS["rows"], False), (LAYOUTS["span"], False), ({}, True)):
        kw = dict(layout, shared_emb=not own_concat)
        calls.clear()
        a = loss_and_grads(KernelOptions(**kw))
        # q/k/v (their hidden-state halves, or each step's own concatenation: all three, or k/v
        # beside step 0's fewer queries) and gate/up
        assert set(calls) == {2, 3}
        n = len(calls)
        calls.clear()
        assert_same_step(
            a, loss_and_grads(KernelOptions(**kw, grouped_gemms=False)), atol=1e-6, rtol=1e-5
        )
        assert calls == [] and n >= K
    loss_and_grads(gemm_dtype=torch.bfloat16)
    assert calls == []  # fp32 activations, bf16 GEMMs: one node each, the sums in fp32


def test_fp8_gemms_train_the_same_objective_up_to_fp8_rounding(monkeypatch):
    """fp8_gemms: every layer GEMM (forward, input and weight gradients) goes through the scaled FP8
    GEMM, and loss and gradients stay within FP8's rounding of the fp32 step's."""
    calls = []
    real = gemm.mm_fp8
    monkeypatch.setattr(gemm, "mm_fp8", lambda *a: calls.append(a[0].shape) or real(*a))
    fp8 = loss_and_grads(KernelOptions(fp8_gemms=True))
    base = loss_and_grads(KernelOptions())
    # fc once, then q, k, v, o, gate, up, down at each of K steps: a forward GEMM each, and a weight
    # gradient each; an input gradient each but fc's (its input is data)
    n = 1 + 7 * K
    assert len(calls) == 3 * n - 1
    assert abs(float(fp8[0].detach()) / float(base[0].detach()) - 1) < 1e-2
    for a, b in zip(fp8[1], base[1]):
        assert float((a - b).norm() / b.norm()) < 0.15
    assert torch.equal(fp8[3], base[3])  # the same positions scored
