"""One TTT step of the drafter as training runs it: the plain model's function, through fused
kernels.

    # once per unroll (eyas/training/ttt_weights.py)
    weights = TTTWeights(drafter, dtype, halves=True)
    # the embedding's share of q/k/v, once per unroll
    pe = emb_proj(drafter, tokens, weights, kernels)
    kv = TTTKeys()
    # step 0
    h, hn = ttt_step(drafter, aux, pe.step(rows, rows), positions, kv, weights, kernels)
    # step 1, ...
    h, hn = ttt_step(drafter, h, pe.step(rows1, rows1), positions + 1, kv, weights, kernels)

Each step computes what Eagle3Drafter.forward computes under ttt_mask (eyas/training/drafter.py),
-> (h, norm(h)): the GEMMs through the unroll's TTTWeights (each weight cast once, its gradient
summed inside the GEMMs), the embedding's share of q/k/v taken from one projection per unroll
(eyas/training/shared_emb.py), the elementwise regions as eyas/training/kernels.py's functions
(fused by torch.compile with kernels.compile), and the attention as one causal flash attention plus
diagonal terms (eyas/training/attention.py), never forming the (T, T * k) scores.

How q/k/v read concat(input_layernorm(embed), hidden_norm(h)) is the weights' detail
(TTTWeights.qkv): in two column blocks, the embedding's block projected once per unroll; or, where
the FP8 GEMMs (training.fp8_gemms) quantize q/k/v's weights whole, each step's own concatenation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from eyas.training import kernels as fused
from eyas.training.attention import ttt_attention
from eyas.training.drafter import MLP, Attention, Eagle3Drafter, rope_cos_sin
from eyas.training.kernels import KernelOptions
from eyas.training.shared_emb import SharedEmb, rows_of
from eyas.training.ttt_weights import TTTWeights


class TTTKeys(list):
    """What a TTT unroll's attention reads across its steps: step 0's (k, v) for every position of
    the (B, T) batch, then one diagonal (k, v) per later step. `where`: the (b, t) positions of the
    queries when they run gathered, as a (1, N) batch (eyas/training/step_rows.py); None: they run
    on the batch's own (B, L) layout."""

    def __init__(self, where: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.where = where


class _SwiGLU(torch.autograd.Function):
    """silu(g) * u keeping only g and u for the backward (silu(g) is recomputed): a third less MLP
    memory."""

    @staticmethod
    def forward(ctx, g, u):  # (B, T, I) each
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, dy):  # the same kernels autograd would run for F.silu(g) * u
        g, u = ctx.saved_tensors
        return torch.ops.aten.silu_backward(dy * u, g), dy * F.silu(g)


def _mlp(mlp: MLP, x, weights: TTTWeights, kernels: KernelOptions):  # (B, L, H) -> (B, L, H)
    g, u = weights.linears(("gate_proj", "up_proj"), x)  # (B, L, I) each
    return weights.linear(
        "down_proj", fused.swiglu(g, u, compile=True) if kernels.compile else _SwiGLU.apply(g, u)
    )


def _attend(attn: Attention, q, ttt: TTTKeys, weights: TTTWeights, kernels: KernelOptions, where):
    """q (B, nh, L, hd) against step 0's keys (causal) and each later step's diagonal key ->
    o_proj's output."""
    (k0, v0), diag = ttt[0], ttt[1:]
    y = ttt_attention(
        q,
        attn.heads(k0),
        attn.heads(v0),
        [attn.heads(kd) for kd, _ in diag],
        [attn.heads(vd) for _, vd in diag],
        1.0 / math.sqrt(attn.hd),
        kernels,
        where,
    )  # (B, nh, L, hd)
    B, _, L, _ = y.shape
    return weights.linear("o_proj", y.transpose(1, 2).reshape(B, L, attn.nh * attn.hd))


def _rows(x, keep):
    """x (B, L, ...) at the rows `keep` names: None all, a slice of L, or gathered (b, t) -> (1, N,
    ...)."""
    return x if keep is None else rows_of(x, keep)


def _pos_rows(x, keep):
    """A per-position table (L, ...) (RoPE's cos/sin) at the rows `keep` names (see _rows)."""
    if keep is None:
        return x
    return x[keep] if isinstance(keep, slice) else x[keep[1]]


def emb_proj(
    m: Eagle3Drafter,
    tokens: torch.Tensor,
    weights: TTTWeights,
    kernels: KernelOptions,
    q_from: int = 0,
) -> SharedEmb:
    """What every TTT step reads of its token, once per unroll: tokens (B, S) -> SharedEmb of
    {q_proj, k_proj, v_proj: (B, S, out)}.

    With weights.halves, input_layernorm(embed(tokens)) @ W_e.T for each, W_e its embedding columns:
    the part of every step's q/k/v that depends on its token alone (q_proj from token q_from on: no
    step queries the tokens before). Without, input_layernorm(embed(tokens)) itself, which each
    step's q/k/v GEMM concatenates with its hidden state."""
    norm = m.midlayer.input_layernorm
    e = m.embed_tokens(tokens).to(weights.dtype)  # (B, S, H), frozen
    en = fused.norm(e, norm.weight, norm.eps, compile=kernels.compile)
    if not weights.halves:
        return SharedEmb({"q_proj": en, "k_proj": en, "v_proj": en}, inplace=False)
    names = (
        ("k_proj", "v_proj") if q_from else ("q_proj", "k_proj", "v_proj")
    )  # q apart where it starts later
    pe = dict(zip(names, weights.linears(names, en, 0)))
    if q_from:
        pe["q_proj"] = weights.linear("q_proj", en[:, q_from:], 0)
    return SharedEmb(pe, {"q_proj": q_from}, kernels.emb_inplace)


def ttt_step(
    m: Eagle3Drafter,
    hidden,
    emb: dict,
    positions,
    ttt: TTTKeys,
    weights: TTTWeights,
    kernels: KernelOptions,
    keep=None,
):
    """One TTT step -> (h, norm(h)) (B, Lq, H) at the query rows.

    hidden (B, L, num_aux*H_t) the target's aux states (step 0) or (B, L, H) the previous step's h;
    emb {k_proj, v_proj: (B, L, ...), q_proj: the same at the query rows} what the step reads of its
    tokens (emb_proj's SharedEmb.step); positions (L,). keep (step 0 of a skipping unroll): the
    queries only at these rows, a slice of L (the last rows: bottom-right causal) or gathered (b, t)
    -> (1, N); keys and values at every row, since they are every later step's causal keys."""
    layer, c = m.midlayer, kernels.compile
    if hidden.shape[-1] != m.cfg.hidden_size:
        hidden = weights.linear("fc", hidden)  # (B, L, H)
    cos, sin = (
        t.to(hidden.dtype) for t in rope_cos_sin(positions, m.cfg.head_dim, m.cfg.rope_theta)
    )
    x = fused.norm(hidden, layer.hidden_norm.weight, layer.hidden_norm.eps, compile=c)  # (B, L, H)
    a = _attention(layer.self_attn, x, emb, cos, sin, ttt, weights, kernels, keep)  # (B, Lq, H)
    post = layer.post_attention_layernorm
    h, x = fused.add_norm(
        _rows(hidden, keep), a, post.weight, post.eps, compile=c
    )  # the residual starts at h
    return fused.add_norm(
        h, _mlp(layer.mlp, x, weights, kernels), m.norm.weight, m.norm.eps, compile=c
    )


def _attention(
    attn: Attention,
    x,
    emb: dict,
    cos,
    sin,
    ttt: TTTKeys,
    weights: TTTWeights,
    kernels: KernelOptions,
    keep,
):
    """x (B, L, H) hidden_norm(h); q/k/v of concat(emb, x) -> o_proj's output at the query rows."""
    B, L, _ = x.shape
    nh, nkv, hd, c = attn.nh, attn.nkv, attn.hd, kernels.compile
    (yq, pq), (yk, pk), (yv, pv) = weights.qkv(x, emb, keep)  # GEMM, embedding's share or None
    k = fused.add_rope(yk.view(B, L, nkv, hd), _heads(pk, nkv, hd), cos, sin, compile=c)
    k = k.transpose(1, 2)  # (B, nkv, L, hd)
    v = (yv if pv is None else yv + pv).view(B, L, nkv, hd).transpose(1, 2)  # (B, nkv, L, hd)
    Bq, Lq = yq.shape[:2]
    q = fused.add_rope(
        yq.view(Bq, Lq, nh, hd),
        _heads(pq, nh, hd),
        _pos_rows(cos, keep),
        _pos_rows(sin, keep),
        compile=c,
    ).transpose(1, 2)  # (Bq, nh, Lq, hd)
    ttt.append((k, v))
    return _attend(attn, q, ttt, weights, kernels, ttt.where)


def _heads(share, n: int, hd: int):  # (B, L, n * hd) -> (B, L, n, hd); None stays None
    return None if share is None else share.view(*share.shape[:2], n, hd)
