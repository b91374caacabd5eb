"""How a training step runs (KernelOptions), and its elementwise pieces, optionally fused by torch.compile.

    kernels = kernel_options(cfg.training, device)   # once per run; TTTObjective(..., kernels=kernels)
    x = fused.norm_cat(emb, h, w_in, w_hid, eps, compile=kernels.compile)

A drafter step is a handful of large GEMMs (cuBLAS, eager) and, between them, norms, the rotary
embedding, residual adds, SwiGLU, the TTT attention's diagonal terms and the soft cross-entropy over
the draft vocabulary. In eager PyTorch each of those is several kernels, each a full pass over an
activation; at Kimi-K2.5 size they cost about a third of the step
(bench/results/2026-12-03_h200_train-step.md). Each function here is one such region with plain
tensor arguments: called directly it is eager PyTorch (the CPU and the tests use that), and with
`compile=True` it runs through torch.compile, which fuses it into one or two kernels (computing in
fp32 inside and rounding once) and, for the ones autograd sees, fuses the backward too. Sizes are
PyTorch's automatic dynamic shapes: each is a constant until it changes, then symbolic, so the head
size, widths and vocabularies stay constants the kernels index with (all-symbolic sizes cost 2.3% of a
batch-4 step, same record), and a new batch size or sequence length costs one recompile per region,
once.

The soft cross-entropy over the draft vocabulary is a hand-written Triton kernel on CUDA.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # eyas.config needs pydantic; the GPU benchmark imports this module without it
    from eyas.config import TrainingConfig


@dataclass(frozen=True)
class KernelOptions:
    """Which kernels and fusions a training step uses. Every setting computes the same loss and
    gradients (up to rounding; tests/unit/test_kernels.py); the defaults are the fastest measured on
    Hopper GPUs (docs/performance.md, "Training"), except `compile`, which kernel_options turns on
    for a GPU (and fp8_gemms, which training.fp8_gemms sets: not the same arithmetic). The others
    exist so that bench/train.py can measure each optimisation against its absence.

    Built once per run and passed down, never read from a global: TTTObjective(..., kernels=k) hands it
    to the drafter (norms, RoPE, SwiGLU, TTTWeights), the TTT attention and the fused head loss, and
    optimizer_step reads `fused_clip` off the objective. Frozen, so one run cannot change another's.
    """

    #: the elementwise regions below through torch.compile (fused kernels); False: eager PyTorch
    compile: bool = False
    #: the soft cross-entropy as one Triton kernel (CUDA with Triton only; elsewhere the PyTorch math)
    triton_ce: bool = True
    #: teacher, TTT steps >= 1 and head only on the positions the loss mask scores; False: everywhere
    skip_unscored: bool = True
    #: with skip_unscored: gather the positions some step scores, sequence by sequence and position
    #: by position (chat data: user turns between replies drop out); False: the one span from the
    #: batch's first to its last scored position
    skip_rows: bool = True
    #: the causal kernel of the TTT steps >= 1 on CUDA: cuDNN's fused attention or FlashAttention-2
    #: (attention.py; a CPU has one kernel and ignores this)
    attention: Literal["cudnn", "flash"] = "cudnn"
    #: the clip factor inside the fused AdamW kernel (its grad_scale); False: clip_grad_norm_, then the step
    fused_clip: bool = True
    #: the drafter's weight gradients summed over the TTT steps in fp32 (else in the GEMM dtype)
    grad_acc_fp32: bool = False
    #: the drafter's GEMM weights cast once per unroll, their gradients summed inside the GEMMs
    #: (drafter.TTTWeights); False: the nn.Linear modules, summed by autograd
    shared_weights: bool = True
    #: the decoder layer's and fc's GEMMs (forward, input and weight gradients) in FP8 e4m3 with one
    #: scale per row and column (training.fp8_gemms; needs shared_weights): not the same function,
    #: FP8 rounds each operand to 3 mantissa bits. The head, the teacher and attention stay bf16.
    fp8_gemms: bool = False
    #: the embedding's share of q/k/v computed once per unroll (with shared_weights, not with fp8_gemms):
    #: step k at position t reads the token step 0 reads at t + k, so its input_layernorm(embed) @ W_e
    #: is step 0's, shifted; and its gradients summed first, then one input and one weight GEMM.
    #: Also, with skip_unscored, step 0's queries, o_proj and MLP only where a later step or the head
    #: reads them (its keys and values everywhere). False: every step projects its own concatenation.
    shared_emb: bool = True
    #: with shared_emb: each step's gradient of the embedding's share added in place into one buffer
    #: per projection (drafter.SharedEmb); False: autograd sums zero-padded slices of it
    emb_grad_inplace: bool = True
    #: projections that read one input (q/k/v, gate/up) as one autograd node whose input gradient is
    #: summed inside the GEMMs (drafter._SharedLinears; with shared_weights, where the input is in the
    #: GEMM dtype: a GPU); False: one node each, their input gradients summed by autograd's adds
    grouped_gemms: bool = True
    #: queries that are the last rows of the keys (the span path's TTT steps) on cuDNN as two calls,
    #: the keys before the first query unmasked and the rest causal, merged by log-sum-exp
    #: (attention._split_fwd: no padding copies, none of the causal work of the missing rows; tested
    #: on the CPU's kernel). Off: measured at no gain on a GPU
    #: (bench/results/2026-12-05_h100_goal-rows-span-split.md);
    #: False: the missing leading queries as zero rows in one causal call
    span_split: bool = False
    #: the teacher's fp32-output GEMMs through cuBLASLt (CUDA), which runs them ~7% faster than cuBLAS
    #: (bench/results/2026-12-03_h200_train-step.md); False: the default BLAS
    teacher_lt: bool = True
    #: where the teacher's labels are not cached whole (a GPU, or more than training.teacher_cache_gb):
    #: remember per position whether its full-vocabulary argmax lies outside the draft vocabulary
    #: (teacher_cache.ArgmaxMemo), so that a sequence's later epochs run the teacher on the draft
    #: vocabulary's rows only; False: every epoch runs the whole vocabulary (as the first does)
    teacher_memo: bool = True

    def __post_init__(self):
        if self.attention not in ("cudnn", "flash"):
            raise ValueError(f"KernelOptions.attention must be 'cudnn' or 'flash', got {self.attention!r}")
        if self.fp8_gemms and not self.shared_weights:
            raise ValueError("KernelOptions.fp8_gemms needs shared_weights (the FP8 GEMMs live in drafter.TTTWeights)")


DEFAULT = KernelOptions()  # eager, everything else at its default: what a caller that names nothing gets


def kernel_options(cfg: TrainingConfig, device: torch.device) -> KernelOptions:
    """The options a run of `cfg` on `device` uses: torch.compile per training.compile (None: on a GPU
    only), the rest at their defaults."""
    return KernelOptions(compile=device.type == "cuda" if cfg.compile is None else bool(cfg.compile),
                         fp8_gemms=cfg.fp8_gemms)


_compiled: dict = {}  # fn -> its torch.compile'd twin, made on first use (a cache, not a setting)

FP32_OUT = {"mm": True, "addmm": True}  # CUDA bf16 GEMMs with fp32 output (torch >= 2.8); probed once


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 output, from the fp32 accumulator where the backend allows."""
    if a.dtype != torch.float32 and a.is_cuda and FP32_OUT["mm"]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            FP32_OUT["mm"] = False
    return (a @ b).float()


@contextmanager
def teacher_blas(kernels: KernelOptions, device: torch.device):
    """The BLAS the teacher's GEMMs run under: cuBLASLt on CUDA with kernels.teacher_lt, else as it is."""
    if not (kernels.teacher_lt and device.type == "cuda"):
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b in the GEMM's epilogue (beta = 1) where the backend allows."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if a.is_cuda and FP32_OUT["addmm"]:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):
            FP32_OUT["addmm"] = False
    acc.add_((a @ b).float())


def cpu_bf16_gemm() -> bool:
    """Whether this CPU has bf16 matrix units (AMX), where bf16 GEMMs beat fp32 ones ~8x (2.6 against
    0.3 TFLOP/s on 2 cores: docs/performance.md, "Training on a CPU"); without them bf16 GEMMs are
    emulated and slower."""
    init = getattr(torch._C._cpu, "_init_amx", None)  # True where AMX is there and the kernel lets us use it
    try:
        return bool(init()) if init is not None else False
    except RuntimeError:
        return False


#: CPU bf16 GEMMs take their row count rounded up to this: oneDNN builds (JIT) a kernel for each new
#: shape, ~2.5 ms for one of the drafter's GEMMs, more than the GEMM itself; training's sequence
#: lengths vary every step, so unpadded every step would pay it again
#: (bench/results/2026-12-03_cpu2_cpu-train-step.md).
ROW_MULTIPLE = 128


def rows_padded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (M, K) cast to dtype, with zero rows below up to a multiple of ROW_MULTIPLE (one pass)."""
    M = x.shape[0]
    Mp = -(-M // ROW_MULTIPLE) * ROW_MULTIPLE
    out = torch.empty((Mp, *x.shape[1:]), dtype=dtype, device=x.device)
    out[:M] = x
    out[M:] = 0
    return out


def gemm_operand(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (M, K) in a GEMM's dtype: on a CPU in reduced precision with its rows padded (rows_padded),
    elsewhere as it is. Callers take the first M rows of the product."""
    if x.device.type == "cpu" and dtype != torch.float32:
        return rows_padded(x, dtype)
    return x.to(dtype)


# ----------------------------------------------------------------------------- FP8 GEMMs
# Row-wise scaled FP8 (e4m3) GEMMs through torch._scaled_mm: each operand quantized with one scale per
# row along the contraction, so one outlier token or channel costs precision only in its own row. A
# weight-gradient GEMM contracts over tokens, so its operands are quantized per channel and laid out
# transposed (_scaled_mm wants the first operand row-major and the second column-major).

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3 value
FP8_MULTIPLE = 16  # _scaled_mm wants every dimension a multiple of 16 on CUDA


def _quant_rows(x):
    """x (M, K) -> (fp8 (M, K), fp32 scale (M, 1)): x ~= fp8 * scale, row by row."""
    amax = x.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).to(FP8), scale


def _quant_cols_t(x):
    """x (M, K) -> (fp8 (K, M) contiguous, fp32 scale (K, 1)): x.T quantized row by row."""
    xt = x.t()
    amax = xt.abs().amax(-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (xt.float() / scale).to(FP8).contiguous(), scale


def mm_fp8(a8, sa, b8, sb, out_dtype) -> torch.Tensor:
    """(a8 * sa) @ (b8 * sb).T: a8 (M, K), b8 (N, K) row-major fp8, sa (M, 1), sb (N, 1) -> (M, N) out_dtype."""
    return torch._scaled_mm(a8, b8.t(), sa, sb.view(1, -1), out_dtype=out_dtype)


def fp8_pad(n: int) -> int:
    return -(-n // FP8_MULTIPLE) * FP8_MULTIPLE


def _fused(fn):
    """fn(*args) eagerly, or through torch.compile with compile=True (KernelOptions.compile)."""
    def call(*args, compile: bool = False, **kwargs):
        if not compile:
            return fn(*args, **kwargs)
        if fn not in _compiled:
            _raise_recompile_limit()
            _compiled[fn] = torch.compile(fn, dynamic=None, fullgraph=True)  # automatic dynamic shapes
        return _compiled[fn](*args, **kwargs)
    call.__name__, call.__doc__, call.eager = fn.__name__, fn.__doc__, fn
    return call


def _raise_recompile_limit(n: int = 64) -> None:
    """diag_* specialise on the number of TTT steps (a list's length), dtypes add variants, and each
    region compiles once with static sizes, once more when a size first changes."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), n))


def _rms(x, w, eps):  # RMSNorm, statistics in fp32, output in x's dtype
    if not torch.compiler.is_compiling():  # eager: PyTorch's fused kernel
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, (x.shape[-1],), w.to(x.dtype), eps)
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w.to(x.dtype)


@_fused
def norm_cat(emb, h, w_emb, w_h, eps: float):
    """cat(input_layernorm(emb), hidden_norm(h)) -> (B, T, 2H), the attention's input."""
    return torch.cat([_rms(emb, w_emb, eps), _rms(h, w_h, eps)], dim=-1)


@_fused
def norm(x, w, eps: float):
    """rms_norm(x) * w."""
    return _rms(x, w, eps)


@_fused
def add_norm(h, delta, w, eps: float):
    """(h + delta, rms_norm(h + delta) * w): a residual add and the norm that reads it."""
    h = h + delta
    return h, _rms(h, w, eps)


def _rotate(x, cos, sin):  # rotate-half RoPE; cos/sin broadcast over x's heads
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@_fused
def rope_qk(q, k, cos, sin):
    """Rotate-half RoPE on q (B, T, nh, hd) and k (B, T, nkv, hd); cos/sin (T, hd) or (B, T, hd).

    Position-major, as the projections write them: the attention reads them through a transpose, and
    the gradients come back in this layout, so no copy sits between the GEMMs and the attention."""
    cos, sin = cos[..., None, :], sin[..., None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


@_fused
def add_rope(x, p, cos, sin):
    """Rotate-half RoPE of x + p, both (B, T, n, hd) position-major; cos/sin (T, hd) or (B, T, hd): a
    projection of the hidden state plus the embedding's share of it (KernelOptions.shared_emb)."""
    return _rotate(x + p, cos[..., None, :], sin[..., None, :])


@_fused
def swiglu(g, u):
    """silu(g) * u."""
    return F.silu(g) * u



@_fused
def teacher_softmax(z, dtype: torch.dtype):
    """The teacher's draft-vocabulary logits (n, V_d) fp32 -> argmax (n,) (the first maximum), max (n,),
    softmax (n, V_d) in dtype: compiled, one pass that reads z and writes the probabilities once (eager:
    five passes over the 0.5 GB of a 4096-row chunk at Kimi size)."""
    return z.argmax(-1), z.amax(-1), torch.softmax(z, dim=-1).to(dtype)


@_fused
def lse_merge(ya, la, yb, lb):
    """Two attentions of the same queries over disjoint keys -> the attention over both: y (B, nh, L, hd)
    in ya's dtype, lse (fp32) shaped like la ((B, nh, L) or (B, nh, L, 1))."""
    lse = torch.logaddexp(la, lb)
    wa, wb = (torch.exp(x - lse).reshape(*ya.shape[:3], 1) for x in (la, lb))
    return (wa * ya.float() + wb * yb.float()).to(ya.dtype), lse


def _tr(x):  # (B, nh, T, hd) <-> (B, T, nh, hd), and (B, nh, T) <-> (B, T, nh)
    return x.transpose(1, 2)


@_fused
def diag_forward(q, y0, lse0, kd: list, vd: list, scale: float):
    """Merge a causal attention (y0, lse0) with one diagonal key per earlier TTT step.

    q, y0 (B, nh, T, hd); lse0 (B, nh, T) fp32; kd, vd lists of k tensors (B, nh, T, hd) (read in
    place, never stacked) -> y (q's dtype), the merged lse (B, nh, T) and the softmax weights
    a (1+k, B, T, nh) of y0 and of each diagonal key. Computed position-major, so y is laid out
    (B, T, nh, hd) in memory, as o_proj reads it (a view, not a copy).
    """
    qf = _tr(q).float()
    s = torch.stack([_tr(lse0).float()] + [(qf * _tr(k).float()).sum(-1) * scale for k in kd])  # (1+k, B, T, nh)
    lse = torch.logsumexp(s, dim=0)
    a = torch.exp(s - lse)
    y = a[0, ..., None] * _tr(y0).float()
    for j, v in enumerate(vd):
        y = y + a[1 + j, ..., None] * _tr(v).float()
    return _tr(y.to(q.dtype)), _tr(lse).contiguous(), a


@_fused
def diag_backward(dy, y, q, a, kd: list, vd: list, dq0, scale: float):
    """The diagonal terms' gradients, plus dq0 (the flash backward's dq) -> (dq, [dkd], [dvd]), each
    (B, nh, T, hd) laid out (B, T, nh, hd) in memory, as the projections' gradients want them."""
    dyf, qf = _tr(dy).float(), _tr(q).float()
    D = (dyf * _tr(y).float()).sum(-1)  # (B, T, nh), as the flash backward forms it
    dq, dkd, dvd = _tr(dq0).float(), [], []
    for j, (k, v) in enumerate(zip(kd, vd)):
        ds = a[1 + j] * ((dyf * _tr(v).float()).sum(-1) - D) * scale  # (B, T, nh)
        dq = dq + ds[..., None] * _tr(k).float()
        dkd.append(_tr((ds[..., None] * qf).to(k.dtype)))
        dvd.append(_tr((a[1 + j, ..., None] * dyf).to(v.dtype)))
    return _tr(dq.to(q.dtype)), dkd, dvd


def soft_ce_rows(z, probs, rows, w, dz_dtype: torch.dtype, kernels: KernelOptions = DEFAULT):
    """Soft cross-entropy of logits z (n, V) fp32 against probs[rows] (n, V), weighted by w (n,).

    -> (sum_i w_i CE_i, argmax per row, d/dz (n, V) in dz_dtype); probs may be bf16, read in place.
    On CUDA one Triton kernel (below) unless kernels.triton_ce is off, elsewhere the PyTorch math
    (compiled or eager, per kernels.compile).
    """
    if kernels.triton_ce and _triton_ce_ready(z):
        return _soft_ce_triton(z, probs, rows, w, torch.empty(z.shape, dtype=dz_dtype, device=z.device))
    return _soft_ce_torch(z, probs, rows, w, dz_dtype, compile=kernels.compile)


def soft_ce_rows_nograd(z, probs, rows, w, kernels: KernelOptions = DEFAULT):
    """soft_ce_rows without the gradient (evaluation)."""
    if kernels.triton_ce and _triton_ce_ready(z):
        return _soft_ce_triton(z, probs, rows, w, None)[:2]
    return _soft_ce_torch_nograd(z, probs, rows, w, compile=kernels.compile)


@_fused
def _soft_ce_torch(z, probs, rows, w, dz_dtype: torch.dtype):
    # CE_i = lse_i * sum(p_i) - p_i . z_i (z shifted by its row max), and dz = (softmax(z) - p) * w,
    # worked in place on z (the caller's own buffer): few passes over (n, V), which on a CPU decide the
    # step time (docs/performance.md, "Training on a CPU").
    pw = probs.index_select(0, rows).float().mul_(w[:, None])  # (n, V) teacher rows times their weights
    top, pred = z.max(-1, keepdim=True)
    z = z.sub_(top)
    pz = torch.dot(pw.view(-1), z.view(-1))  # sum_i w_i p_i . z_i
    e = z.exp_()
    s = e.sum(-1)
    loss = (s.log() * pw.sum(-1)).sum() - pz
    dz = e.mul_((w / s)[:, None]).sub_(pw)  # softmax * w - p * w
    return loss, pred.view(-1), dz.to(dz_dtype)


@_fused
def _soft_ce_torch_nograd(z, probs, rows, w):
    p = probs[rows].float()
    logq = z - torch.logsumexp(z, dim=-1, keepdim=True)
    return -((p * logq).sum(-1) * w).sum(), z.argmax(-1)


# The soft cross-entropy as one Triton kernel on CUDA: torch.compile's version (dynamic shapes) read
# the (n, 32000) fp32 logits four times and ran at about a quarter of the bandwidth
# (bench/results/2026-12-03_h200_train-step.md);
# this one reads them twice (an online max / sum-exp / argmax pass, then the loss and gradient pass)
# and the teacher's row once. KernelOptions.triton_ce = False: the PyTorch version everywhere.
_ce_kernel = None  # the compiled Triton kernel, built on first use; False once Triton is found missing


def _triton_ce_ready(z: torch.Tensor) -> bool:
    """Whether the Triton kernel can take z: on CUDA, with Triton installed."""
    global _ce_kernel
    if not z.is_cuda:
        return False
    if _ce_kernel is None:
        try:
            _ce_kernel = _build_ce_kernel()
        except ImportError:
            _ce_kernel = False
    return bool(_ce_kernel)


def _soft_ce_triton(z, probs, rows, w, dz, block: int | None = None, warps: int | None = None):
    """The Triton kernel's loss, argmax and (into dz, unless None) gradient; block/warps: a tuning sweep's."""
    n, V = z.shape
    loss = torch.empty(n, dtype=torch.float32, device=z.device)
    pred = torch.empty(n, dtype=torch.long, device=z.device)
    if n:
        z, probs = z.contiguous(), probs.contiguous()
        _ce_kernel[(n,)](z, probs, rows, w.float(), loss, pred, z if dz is None else dz, V, z.stride(0),
                         probs.stride(0), 0 if dz is None else dz.stride(0), GRAD=dz is not None,
                         BLOCK=block or CE_BLOCK, num_warps=warps or CE_WARPS)
    return loss.sum(), pred, dz


CE_BLOCK, CE_WARPS = 4096, 8  # elements per step of a row's loop, warps per row: the H200's best (bench/train.py)


def _build_ce_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def soft_ce_kernel(z_ptr, p_ptr, rows_ptr, w_ptr, loss_ptr, pred_ptr, dz_ptr, V, z_stride, p_stride, dz_stride,
                       GRAD: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + i * z_stride
        p_row = p_ptr + tl.load(rows_ptr + i).to(tl.int64) * p_stride
        w = tl.load(w_ptr + i)
        lanes = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max, sum of exp, first argmax
        acc = tl.zeros([BLOCK], tl.float32)
        arg = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + lanes
            z = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
            m_new = tl.maximum(m, z)
            arg = tl.where(z > m, cols, arg)  # strictly greater: the first index of a tie stays
            acc = acc * tl.where(m == m_new, 1.0, tl.exp(m - m_new)) + tl.where(cols < V, tl.exp(z - m_new), 0.0)
            m = m_new
        top = tl.max(m, 0)
        lse = top + tl.log(tl.sum(acc * tl.exp(m - top), 0))
        tl.store(pred_ptr + i, tl.min(tl.where(m == top, arg, V), 0).to(tl.int64))
        dot = tl.zeros([BLOCK], tl.float32)  # sum p * log q
        for start in range(0, V, BLOCK):
            cols = start + lanes
            inside = cols < V
            logq = tl.load(z_row + cols, mask=inside, other=0.0) - lse
            p = tl.load(p_row + cols, mask=inside, other=0.0).to(tl.float32)
            dot += p * logq
            if GRAD:
                tl.store(dz_ptr + i * dz_stride + cols, ((tl.exp(logq) - p) * w).to(dz_ptr.dtype.element_ty),
                         mask=inside)
        tl.store(loss_ptr + i, -tl.sum(dot, 0) * w)

    return soft_ce_kernel



@_fused
def quant_both(x):
    """x (M, K) -> _quant_rows(x) + _quant_cols_t(x): one read of x when compiled."""
    return (*_quant_rows(x), *_quant_cols_t(x))
