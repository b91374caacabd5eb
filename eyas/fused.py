"""The elementwise pieces of a training step, written once and optionally fused by torch.compile.

    fused.use_compile(True)                 # training.compile, on by default on a GPU
    x = fused.norm_cat(emb, h, w_in, w_hid, eps)

A drafter step is a handful of large GEMMs (cuBLAS, eager) and, between them, norms, the rotary
embedding, residual adds, SwiGLU, the TTT attention's diagonal terms and the soft cross-entropy over
the draft vocabulary. In eager PyTorch each of those is several kernels, each a full pass over an
activation; at Kimi-K2.5 size they cost about a third of the step (docs/performance.md). Each
function here is one such region with plain tensor arguments: called directly it is eager PyTorch
(the CPU and the tests use that), and after `use_compile(True)` it runs through
`torch.compile(dynamic=True)`, which fuses it into one or two kernels (computing in fp32 inside and
rounding once) and, for the ones autograd sees, fuses the backward too. Shapes are dynamic, so a new
batch size or sequence length compiles nothing new.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

_COMPILE = False
_compiled: dict = {}

FP32_OUT = {"mm": True, "addmm": True}  # CUDA bf16 GEMMs with fp32 output (torch >= 2.8); probed once


def mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 output, from the fp32 accumulator where the backend allows."""
    if a.dtype != torch.float32 and a.is_cuda and FP32_OUT["mm"]:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            FP32_OUT["mm"] = False
    return (a @ b).float()


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


def use_compile(enabled: bool) -> None:
    """Route the functions below through torch.compile (True) or run them eagerly (False)."""
    global _COMPILE
    _COMPILE = bool(enabled)


def compiling() -> bool:
    return _COMPILE


@contextlib.contextmanager
def compile_scope(enabled: bool):
    """use_compile(enabled) inside the block, the previous setting after it."""
    before = _COMPILE
    use_compile(enabled)
    try:
        yield
    finally:
        use_compile(before)


def _fused(fn):
    def call(*args, **kwargs):
        if not _COMPILE:
            return fn(*args, **kwargs)
        if fn not in _compiled:
            _raise_recompile_limit()
            _compiled[fn] = torch.compile(fn, dynamic=True, fullgraph=True)
        return _compiled[fn](*args, **kwargs)
    call.__name__, call.__doc__, call.eager = fn.__name__, fn.__doc__, fn
    return call


def _raise_recompile_limit(n: int = 64) -> None:
    """diag_* specialise on the number of TTT steps (a list's length), and dtypes add variants."""
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
def add_norm(h, delta, w, eps: float):
    """(h + delta, rms_norm(h + delta) * w): a residual add and the norm that reads it."""
    h = h + delta
    return h, _rms(h, w, eps)


@_fused
def rope_qk(q, k, cos, sin):
    """Rotate-half RoPE on q (B, nh, T, hd) and k (B, nkv, T, hd); cos/sin (T, hd) or (B, T, hd)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin
    return rot(q), rot(k)


@_fused
def swiglu(g, u):
    """silu(g) * u."""
    return F.silu(g) * u



@_fused
def diag_forward(q, y0, lse0, kd: list, vd: list, scale: float):
    """Merge a causal attention (y0, lse0) with one diagonal key per earlier TTT step.

    q, y0 (B, nh, T, hd); lse0 (B, nh, T) fp32; kd, vd lists of k tensors (B, nh, T, hd) (read in
    place, never stacked) -> y (q's dtype), the merged lse (B, nh, T) and the softmax weights
    a (1+k, B, nh, T) of y0 and of each diagonal key.
    """
    qf = q.float()
    s = torch.stack([lse0.float()] + [(qf * k.float()).sum(-1) * scale for k in kd])  # (1+k, B, nh, T)
    lse = torch.logsumexp(s, dim=0)
    a = torch.exp(s - lse)
    y = a[0, ..., None] * y0.float()
    for j, v in enumerate(vd):
        y = y + a[1 + j, ..., None] * v.float()
    return y.to(q.dtype), lse, a


@_fused
def diag_backward(dy, y, q, a, kd: list, vd: list, dq0, scale: float):
    """The diagonal terms' gradients, plus dq0 (the flash backward's dq) -> (dq, [dkd], [dvd])."""
    dyf, qf = dy.float(), q.float()
    D = (dyf * y.float()).sum(-1)  # (B, nh, T), as the flash backward forms it
    dq, dkd, dvd = dq0.float(), [], []
    for j, (k, v) in enumerate(zip(kd, vd)):
        ds = a[1 + j] * ((dyf * v.float()).sum(-1) - D) * scale  # (B, nh, T)
        dq = dq + ds[..., None] * k.float()
        dkd.append((ds[..., None] * qf).to(k.dtype))
        dvd.append((a[1 + j, ..., None] * dyf).to(v.dtype))
    return dq.to(q.dtype), dkd, dvd


@_fused
def soft_ce_rows(z, probs, rows, w, dz_dtype: torch.dtype):
    """Soft cross-entropy of logits z (n, V) fp32 against probs[rows] (n, V), weighted by w (n,).

    -> (sum_i w_i CE_i, argmax per row, d/dz (n, V) in dz_dtype); probs may be bf16, read in place.
    """
    p = probs[rows].float()
    logq = z - torch.logsumexp(z, dim=-1, keepdim=True)
    loss = -((p * logq).sum(-1) * w).sum()
    return loss, z.argmax(-1), ((torch.exp(logq) - p) * w[:, None]).to(dz_dtype)


@_fused
def soft_ce_rows_nograd(z, probs, rows, w):
    """soft_ce_rows without the gradient (evaluation)."""
    p = probs[rows].float()
    logq = z - torch.logsumexp(z, dim=-1, keepdim=True)
    return -((p * logq).sum(-1) * w).sum(), z.argmax(-1)

