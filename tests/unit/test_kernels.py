"""KernelOptions: each option flipped on the CPU computes the same step, and no global switch is left."""

import ast
import dataclasses
import importlib
import pkgutil
from pathlib import Path

import pytest
import torch

import eyas.training
from eyas.training import attention, drafter, kernels as fused, losses, train
from eyas.training.attention import ttt_attention
from eyas.training.drafter import TTTWeights, _GradSink
from eyas.training.kernels import KernelOptions, kernel_options
from eyas.training.losses import TTTObjective, draft_first_order, teacher_labels, ttt_span
from eyas.training.optim import clip_and_step, make_optimizer
from eyas.training.target_head import TargetHead
from tests.helpers_training import training_config
from tests.unit.test_drafter import make

torch.set_num_threads(1)

B, T, K = 3, 23, 3


def case(kernels: KernelOptions, seed: int = 4):
    """A drafter, a batch with prompts and right padding of different lengths, and its labels."""
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, 9:20], mask[1, 12:19], mask[2, 10:15] = True, True, True
    m = make(seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids, aux = torch.randint(0, 64, (B, T), generator=g), torch.randn(B, T, 96, generator=g)
    t2d = m.t2d.clone()
    t2d[torch.randperm(64, generator=g)[:40]] = True
    head = TargetHead(torch.randn(64, 32, generator=g), None, 1e-6).reorder(draft_first_order(t2d))
    labels = teacher_labels(head, torch.randn(B, T, 32, generator=g), mask, 40, chunk=5, kernels=kernels)
    return m, ids, aux, labels


def loss_and_grads(kernels: KernelOptions, gemm_dtype=None):
    m, ids, aux, labels = case(kernels)
    params = [p for p in m.parameters() if p.requires_grad]
    loss, correct, scored = TTTObjective(m, gemm_dtype=gemm_dtype, kernels=kernels)(ids, aux, labels, K, 0.8)
    return loss, torch.autograd.grad(loss, params), correct, scored


def assert_same_step(a, b, atol=1e-7, rtol=1e-5):
    torch.testing.assert_close(a[0], b[0], atol=atol, rtol=1e-6)
    for ga, gb in zip(a[1], b[1]):
        torch.testing.assert_close(ga, gb, atol=atol, rtol=rtol)
    assert torch.equal(a[2], b[2]) and torch.equal(a[3], b[3])


def test_skipping_unscored_positions_or_not_gives_the_same_loss_and_gradients():
    skip, full = KernelOptions(), KernelOptions(skip_unscored=False)
    *_, lab_skip = case(skip)
    *_, lab_full = case(full)
    assert lab_skip.span == (8, 19) and lab_full.span == (0, T)  # the teacher ran on 11 of 23 positions, or all
    assert ttt_span(lab_skip, T, K) == (5, 18) and ttt_span(lab_skip, T, K, skip=False) == (0, T)
    assert_same_step(loss_and_grads(skip), loss_and_grads(full))


def test_shared_weights_or_linear_modules_give_the_same_loss_and_gradients():
    assert_same_step(loss_and_grads(KernelOptions()), loss_and_grads(KernelOptions(shared_weights=False)),
                     atol=1e-6, rtol=1e-4)


def test_shared_embedding_projection_gives_the_same_loss_and_gradients():
    """q/k/v's embedding columns applied once per unroll and shifted per step (with step 0's queries, o_proj
    and MLP only where read), against every step projecting its own concatenation: the span, the gathered
    rows and no skipping, in fp32 and in the CPU's bf16 GEMMs."""
    for kw in ({}, {"skip_rows": False}, {"skip_unscored": False}):
        assert_same_step(loss_and_grads(KernelOptions(**kw)), loss_and_grads(KernelOptions(shared_emb=False, **kw)),
                         atol=1e-6, rtol=1e-4)
    a = loss_and_grads(KernelOptions(), torch.bfloat16)
    b = loss_and_grads(KernelOptions(shared_emb=False), torch.bfloat16)
    torch.testing.assert_close(a[0], b[0], rtol=1e-2, atol=0)
    for ga, gb in zip(a[1], b[1]):
        assert float((ga - gb).norm() / gb.norm()) < 3e-2
    # the halves reach one gradient per weight, the embedding's columns first
    m, ids, aux, labels = case(KernelOptions())
    w = TTTWeights(m, torch.float32, halves=True)
    assert [t.shape for t in w.w["q_proj"]] == [(m.cfg.num_attention_heads * m.cfg.head_dim, m.cfg.hidden_size)] * 2
    sink = _GradSink()
    x0, x1, dy = torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 4)
    sink.add(dy.T, x0, 0)
    sink.add(dy.T, x1, 1)
    sink.add(dy.T, x1, 1)
    torch.testing.assert_close(sink.take(torch.float32), torch.cat([dy.T @ x0, 2 * dy.T @ x1], 1))


def test_embedding_share_gradients_summed_in_place_equal_autograds_sums():
    """SharedEmb's in-place sums (KernelOptions.emb_grad_inplace) against autograd summing zero-padded
    slices: bit for bit (same adds, same order) on the span, the gathered rows and no skipping, fp32 and
    the CPU's bf16 GEMMs; and one buffer per projection, rows shifted where q's starts later."""
    for gemm_dtype in (None, torch.bfloat16):
        for kw in ({}, {"skip_rows": False}, {"skip_unscored": False}):
            a = loss_and_grads(KernelOptions(**kw), gemm_dtype)
            b = loss_and_grads(KernelOptions(emb_grad_inplace=False, **kw), gemm_dtype)
            assert_same_step(a, b, atol=0, rtol=0)
    g = torch.Generator().manual_seed(0)
    pe = {n: torch.randn(2, 9, 4, generator=g, requires_grad=True) for n in ("q_proj", "k_proj", "v_proj")}
    q_late = pe["q_proj"][:, 3:].detach().requires_grad_()
    emb = drafter.SharedEmb({**pe, "q_proj": q_late}, {"q_proj": 3})
    b, t = torch.tensor([0, 1, 1]), torch.tensor([4, 2, 7])
    parts = [emb.step(slice(3, 8), slice(0, 8)), emb.step(slice(4, 9), slice(4, 9)), emb.step((b, t + 1), (b, t + 1))]
    torch.testing.assert_close(parts[0]["q_proj"], pe["q_proj"][:, 3:8])  # token positions, not q's own rows
    torch.testing.assert_close(parts[2]["k_proj"], pe["k_proj"][b, t + 1][None])
    ws = {n: torch.randn(2, 9, 4, generator=g) for n in pe}
    q_rows, kv_rows = [slice(3, 8), slice(4, 9), (b, t + 1)], [slice(0, 8), slice(4, 9), (b, t + 1)]
    loss = sum((p[n] * drafter.rows_of(ws[n], r)).sum() for p, r in zip(parts, kv_rows) for n in ("k_proj", "v_proj"))
    loss = loss + sum((p["q_proj"] * drafter.rows_of(ws["q_proj"], r)).sum() for p, r in zip(parts, q_rows))
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


def test_grouped_gemms_sum_the_input_gradient_in_the_gemms_and_give_the_same_step(monkeypatch):
    """q/k/v and gate/up as one node (KernelOptions.grouped_gemms) where x is in the GEMM dtype (fp32
    here), the same step as one node each; not used where x and the GEMMs differ (the CPU's bf16 GEMMs)."""
    calls = []
    apply = drafter._SharedLinears.apply
    monkeypatch.setattr(drafter._SharedLinears, "apply", lambda *a: calls.append(len(a[1])) or apply(*a))
    for kw in ({}, {"skip_rows": False}, {"shared_emb": False}):
        calls.clear()
        a = loss_and_grads(KernelOptions(**kw))
        # q/k/v's two halves (all three, or k/v beside step 0's fewer queries) and gate/up; without
        # shared_emb q/k/v read one concatenation per step, gate/up alone are grouped
        assert set(calls) == ({2} if kw.get("shared_emb") is False else {2, 3})
        n = len(calls)
        calls.clear()
        assert_same_step(a, loss_and_grads(KernelOptions(grouped_gemms=False, **kw)), atol=1e-6, rtol=1e-5)
        assert calls == [] and n >= K
    loss_and_grads(KernelOptions(), torch.bfloat16)
    assert calls == []  # fp32 activations, bf16 GEMMs: one node each, the sums in fp32 as before


def test_teacher_blas_is_left_alone_off_cuda():
    before = torch.backends.cuda.preferred_blas_library()
    with fused.teacher_blas(KernelOptions(), torch.device("cpu")):
        assert torch.backends.cuda.preferred_blas_library() == before
    assert torch.backends.cuda.preferred_blas_library() == before


def test_grad_acc_fp32_sums_in_fp32_and_stays_close_to_the_bf16_sums():
    x, dy = torch.randn(6, 4, dtype=torch.bfloat16), torch.randn(6, 5, dtype=torch.bfloat16)
    for fp32, dtype in ((False, torch.bfloat16), (True, torch.float32)):
        sink = _GradSink(fp32)
        sink.add(dy.T, x)
        sink.add(dy.T, x)
        assert sink.bufs[None].dtype == dtype  # the option reaches the sink
        torch.testing.assert_close(sink.take(torch.float32), 2 * (dy.float().T @ x.float()), rtol=2e-2, atol=2e-2)
    m = make()
    assert all(s.fp32 for s in TTTWeights(m, torch.float32, torch.bfloat16, grad_acc_fp32=True).sink.values())
    # the CPU's bf16 GEMM mode (TTTObjective's gemm_dtype): the per-step weight gradients are bf16
    bf16 = loss_and_grads(KernelOptions(), torch.bfloat16)
    f32 = loss_and_grads(KernelOptions(grad_acc_fp32=True), torch.bfloat16)
    assert torch.equal(bf16[0], f32[0])  # the forward does not depend on it
    for a, b in zip(f32[1], bf16[1]):
        assert a.dtype == b.dtype == torch.float32 and float((a - b).norm() / b.norm()) < 2e-2


def test_fused_clip_takes_the_same_step_as_clip_then_step():
    """The clip factor as fused AdamW's grad_scale (CPU AdamW has the fused kernel too) against
    clip_grad_norm_ then step; eps 0.1, so the step depends on the gradients' scale and a missing clip shows."""
    def params_after(fused_clip: bool | None, fused_adamw: bool = True):
        g = torch.Generator().manual_seed(5)
        ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (100, 300)]
        opt = torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=0.1, weight_decay=0.01, fused=fused_adamw)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g) * 3  # norm ~60: clipped to 0.5
            if fused_clip is None:
                opt.step()
            else:
                clip_and_step(ps, opt, 0.5, fused_clip=fused_clip)
            assert getattr(opt, "grad_scale", None) is None  # the scale applies to its own step only
        return torch.cat([p.detach() for p in ps])
    plain = params_after(False)
    torch.testing.assert_close(params_after(True), plain, atol=1e-6, rtol=1e-6)
    assert (params_after(None) - plain).abs().max() > 1e-3  # not clipping would have shown
    # not fused (make_optimizer on a CPU): fused_clip falls back to the same two passes, bit for bit
    assert torch.equal(params_after(True, fused_adamw=False), params_after(False, fused_adamw=False))
    assert not make_optimizer([torch.nn.Parameter(torch.ones(2))], 1e-3, 0.0).defaults["fused"]


def test_attention_and_triton_ce_are_accepted_and_the_cpu_runs_its_own_kernels():
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(2, 3, 17, 8, generator=g, requires_grad=True) for _ in range(7)]  # K = 2
    outs = []
    for k in (KernelOptions(), KernelOptions(attention="flash")):
        y = ttt_attention(ts[0], ts[1], ts[2], ts[3:5], ts[5:], 0.3, k)
        outs.append([y, *torch.autograd.grad(y.square().sum(), ts)])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert not attention._refused  # the CPU never asks cuDNN
    z, probs = torch.randn(9, 12, generator=g), torch.softmax(torch.randn(5, 12, generator=g), -1)
    rows, w = torch.randint(0, 5, (9,), generator=g), torch.rand(9, generator=g)
    on = fused.soft_ce_rows(z.clone(), probs, rows, w, torch.float32, KernelOptions(triton_ce=True))
    off = fused.soft_ce_rows(z.clone(), probs, rows, w, torch.float32, KernelOptions(triton_ce=False))
    assert all(torch.equal(a, b) for a, b in zip(on, off))
    assert_same_step(loss_and_grads(KernelOptions(attention="flash", triton_ce=False)),
                     loss_and_grads(KernelOptions()), atol=0, rtol=0)
    with pytest.raises(ValueError, match="attention"):
        KernelOptions(attention="sdpa")


def test_compile_routes_every_region_through_torch_compile(monkeypatch):
    """compile=True sends the elementwise regions through torch.compile (stubbed here to return the
    function itself: the CPU would spend minutes compiling), with the same loss and gradients."""
    seen = []

    def fake_compile(fn, **kw):
        seen.append(fn.__name__)
        return fn
    monkeypatch.setattr(torch, "compile", fake_compile)
    monkeypatch.setattr(fused, "_compiled", {})
    eager = loss_and_grads(KernelOptions())
    assert not seen
    compiled = loss_and_grads(KernelOptions(compile=True, triton_ce=False))
    assert_same_step(compiled, eager, atol=1e-7, rtol=1e-6)
    assert {"norm", "add_norm", "add_rope", "swiglu", "diag_forward", "diag_backward",
            "_soft_ce_torch"} <= set(seen)
    seen.clear()  # every step projecting its own concatenation (KernelOptions.shared_emb off)
    fused._compiled.clear()
    assert_same_step(loss_and_grads(KernelOptions(compile=True, triton_ce=False, shared_emb=False)),
                     loss_and_grads(KernelOptions(shared_emb=False)), atol=1e-7, rtol=1e-6)
    assert {"norm_cat", "add_norm", "rope_qk", "swiglu"} <= set(seen)


def test_compile_routes_the_teachers_softmax_through_torch_compile(monkeypatch):
    """The teacher's argmax, max and softmax are one compiled region (stubbed as above): same labels."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(fn.__name__) or fn)
    monkeypatch.setattr(fused, "_compiled", {})
    g = torch.Generator().manual_seed(5)
    t2d = torch.zeros(64, dtype=torch.bool)
    t2d[torch.randperm(64, generator=g)[:40]] = True
    head = TargetHead(torch.randn(64, 32, generator=g), None, 1e-6).reorder(draft_first_order(t2d))
    last, mask = torch.randn(2, 9, 32, generator=g), torch.rand(2, 9, generator=g) > 0.2
    eager = teacher_labels(head, last, mask, 40, chunk=5)
    compiled = teacher_labels(head, last, mask, 40, chunk=5, kernels=KernelOptions(compile=True))
    assert seen == ["teacher_softmax"]
    assert torch.equal(compiled.target, eager.target) and torch.equal(compiled.probs, eager.probs)


def test_kernel_options_follow_training_compile(tmp_path):
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert kernel_options(training_config(tmp_path), cpu) == KernelOptions()  # compile: None = on a GPU only
    assert kernel_options(training_config(tmp_path), gpu) == KernelOptions(compile=True)
    assert kernel_options(training_config(tmp_path, compile=True), cpu).compile
    assert not kernel_options(training_config(tmp_path, compile=False), gpu).compile
    with pytest.raises(dataclasses.FrozenInstanceError):
        KernelOptions().compile = True


def test_fp8_quantization_keeps_three_mantissa_bits_per_row_and_column():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 48, generator=g) * torch.logspace(-3, 3, 37)[:, None]  # rows of very different sizes
    x8, s = fused.quant_both.eager(x)[:2]
    assert x8.dtype == torch.float8_e4m3fn and s.shape == (37, 1)
    back = x8.float() * s
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + s * 2 ** -9).all()  # e4m3: 3 mantissa bits, subnormals
    assert torch.equal(x8.float().abs().amax(1), torch.full((37,), 448.0))  # each row's largest maps to 448
    c8, cs = fused.quant_both.eager(x)[2:]
    r8, rs = fused.quant_both.eager(x.t().contiguous())[:2]
    assert c8.shape == (48, 37) and c8.is_contiguous() and torch.equal(c8.float(), r8.float()) and torch.equal(cs, rs)
    w = torch.randn(32, 48, generator=g)
    w8, ws = fused.quant_both.eager(w)[:2]
    got = fused.mm_fp8(x8, s, w8, ws, torch.float32)
    torch.testing.assert_close(got, (x8.float() * s) @ (w8.float() * ws).T, rtol=1e-5, atol=1e-4)


def test_fp8_gemms_train_the_same_objective_up_to_fp8_rounding(monkeypatch):
    """fp8_gemms: every layer GEMM (forward, input and weight gradients) goes through the scaled FP8
    GEMM, and loss and gradients stay within FP8's rounding of the bf16/fp32 step's."""
    calls = []
    real = fused.mm_fp8
    monkeypatch.setattr(fused, "mm_fp8", lambda *a: calls.append(a[0].shape) or real(*a))
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
    with pytest.raises(ValueError, match="fp8_gemms needs shared_weights"):
        KernelOptions(fp8_gemms=True, shared_weights=False)


def test_fp8_gemms_follow_the_training_config(tmp_path):
    assert not kernel_options(training_config(tmp_path), torch.device("cpu")).fp8_gemms
    assert kernel_options(training_config(tmp_path, fp8_gemms=True), torch.device("cuda", 0)).fp8_gemms


#: Module-level state that eyas/training may keep: caches and memos of what this process found, none a choice.
MEMOS = {("attention", "_refused"), ("kernels", "_compiled"), ("kernels", "FP32_OUT"),
         ("target_head", "_NAMES"), ("target_head", "_PREFIXES"),  # these two: constant lookup tables
         ("loader", "_DTYPES")}  # a constant lookup table too
#: Module-level strings that are names, not choices: a file name, its format tag, a thread name.
NAMES = {("checkpoints", "SUMS"), ("checkpoints", "SUMS_FORMAT"), ("loader", "THREAD_PREFIX")}


def test_no_module_level_switch_is_left():
    gone = {fused: ["TRITON_CE", "use_compile", "compiling", "compile_scope", "_COMPILE"], losses: ["SKIP_UNSCORED"],
            attention: ["BACKEND"], train: ["FUSED_CLIP"], drafter: ["GRAD_ACC_FP32"]}
    for module, names in gone.items():
        assert not [n for n in names if hasattr(module, n)], module.__name__
    assert "shared_weights" not in vars(TTTObjective)
    for info in pkgutil.iter_modules(eyas.training.__path__):
        module = importlib.import_module(f"eyas.training.{info.name}")
        for name, value in vars(module).items():
            if name.startswith("__") or name == "TYPE_CHECKING":
                continue
            if (info.name, name) not in NAMES:
                assert not isinstance(value, (bool, str)), f"{info.name}.{name}"  # a flag or a mode
            if isinstance(value, (dict, list, set)):
                assert (info.name, name) in MEMOS, f"{info.name}.{name}"
        tree = ast.parse(Path(module.__file__).read_text())
        rebound = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
        assert rebound <= ({"_ce_kernel"} if info.name == "kernels" else set()), (info.name, rebound)
