"""The embedding's share of every TTT step's q/k/v, computed once per unroll.

    pe = emb_proj(drafter, tokens, shared, kernels)   # eyas/training/ttt_step.py: a SharedEmb
    inputs = pe.step(q_rows, kv_rows)                 # {q_proj, k_proj, v_proj} for one TTT step

q/k/v read concat(input_layernorm(embed(token)), hidden_norm(h)), so each is W_e @ emb + W_h @ h
with W_e, W_h the weight's two column blocks. Step k at position t reads the token step 0 reads at
t + k, so its input_layernorm(embed) @ W_e.T is step 0's, shifted: one projection over the unroll's
T + K - 1 tokens serves every step, and its gradients, summed over the steps that read them, reach
W_e and the norm's weight through one GEMM each. Each step's gradient is added in place into one
(B, S, out) buffer per projection (_EmbRows), instead of a zero-filled (B, S, out) tensor, a strided
copy into it and an add per step, as autograd's slicing would cost.
"""

from __future__ import annotations

import torch


def rows_of(x, rows):
    """x (B, S, ...) at `rows`: a slice of S (a view), or gathered (b, t) -> (1, N, ...)."""
    if isinstance(rows, slice):
        return x[:, rows]
    return x[rows][None]


class _EmbSums:
    """An unroll's embedding projections, detached (`data`), and their gradients, one (B, S, out)
    buffer each, made by the first step's backward that reaches it. Holds no graph tensor: the
    autograd nodes hold it."""

    def __init__(self, pe: dict):
        self.data = {n: p.detach() for n, p in pe.items()}
        self.bufs: dict = {}

    def add(self, name: str, rows, dy):  # the buffer's rows `rows` (rows_of's forms) += dy
        buf = self.bufs.get(name)
        if buf is None:
            buf = self.bufs[name] = torch.zeros_like(self.data[name])
        if isinstance(rows, slice):
            # one sequence at a time: buf[b, rows] is contiguous where buf[:, rows] is strided,
            # which runs CUDA's generic elementwise kernel
            # (bench/results/2026-12-05_h200_copies-adds.md)
            for b in range(buf.shape[0]):
                buf[b, rows].add_(dy[b])
        else:  # gathered (b, t), distinct: one indexed add into the flat (B * S, out) rows
            b, t = rows
            buf.view(-1, buf.shape[-1]).index_add_(
                0, b * buf.shape[1] + t, dy.reshape(-1, buf.shape[-1])
            )

    def take(self, name: str):
        return self.bufs.pop(name, None)


class _CollectEmb(torch.autograd.Function):
    """A 0-dim token every step's share of one embedding projection depends on; its backward, which
    autograd runs after all of theirs, hands the summed buffer to the projection."""

    @staticmethod
    def forward(ctx, sums, name, p):
        ctx.sums, ctx.name = sums, name
        return p.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return None, None, ctx.sums.take(ctx.name)


class _EmbRows(torch.autograd.Function):
    """One step's rows of an embedding projection: the forward a view (or gather) of it, the
    backward an in-place add into the unroll's sum (_EmbSums)."""

    @staticmethod
    def forward(ctx, token, sums, name, rows):
        ctx.sums, ctx.name, ctx.rows = sums, name, rows
        return rows_of(sums.data[name], rows)

    @staticmethod
    def backward(ctx, dy):
        ctx.sums.add(ctx.name, ctx.rows, dy)
        return dy.new_zeros(()), None, None, None


class SharedEmb:
    """input_layernorm(embed(tokens)) @ W_e.T for q, k and v over an unroll's S = T + K - 1 tokens,
    handed to each TTT step at its rows (at()). `start`: the first token a projection holds (q's may
    start where the first query does); rows are given in token positions. inplace
    (KernelOptions.emb_inplace): the steps' gradients summed in place (_EmbSums); False: autograd
    sums each step's slice, zero-padded to the whole."""

    def __init__(self, pe: dict, start: dict | None = None, inplace: bool = True):
        self.pe, self.start = pe, start or {}
        grad = inplace and any(p.requires_grad for p in pe.values())
        self.sums = _EmbSums(pe) if grad else None
        self.token = (
            {n: _CollectEmb.apply(self.sums, n, p) for n, p in pe.items()} if grad else None
        )

    def at(self, name: str, rows):
        """The projection `name` at token positions `rows` (a slice, or gathered (b, t))."""
        off = self.start.get(name, 0)
        if off:
            rows = (
                slice(rows.start - off, rows.stop - off)
                if isinstance(rows, slice)
                else (rows[0], rows[1] - off)
            )
        if self.token is None:
            return rows_of(self.pe[name], rows)
        return _EmbRows.apply(self.token[name], self.sums, name, rows)

    def step(self, q_rows, kv_rows) -> dict:
        """{q_proj: at q_rows, k_proj and v_proj: at kv_rows}: one TTT step's inputs."""
        return {
            "q_proj": self.at("q_proj", q_rows),
            "k_proj": self.at("k_proj", kv_rows),
            "v_proj": self.at("v_proj", kv_rows),
        }
