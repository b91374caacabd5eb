"""Training-time-test attention without the (T, T*k) score matrix.

    # q (B, nh, T, hd); kd/vd: lists of (B, nh, T, hd)
    y = ttt_attention(q, k0, v0, kd, vd, scale, kernels)

At TTT step k the query at position t attends to step 0's keys at positions <= t (causal) and to
its own position t in each of steps 1..k (one key per step: the diagonal). Written as one softmax
over both, that is a flash-attention pass over step 0's keys, giving y0 and its log-sum-exp lse0,
plus k diagonal scores s_j = q . kd_j * scale per position, merged by log-sum-exp:

    lse = logsumexp(lse0, s_1..s_k);  y = exp(lse0 - lse) y0 + sum_j exp(s_j - lse) vd_j

The backward does the same: the flash backward kernel run with the *merged* output and lse computes
exactly the step-0 part of the merged softmax's gradient (it forms P = exp(S - lse) and
D = rowsum(dy * y) itself; ring attention uses the same identity), and the diagonal part is a few
elementwise products (eyas/training/kernels.py: one or two kernels each under torch.compile),
reading the diagonal keys/values where they lie (a list, never a stacked copy). Memory is O(T) per
head, never O(T^2), and the work is one causal attention plus O(k T hd).

The queries may be the last rows of a shorter range than step 0's keys (q (B, nh, L, hd), k0/v0
(B, nh, S, hd), L <= S: query i sits at key position S - L + i, the bottom-right-aligned causal mask
of FlashAttention-2): TTTObjective runs the steps >= 1 only at the positions some step scores.

The flash kernels are PyTorch's own: on CUDA in bf16/fp16 cuDNN's
`aten._scaled_dot_product_cudnn_attention` (or `aten._scaled_dot_product_flash_attention` where
cuDNN refuses a call), on the CPU the flash `_for_cpu` twin; elsewhere
`reference_ttt_attention` (plain autograd math, O(T^2) memory) is used, and the tests hold the two
equal, gradients included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.training import kernels as fused
from eyas.training.kernels import DEFAULT, KernelOptions

aten = torch.ops.aten


# The kernel for the causal part of the TTT steps on CUDA: cuDNN's fused attention (the kernel
# PyTorch's sdpa picks for step 0 on Hopper), or PyTorch's FlashAttention-2 where cuDNN refuses.
# Both return the log-sum-exp and take it back in the backward, which the merge below needs. Queries
# shorter than the keys (the last rows of the key range): flash aligns its causal mask bottom-right
# itself; cuDNN (whose alignment is not promised) and the CPU kernel (top-left) get the missing
# leading queries as zero rows, which cost a copy of q and a sliver of the causal work, and add
# nothing to the gradients. (Two calls without padding, merged by log-sum-exp, measured no faster:
# bench/results/2026-12-05_h100_goal-rows-span-split.md.)
#
# Not a setting but a memo of what this process's cuDNN accepted: once it refuses a call (a shape or
# dtype its build does not support), every later call goes to flash instead of failing (and paying a
# refused cuDNN call) again.
_refused: set[str] = set()


def _flash_ok(q: torch.Tensor) -> bool:
    if q.device.type == "cuda":
        return q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256
    return q.device.type == "cpu"


def _pad_front(t, n: int):
    """n zero rows before t's rows (dim 2), in t's memory layout (position-major (B, T, nh, hd)
    stays so)."""
    if n == 0:
        return t
    shape = t.shape[:2] + (t.shape[2] + n,) + t.shape[3:]
    if t.dim() == 4 and t.stride(1) < t.stride(2):
        out = t.new_empty(shape[0], shape[2], shape[1], shape[3]).transpose(1, 2)
    else:
        out = t.new_empty(shape)
    out[:, :, :n].zero_()
    out[:, :, n:].copy_(t)
    return out


def _cudnn_fwd(q, k, v, scale, causal: bool):
    out = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    return out[0], out[1], tuple(out[2:8])


def _cudnn_bwd(dy, q, k, v, y, lse, state, scale, causal: bool):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return aten._scaled_dot_product_cudnn_attention_backward(
        dy,
        q,
        k,
        v,
        y,
        lse,
        seed,
        offset,
        None,
        cum_q,
        cum_k,
        max_q,
        max_k,
        0.0,
        causal,
        scale=scale,
    )


def _cpu_fwd(q, k, v, scale, causal: bool):
    y, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return y, lse, None


def _cpu_bwd(dy, q, k, v, y, lse, state, scale, causal: bool):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dy, q, k, v, y, lse, 0.0, causal, scale=scale
    )


def _padded_fwd(q, k, v, scale, fwd):
    """Causal attention of queries that are the last L of the S keys, in one top-left-aligned causal
    call: the missing S - L leading queries as zero rows, their outputs dropped."""
    off = k.shape[2] - q.shape[2]
    y, lse, state = fwd(_pad_front(q, off), k, v, scale, True)
    return y[:, :, off:], lse[:, :, off:], state


def _padded_bwd(dy, q, k, v, y, lse, state, scale, bwd):
    """_padded_fwd's gradients: with dy = 0 on the zero rows, they add nothing to dk, dv."""
    off = k.shape[2] - q.shape[2]
    dq, dk, dv = bwd(
        _pad_front(dy, off),
        _pad_front(q, off),
        k,
        v,
        _pad_front(y, off),
        _pad_front(lse, off),
        state,
        scale,
        True,
    )
    return dq[:, :, off:], dk, dv


def _flash_fwd(q, k, v, scale, cudnn: bool = True):
    """Causal attention -> (y (B, nh, L, hd), lse (fp32, (B, nh, L) or (B, nh, L, 1)), state for the
    backward): cuDNN on CUDA (flash where it refuses, or without `cudnn`: KernelOptions.cudnn), the
    CPU's one kernel elsewhere."""
    if q.device.type == "cuda":
        if cudnn and "cudnn" not in _refused:
            try:
                y, lse, state = _padded_fwd(q, k, v, scale, _cudnn_fwd)
                return y, lse, ("cudnn", state)
            except RuntimeError:
                _refused.add("cudnn")
        out = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
        return out[0], out[1], ("flash", *out[2:8])
    return _padded_fwd(q, k, v, scale, _cpu_fwd)  # the CPU kernel aligns the mask top-left


def _flash_bwd(dy, q, k, v, y, lse, state, scale):
    if q.device.type == "cuda":
        kind, *state = state
        if kind == "cudnn":
            return _padded_bwd(dy, q, k, v, y, lse, state[0], scale, _cudnn_bwd)
        cum_q, cum_k, max_q, max_k, rng, unused = state
        return aten._scaled_dot_product_flash_attention_backward(
            dy, q, k, v, y, lse, cum_q, cum_k, max_q, max_k, 0.0, True, rng, unused, scale=scale
        )
    return _padded_bwd(dy, q, k, v, y, lse, state, scale, _cpu_bwd)


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, q, k0, v0, scale, n, kernels, *kv
    ):  # kv: n diagonal keys, then n values, (B, nh, T, hd) each
        # y0 (B, nh, T, hd), lse0 (B, nh, T[, 1])
        y0, lse0, state = _flash_fwd(q, k0, v0, scale, kernels.cudnn)
        if (
            n == 0
        ):  # step 0's queries shorter than its keys: the causal part alone, nothing to merge;
            # y dense and laid out like q, as the merge lays it (the kernels' backward wants dy like
            # y)
            y, lse, a = torch.empty_like(q).copy_(y0), lse0, None
        else:
            y, lse, a = fused.diag_forward(
                q,
                y0,
                lse0.view(q.shape[:3]),
                list(kv[:n]),
                list(kv[n:]),
                scale,
                compile=kernels.compile,
            )
        ctx.scale, ctx.state, ctx.n, ctx.lse_meta = scale, state, n, (lse0.shape, lse0.dtype)
        ctx.compile = kernels.compile
        ctx.save_for_backward(q, k0, v0, y, lse, a, *kv)
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k0, v0, y, lse, a, *kv = ctx.saved_tensors
        n = ctx.n
        if dy.stride() != y.stride():  # the kernels want dy laid out like y
            dy = torch.empty_like(y).copy_(dy)
        dq0, dk0, dv0 = _flash_bwd(
            dy, q, k0, v0, y, lse.view(ctx.lse_meta[0]).to(ctx.lse_meta[1]), ctx.state, ctx.scale
        )
        if n == 0:  # dq dense and laid out like q (dq0 may be a slice of the kernel's padded rows)
            return torch.empty_like(q).copy_(dq0), dk0, dv0, None, None, None
        dq, dkd, dvd = fused.diag_backward(
            dy, y, q, a, list(kv[:n]), list(kv[n:]), dq0, ctx.scale, compile=ctx.compile
        )
        return dq, dk0, dv0, None, None, None, *dkd, *dvd


def _scatter(x, b, t, B: int, T: int):
    """(1, nh, N, hd) rows sitting at positions (b[i], t[i]) -> (B, nh, T, hd), zeros elsewhere,
    laid out (B, T, nh, hd) in memory (position-major, as the kernels and the projections lay
    it)."""
    out = x.new_zeros(B, T, x.shape[1], x.shape[3])
    out[b, t] = x[0].transpose(0, 1)
    return out.transpose(1, 2)


def _gather_rows(x, b, t):
    """(B, nh, T, ...) -> (1, nh, N, ...) at positions (b[i], t[i]), position-major (a view of (N,
    nh, ...))."""
    g = x.transpose(1, 2)[b, t]  # (N, nh, ...)
    return g.transpose(0, 1)[None]


class _TTTAttentionRows(torch.autograd.Function):
    """TTT attention for query rows gathered from a (B, T) batch: the causal part runs on the whole
    batch with the missing rows as zero queries (one kernel call, as for every position), the merge
    with the diagonal keys on the gathered rows only. The backward hands the flash kernel the merged
    output and lse at the gathered rows and dy = 0 elsewhere (those rows add nothing to dk0,
    dv0)."""

    @staticmethod
    def forward(
        ctx, q, k0, v0, b, t, scale, n, kernels, *kv
    ):  # q, kv (1, nh, N, hd); k0, v0 (B, nh, T, hd)
        B, nh, T, hd = k0.shape
        qf = _scatter(q, b, t, B, T)  # (B, nh, T, hd)
        y0, raw, state = _flash_fwd(qf, k0, v0, scale, kernels.cudnn)
        lse0 = raw.view(B, nh, T).float()
        if n == 0:  # step 0's queries at the gathered rows: the causal part alone, nothing to merge
            y, lse, a = _gather_rows(y0, b, t), lse0[b, :, t].T[None], None
        else:
            y, lse, a = fused.diag_forward(
                q,
                _gather_rows(y0, b, t),
                lse0[b, :, t].T[None],
                list(kv[:n]),
                list(kv[n:]),
                scale,
                compile=kernels.compile,
            )  # y (1, nh, N, hd), lse (1, nh, N)
        ctx.scale, ctx.state, ctx.n, ctx.compile, ctx.lse_meta = (
            scale,
            state,
            n,
            kernels.compile,
            (raw.shape, raw.dtype),
        )
        ctx.save_for_backward(q, k0, v0, b, t, y, lse, lse0, a, *kv)
        return y

    @staticmethod
    def backward(ctx, dy):
        q, k0, v0, b, t, y, lse, lse0, a, *kv = ctx.saved_tensors
        B, nh, T, hd = k0.shape
        n = ctx.n
        lse_full = (
            lse0.clone()
        )  # (B, nh, T): the merged lse at the gathered rows, step 0's elsewhere (finite)
        lse_full[b, :, t] = lse[0].T
        dq0, dk0, dv0 = _flash_bwd(
            _scatter(dy, b, t, B, T),
            _scatter(q, b, t, B, T),
            k0,
            v0,
            _scatter(y, b, t, B, T),
            lse_full.view(ctx.lse_meta[0]).to(ctx.lse_meta[1]),
            ctx.state,
            ctx.scale,
        )
        if n == 0:
            return _gather_rows(dq0, b, t), dk0, dv0, None, None, None, None, None
        dq, dkd, dvd = fused.diag_backward(
            dy,
            y,
            q,
            a,
            list(kv[:n]),
            list(kv[n:]),
            _gather_rows(dq0, b, t),
            ctx.scale,
            compile=ctx.compile,
        )
        return dq, dk0, dv0, None, None, None, None, None, *dkd, *dvd


def reference_ttt_attention(q, k0, v0, kd: list, vd: list, scale: float) -> torch.Tensor:
    """The same function in plain autograd math: causal scores over k0 plus one diagonal column per
    step."""
    L, S = q.shape[2], k0.shape[2]
    att = (q @ k0.transpose(-2, -1)) * scale  # (B, nh, L, S)
    att = att.masked_fill(
        torch.ones(L, S, dtype=torch.bool, device=q.device).triu(1 + S - L), float("-inf")
    )
    extra = [(q * k).sum(-1, keepdim=True) * scale for k in kd]  # (B, nh, L, 1) each
    att = F.softmax(torch.cat([att, *extra], dim=-1).float(), dim=-1).to(q.dtype)
    y = att[..., :S] @ v0  # (B, nh, L, hd)
    for j, v in enumerate(vd):
        y = y + att[..., S + j, None] * v
    return y


def reference_ttt_attention_rows(q, k0, v0, kd: list, vd: list, scale: float, b, t) -> torch.Tensor:
    """reference_ttt_attention for query rows gathered at (b[i], t[i]): row i attends to k0[b[i]] at
    positions <= t[i] and to its own diagonal keys. q, kd, vd (1, nh, N, hd); k0, v0 (B, nh, T,
    hd)."""
    T = k0.shape[2]
    qn = q[0].transpose(0, 1)  # (N, nh, hd)
    att = torch.einsum("nhd,nhsd->nhs", qn, k0[b]) * scale  # (N, nh, T)
    att = att.masked_fill(
        (torch.arange(T, device=q.device)[None] > t[:, None])[:, None], float("-inf")
    )
    extra = [
        (qn * k[0].transpose(0, 1)).sum(-1, keepdim=True) * scale for k in kd
    ]  # (N, nh, 1) each
    att = F.softmax(torch.cat([att, *extra], dim=-1).float(), dim=-1).to(q.dtype)
    y = torch.einsum("nhs,nhsd->nhd", att[..., :T], v0[b])  # (N, nh, hd)
    for j, v in enumerate(vd):
        y = y + att[..., T + j, None] * v[0].transpose(0, 1)
    return y.transpose(0, 1)[None]


def ttt_attention(
    q,
    k0,
    v0,
    kd: list,
    vd: list,
    scale: float,
    kernels: KernelOptions = DEFAULT,
    where: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Step-k TTT attention (see the module docstring); q, kd, vd (B, nh, L, hd), k0, v0 (B, nh, S
    >= L, hd), heads expanded. kernels: whether the diagonal terms are compiled.

    where: the queries are rows gathered from k0's batch, row i at (where[0][i], where[1][i]); then
    q, kd, vd are (1, nh, N, hd) (TTTObjective's per-position skipping)."""
    if where is not None:
        if not _flash_ok(q):
            return reference_ttt_attention_rows(q, k0, v0, kd, vd, scale, *where)
        return _TTTAttentionRows.apply(q, k0, v0, *where, scale, len(kd), kernels, *kd, *vd)
    if not kd and q.shape[2] == k0.shape[2]:
        return F.scaled_dot_product_attention(q, k0, v0, is_causal=True, scale=scale)
    if not _flash_ok(q):
        return reference_ttt_attention(q, k0, v0, kd, vd, scale)
    return _TTTAttention.apply(q, k0, v0, scale, len(kd), kernels, *kd, *vd)
