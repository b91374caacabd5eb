"""FP8 (e4m3) storage of hidden states with one scale per token and layer, and its error.

    # x [n, 3*H] -> q [n, 3*H] float8_e4m3fn, scale [n, 3] f32
    q, scale = quantize(x, groups=3)
    x_hat = dequantize(q, scale)               # float32 [n, 3*H]; readers cast it to bf16
    err = Fp8Error(groups=3); err.add(x, q, scale); err.summary()

Each (token, layer) row of H values is scaled so that its largest magnitude maps to 448, the largest
finite e4m3 value, then rounded to e4m3 (3 mantissa bits: a relative rounding error of at most
2**-4 for normal values). Per-token scales follow the norm of each token, which in LLM residual
streams varies by orders of magnitude between tokens and between layers. Storage per token and
layer: H bytes plus one float32 scale, about half of bf16.
"""

from __future__ import annotations

import math

import torch

from eyas.errors import InvalidInput

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, G*H] (any float dtype) -> (q [n, G*H] e4m3, scale [n, G] float32), per-row-group
    scale."""
    n, width = x.shape
    if width % groups:
        raise InvalidInput(f"fp8 quantize: width {width} is not a multiple of {groups} groups")
    xf = x.detach().to(torch.float32).reshape(n, groups, width // groups)
    amax = xf.abs().amax(dim=-1)
    # An all-zero row gets scale 1 (its values are 0 whatever the scale); tiny rows stay exact-ish.
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (xf / scale.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return q.reshape(n, width), scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """(q [n, G*H] e4m3, scale [n, G]) -> x_hat [n, G*H] in dtype (computed in float32)."""
    n, width = q.shape
    groups = scale.shape[1]
    x = q.to(torch.float32).reshape(n, groups, width // groups) * scale.to(torch.float32).unsqueeze(
        -1
    )
    return x.reshape(n, width).to(dtype)


class Fp8Error:
    """Accumulates the reconstruction error of quantized rows, per group (layer).

    rel_rms[g] = sqrt(sum |x - x_hat|^2 / sum |x|^2) over every token of group g;
    max_token_rel = the worst single (token, group) row: |x - x_hat| / |x|;
    min_cosine = the smallest cosine similarity between a row and its reconstruction.
    """

    def __init__(self, groups: int):
        self.groups = groups
        self.err2 = torch.zeros(groups, dtype=torch.float64)
        self.ref2 = torch.zeros(groups, dtype=torch.float64)
        self.max_token_rel = 0.0
        self.min_cosine = 1.0
        self.rows = 0

    def add(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> None:
        n, width = x.shape
        xf = x.detach().to(torch.float32).reshape(n, self.groups, width // self.groups)
        xh = dequantize(q, scale).reshape(n, self.groups, width // self.groups)
        e2 = (xf - xh).pow(2).sum(-1, dtype=torch.float64)  # [n, G]
        r2 = xf.pow(2).sum(-1, dtype=torch.float64)
        self.err2 += e2.sum(0)
        self.ref2 += r2.sum(0)
        nonzero = r2 > 0
        if nonzero.any():
            self.max_token_rel = max(
                self.max_token_rel, float((e2[nonzero] / r2[nonzero]).sqrt().max())
            )
            cos = (xf * xh).sum(-1, dtype=torch.float64) / (
                r2.sqrt() * xh.pow(2).sum(-1, dtype=torch.float64).sqrt()
            )
            self.min_cosine = min(self.min_cosine, float(cos[nonzero].min()))
        self.rows += n

    def merge(self, other: "Fp8Error") -> None:
        self.err2 += other.err2
        self.ref2 += other.ref2
        self.max_token_rel = max(self.max_token_rel, other.max_token_rel)
        self.min_cosine = min(self.min_cosine, other.min_cosine)
        self.rows += other.rows

    def summary(self) -> dict:
        rel = [
            math.sqrt(e / r) if r > 0 else 0.0
            for e, r in zip(self.err2.tolist(), self.ref2.tolist())
        ]
        return {
            "rel_rms": [round(v, 6) for v in rel],
            "max_token_rel": round(self.max_token_rel, 6),
            "min_cosine": round(self.min_cosine, 6),
            "tokens": self.rows,
        }
