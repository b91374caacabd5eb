"""The soft cross-entropy of the drafter's logits against the teacher's distribution, row by row.

    loss, argmax, dz = soft_ce_rows(z, probs, rows, w, torch.bfloat16, kernels)

On CUDA one hand-written Triton kernel (unless kernels.triton_ce is off); elsewhere (or without
Triton) the PyTorch math, compiled or eager per kernels.compile.
"""

from __future__ import annotations

import torch

from eyas.training.kernels import DEFAULT, KernelOptions, fusable


def soft_ce_rows(z, probs, rows, w, dz_dtype: torch.dtype, kernels: KernelOptions = DEFAULT):
    """Soft cross-entropy of logits z (n, V) fp32 against probs[rows] (n, V), weighted by w (n,).

    -> (sum_i w_i CE_i, argmax per row, d/dz (n, V) in dz_dtype); probs may be bf16, read in place.
    On CUDA one Triton kernel (below; kernels.triton_ce), elsewhere the PyTorch math (compiled or
    eager, per kernels.compile).
    """
    if kernels.triton_ce and _triton_ce_ready(z):
        return _soft_ce_triton(
            z, probs, rows, w, torch.empty(z.shape, dtype=dz_dtype, device=z.device)
        )
    return _soft_ce_torch(z, probs, rows, w, dz_dtype, compile=kernels.compile)


def soft_ce_rows_nograd(z, probs, rows, w, kernels: KernelOptions = DEFAULT):
    """soft_ce_rows without the gradient (evaluation)."""
    if kernels.triton_ce and _triton_ce_ready(z):
        return _soft_ce_triton(z, probs, rows, w, None)[:2]
    return _soft_ce_torch_nograd(z, probs, rows, w, compile=kernels.compile)


@fusable
def _soft_ce_torch(z, probs, rows, w, dz_dtype: torch.dtype):
    # CE_i = lse_i * sum(p_i) - p_i . z_i (z shifted by its row max), and dz = (softmax(z) - p) * w,
    # worked in place on z (the caller's own buffer): few passes over (n, V), which on a CPU decide
    # the step time (docs/performance.md, "Training on a CPU").
    pw = (
        probs.index_select(0, rows).float().mul_(w[:, None])
    )  # (n, V) teacher rows times their weights
    top, pred = z.max(-1, keepdim=True)
    z = z.sub_(top)
    pz = torch.dot(pw.view(-1), z.view(-1))  # sum_i w_i p_i . z_i
    e = z.exp_()
    s = e.sum(-1)
    loss = (s.log() * pw.sum(-1)).sum() - pz
    dz = e.mul_((w / s)[:, None]).sub_(pw)  # softmax * w - p * w
    return loss, pred.view(-1), dz.to(dz_dtype)


@fusable
def _soft_ce_torch_nograd(z, probs, rows, w):
    p = probs[rows].float()
    logq = z - torch.logsumexp(z, dim=-1, keepdim=True)
    return -((p * logq).sum(-1) * w).sum(), z.argmax(-1)


# The soft cross-entropy as one Triton kernel on CUDA: torch.compile's version (dynamic shapes) read
# the (n, 32000) fp32 logits four times and ran at about a quarter of the bandwidth
# (bench/results/2026-12-03_h200_train-step.md);
# this one reads them twice (an online max / sum-exp / argmax pass, then the loss and gradient pass)
# and the teacher's row once.
_ce_kernel = (
    None  # the compiled Triton kernel, built on first use; False once Triton is found missing
)


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
    """The Triton kernel's loss, argmax and (into dz, unless None) gradient; block/warps: a tuning
    sweep's."""
    n, V = z.shape
    loss = torch.empty(n, dtype=torch.float32, device=z.device)
    pred = torch.empty(n, dtype=torch.long, device=z.device)
    if n:
        z, probs = z.contiguous(), probs.contiguous()
        _ce_kernel[(n,)](
            z,
            probs,
            rows,
            w.float(),
            loss,
            pred,
            z if dz is None else dz,
            V,
            z.stride(0),
            probs.stride(0),
            0 if dz is None else dz.stride(0),
            GRAD=dz is not None,
            BLOCK=block or CE_BLOCK,
            num_warps=warps or CE_WARPS,
        )
    return loss.sum(), pred, dz


CE_BLOCK, CE_WARPS = (
    4096,
    8,
)  # elements per step of a row's loop, warps per row: the H200's best (bench/train.py)


def _build_ce_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def soft_ce_kernel(
        z_ptr,
        p_ptr,
        rows_ptr,
        w_ptr,
        loss_ptr,
        pred_ptr,
        dz_ptr,
        V,
        z_stride,
        p_stride,
        dz_stride,
        GRAD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        i = tl.program_id(0).to(tl.int64)
        z_row = z_ptr + i * z_stride
        p_row = p_ptr + tl.load(rows_ptr + i).to(tl.int64) * p_stride
        w = tl.load(w_ptr + i)
        lanes = tl.arange(0, BLOCK)
        m = tl.full(
            [BLOCK], float("-inf"), tl.float32
        )  # per lane: running max, sum of exp, first argmax
        acc = tl.zeros([BLOCK], tl.float32)
        arg = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + lanes
            z = tl.load(z_row + cols, mask=cols < V, other=float("-inf"))
            m_new = tl.maximum(m, z)
            arg = tl.where(z > m, cols, arg)  # strictly greater: the first index of a tie stays
            acc = acc * tl.where(m == m_new, 1.0, tl.exp(m - m_new)) + tl.where(
                cols < V, tl.exp(z - m_new), 0.0
            )
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
                tl.store(
                    dz_ptr + i * dz_stride + cols,
                    ((tl.exp(logq) - p) * w).to(dz_ptr.dtype.element_ty),
                    mask=inside,
                )
        tl.store(loss_ptr + i, -tl.sum(dot, 0) * w)

    return soft_ce_kernel
