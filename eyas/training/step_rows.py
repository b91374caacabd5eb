"""Where a TTT unroll runs: the positions some step scores, as one span or gathered.

    rows = step_rows(labels, B, T, K, kernels)      # StepRows
    # step k's queries read the tokens at rows.at(k), at positions rows.positions(k)
    teacher_row, inside = rows.teacher_rows(K, B, device)   # which teacher row labels each query

Step 0 computes keys and values at every position before `keys_end` (they are every later step's
causal keys) and its queries at the rows only; the steps >= 1 and every step's head run at the rows
only. Chat data's prompts, padding and the user turns between replies then cost nothing past step
0's keys. The rows are one row index range in one of two layouts:

- a span [s, e) of every sequence, in the batch's own (B, L) layout: slices, views, no copies;
- positions (b, t) gathered into one (1, N) batch, where that skips enough of the span
  (KernelOptions.gather_under): the TTT attention scatters the gathered queries back for its
  causal part (eyas/training/attention.py).

A position is chosen by where the loss mask scores, never by its label's content, so the loss and
its gradients are the same function on every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eyas.training.kernels import KernelOptions

if TYPE_CHECKING:
    from eyas.training.losses import Labels

Rows = slice | tuple[torch.Tensor, torch.Tensor]  # a span of every sequence, or gathered (b, t)


def scored_span(scored: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) of the positions scored in any sequence of the batch, (0, 0) if none (one
    sync)."""
    at = scored.any(0).nonzero().flatten()
    return (int(at[0]), int(at[-1]) + 1) if at.numel() else (0, 0)


def ttt_rows(scored: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(b, t) of the positions where some TTT step k < K scores row (k, b, t), i.e. scored[b,
    t+1+k]: each reply's positions and the K before it, per sequence (one sync). Every position
    where nothing is scored at all (the loss is then 0 and needs a graph all the same)."""
    B, T = scored.shape
    need = torch.zeros_like(scored)
    for k in range(min(K, T - 1)):
        need[:, : T - 1 - k] |= scored[:, 1 + k :]
    b, t = need.nonzero(as_tuple=True)
    if b.numel() == 0:
        b, t = torch.ones_like(scored).nonzero(as_tuple=True)
    return b, t


def ttt_span(labels: Labels, T: int, K: int) -> tuple[int, int]:
    """[s, e): the positions t where some TTT step k < K scores row (k, b, t) in some sequence.

    Row (k, b, t) is scored where labels.scored[b, t+1+k] (t+1+k < T), so with scored positions in
    [first, end) the rows lie in t in [first - K, end - 1). Everything the steps >= 1 compute at a
    position depends only on that position's own chain and on step 0's keys at or before it, so the
    steps may run on this range alone. The whole sequence where nothing is scored."""
    first, end = labels.span if labels.span is not None else scored_span(labels.scored)
    s, e = max(0, first - K), min(end - 1, T)
    return (s, e) if s < e else (0, T)


@dataclass(frozen=True)
class StepRows:
    """The rows a TTT unroll's queries run at (see the module docstring): `rows` a span slice(s, e)
    of every sequence, or gathered (b, t); T the batch's sequence length."""

    rows: Rows
    T: int

    @property
    def gathered(self) -> bool:
        return not isinstance(self.rows, slice)

    @property
    def keys_end(self) -> int:
        """Step 0's keys and values run on positions [0, keys_end): no query reads a later one."""
        return self.T if self.gathered else self.rows.stop

    @property
    def q_from(self) -> int:
        """The first position any step queries (the embedding's share of q starts there)."""
        return 0 if self.gathered else self.rows.start

    @property
    def keep(self) -> Rows | None:
        """Step 0's query rows among its keys' [0, keys_end); None: all of them."""
        if self.gathered:
            return self.rows
        return slice(self.rows.start, None) if self.rows.start else None

    @property
    def where(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (b, t) the gathered queries sit at, for the attention; None: the batch's layout."""
        return self.rows if self.gathered else None

    def at(self, k: int) -> Rows:
        """The token positions step k's queries read: step 0's rows, k later."""
        if self.gathered:
            b, t = self.rows
            return b, t + k
        return slice(self.rows.start + k, self.rows.stop + k)

    def positions(self, k: int, device) -> torch.Tensor:
        """Step k's positions (RoPE): step 0's keys' [0, keys_end), a later step's rows, k later."""
        if k == 0:
            return torch.arange(self.keys_end, device=device)
        if self.gathered:
            return self.rows[1] + k
        return torch.arange(self.rows.start, self.rows.stop, device=device) + k

    def flat(self, hn: torch.Tensor) -> torch.Tensor:
        """A step's output at the rows -> (B, L, H) for a span, (N, H) gathered."""
        return hn[0] if self.gathered else hn

    def teacher_rows(self, K: int, B: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Step k's state at (b, t) is labelled by the teacher at (b, t+1+k) -> (its flat teacher
        row, inside: t+1+k < T), (K, B, L) for a span ((K, 1, L) inside), (K, N) gathered."""
        if self.gathered:
            b, t = self.rows  # (N,) each
        else:
            t = torch.arange(self.rows.start, self.rows.stop, device=device)[None]  # (1, L)
            b = torch.arange(B, device=device)[:, None]  # (B, 1)
        steps = torch.arange(K, device=device).view(K, *([1] * t.dim()))
        src = t[None] + 1 + steps  # (K, N) | (K, 1, L)
        return b[None] * self.T + src.clamp(max=self.T - 1), src < self.T


def step_rows(labels: Labels, B: int, T: int, K: int, kernels: KernelOptions) -> StepRows:
    """The rows a batch's unroll runs at: the span some step scores (kernels.skip_span; else the
    whole sequence), or its scored positions gathered where they are under kernels.gather_under of
    the span's rows."""
    s, e = ttt_span(labels, T, K) if kernels.skip_span else (0, T)
    b, t = ttt_rows(labels.scored, K)
    if b.numel() < kernels.gather_under * B * (e - s):  # they skip enough of the span
        return StepRows((b, t), T)
    return StepRows(slice(s, e), T)
