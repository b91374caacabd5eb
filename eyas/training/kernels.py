"""How a training step runs (KernelOptions), and its elementwise regions, optionally fused by
torch.compile.

    # once per run; TTTObjective(..., kernels=kernels)
    kernels = kernel_options(cfg.training, device)
    x = fused.norm(h, w_hid, eps, compile=kernels.compile)

A drafter step is a handful of large GEMMs (cuBLAS, eager; eyas/training/gemm.py) and, between them,
norms, the rotary embedding, residual adds, SwiGLU, the TTT attention's diagonal terms and the soft
cross-entropy over the draft vocabulary (eyas/training/soft_ce.py). In eager PyTorch each of those
is several kernels, each a full pass over an activation; at Kimi-K2.5 size they cost about a third
of the step (bench/results/2026-12-03_h200_train-step.md). Each function here is one such region
with plain tensor arguments: called directly it is eager PyTorch (the CPU and the tests use that),
and with `compile=True` it runs through torch.compile, which fuses it into one or two kernels
(computing in fp32 inside and rounding once) and, for the ones autograd sees, fuses the backward
too. Sizes are PyTorch's automatic dynamic shapes: each is a constant until it changes, then
symbolic, so the head size, widths and vocabularies stay constants the kernels index with
(all-symbolic sizes cost 2.3% of a batch-4 step, same record), and a new batch size or sequence
length costs one recompile per region, once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # eyas.config needs pydantic; the GPU benchmark imports this module without it
    from eyas.config import TrainingConfig


@dataclass(frozen=True)
class KernelOptions:
    """How a training step computes: the user's choices (training.compile, training.fp8_gemms), the
    step's optimisations, each on by default and each the same function off (up to rounding):
    bench/train.py switches them off one by one to measure each against its absence, and the spec
    (reference), the objective's plain unroll to run instead.

    Built once per run and passed down, never read from a global: TTTObjective(..., kernels=k) hands
    it to the TTT step (eyas/training/ttt_step.py), the TTT attention, the fused head loss and the
    teacher; optimizer_step reads fused_clip off the objective. Frozen, so one run cannot change
    another's.
    """

    #: the elementwise regions below through torch.compile (fused kernels); False: eager PyTorch
    compile: bool = False
    #: the decoder layer's and fc's GEMMs (forward, input and weight gradients) in FP8 e4m3 with one
    #: scale per row and column (eyas/training/ttt_weights.py): not the same function, FP8 rounds
    #: each operand to 3 mantissa bits. The head, the teacher and attention stay bf16.
    fp8_gemms: bool = False
    # ---- the step's optimisations
    #: the TTT steps >= 1 and the head only on the span from the batch's first to its last position
    #: some step scores (step_rows.ttt_span); False: on every position
    skip_span: bool = True
    #: gather the positions some step scores (step_rows.ttt_rows) where they are under this share of
    #: the span's rows: the gathers of h and the scatter around every step's attention are copies
    #: that buy nothing when the span holds little else; 0 = never gather (the span), 1 = wherever
    #: anything is skipped
    gather_under: float = 0.9
    #: the embedding's share of every step's q/k/v as one projection per unroll
    #: (eyas/training/shared_emb.py); False: each step projects its own concatenation of embedding
    #: and hidden state (TTTWeights.qkv, which fp8_gemms always takes)
    shared_emb: bool = True
    #: that projection's gradient summed in place, step by step, into one buffer (shared_emb.py);
    #: False: autograd sums each step's zero-padded slice of it
    emb_inplace: bool = True
    #: q/k/v and gate/up, which read one input, as one autograd node whose input gradient is summed
    #: inside the GEMMs (ttt_weights._SharedLinears); False: one node per projection
    grouped_gemms: bool = True
    #: on CUDA, the causal part of the TTT attention on cuDNN's fused attention where cuDNN accepts
    #: the call (eyas/training/attention.py); False: PyTorch's FlashAttention-2 always
    cudnn: bool = True
    #: on CUDA with Triton installed, the head's soft cross-entropy as one Triton kernel
    #: (eyas/training/soft_ce.py); False: the PyTorch math (compiled per `compile`)
    triton_ce: bool = True
    #: on CUDA, the teacher's GEMMs under cuBLASLt (gemm.teacher_blas, ~7% faster); False: under
    #: PyTorch's preferred BLAS as it is
    teacher_cublaslt: bool = True
    #: with a fused AdamW, the gradient clip applied inside its kernel (optim.clip_and_step); False:
    #: clip_grad_norm_ rescales every gradient in a pass of its own, then the step
    fused_clip: bool = True
    # ---- the spec
    #: the TTT objective as the plain drafter unrolled (losses.reference_ttt_loss): every position,
    #: all logits, explicit masks; what the fused objective is held to, slow and memory-hungry at
    #: any real size. The TTT step's options above then go unread, as does TTTObjective's
    #: gemm_dtype (the teacher's and the clip's still apply).
    reference: bool = False


DEFAULT = KernelOptions()  # eager, full precision GEMMs: what a caller that names nothing gets


def kernel_options(cfg: TrainingConfig, device: torch.device) -> KernelOptions:
    """The options a run of `cfg` on `device` uses: torch.compile per training.compile (None: on a
    GPU only), FP8 GEMMs per training.fp8_gemms."""
    return KernelOptions(
        compile=device.type == "cuda" if cfg.compile is None else bool(cfg.compile),
        fp8_gemms=cfg.fp8_gemms,
    )


_compiled: dict = {}  # fn -> its torch.compile'd twin, made on first use (a cache, not a setting)


def fusable(fn):
    """fn(*args) eagerly, or through torch.compile with compile=True (KernelOptions.compile)."""

    def call(*args, compile: bool = False, **kwargs):
        if not compile:
            return fn(*args, **kwargs)
        if fn not in _compiled:
            _raise_recompile_limit()
            _compiled[fn] = torch.compile(
                fn, dynamic=None, fullgraph=True
            )  # automatic dynamic shapes
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


@fusable
def norm(x, w, eps: float):
    """rms_norm(x) * w."""
    return _rms(x, w, eps)


@fusable
def add_norm(h, delta, w, eps: float):
    """(h + delta, rms_norm(h + delta) * w): a residual add and the norm that reads it."""
    h = h + delta
    return h, _rms(h, w, eps)


def _rotate(x, cos, sin):  # rotate-half RoPE; cos/sin broadcast over x's heads
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@fusable
def add_rope(x, p, cos, sin):
    """Rotate-half RoPE of x + p, both (B, T, n, hd) position-major (p None: of x); cos/sin (T, hd)
    or (B, T, hd): a projection of the hidden state plus the embedding's share of it
    (eyas/training/shared_emb.py), or of their concatenation.

    Position-major, as the projections write them: the attention reads them through a transpose, and
    the gradients come back in this layout, so no copy sits between the GEMMs and the attention."""
    return _rotate(x if p is None else x + p, cos[..., None, :], sin[..., None, :])


@fusable
def swiglu(g, u):
    """silu(g) * u."""
    return F.silu(g) * u


@fusable
def teacher_softmax(z, dtype: torch.dtype):
    """The teacher's draft-vocabulary logits (n, V_d) fp32 -> argmax (n,) (the first maximum), max
    (n,), softmax (n, V_d) in dtype: compiled, one pass that reads z and writes the probabilities
    once (eager: five passes over the 0.5 GB of a 4096-row chunk at Kimi size)."""
    return z.argmax(-1), z.amax(-1), torch.softmax(z, dim=-1).to(dtype)


def _tr(x):  # (B, nh, T, hd) <-> (B, T, nh, hd), and (B, nh, T) <-> (B, T, nh)
    return x.transpose(1, 2)


@fusable
def diag_forward(q, y0, lse0, kd: list, vd: list, scale: float):
    """Merge a causal attention (y0, lse0) with one diagonal key per earlier TTT step.

    q, y0 (B, nh, T, hd); lse0 (B, nh, T) fp32; kd, vd lists of k tensors (B, nh, T, hd) (read in
    place, never stacked) -> y (q's dtype), the merged lse (B, nh, T) and the softmax weights
    a (1+k, B, T, nh) of y0 and of each diagonal key. Computed position-major, so y is laid out
    (B, T, nh, hd) in memory, as o_proj reads it (a view, not a copy).
    """
    qf = _tr(q).float()
    s = torch.stack(
        [_tr(lse0).float()] + [(qf * _tr(k).float()).sum(-1) * scale for k in kd]
    )  # (1+k, B, T, nh)
    lse = torch.logsumexp(s, dim=0)
    a = torch.exp(s - lse)
    y = a[0, ..., None] * _tr(y0).float()
    for j, v in enumerate(vd):
        y = y + a[1 + j, ..., None] * _tr(v).float()
    return _tr(y.to(q.dtype)), _tr(lse).contiguous(), a


@fusable
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
