"""The drafter's GEMM weights for one TTT unroll: cast once, their gradients summed inside the
GEMMs.

    shared = TTTWeights(drafter, dtype=torch.bfloat16)     # once per unroll (TTTObjective)
    # x @ o_proj.weight.T, any number of times
    y = shared.linear("o_proj", x)
    q, k, v = shared.linears(("q_proj", "k_proj", "v_proj"), x)

Every TTT step uses the same weights. Through nn.Linear each step would cast each weight to the
compute dtype again and form a weight gradient of its own for autograd to add up and cast. Here a
weight is cast once per unroll, and each step's weight-gradient GEMM accumulates into one buffer
(beta = 1: gradient-accumulation fusion) that reaches the weight, once, as an ordinary gradient
(the DDP/FSDP hooks see nothing unusual). The math is the nn.Linear modules'; only the kernels
differ.

With fp8 (training.fp8_gemms) the layer's GEMMs run in FP8 e4m3 with one scale per row and column
(_SharedLinearFP8): not the same function, FP8 rounds each operand to 3 mantissa bits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from eyas.training import gemm
from eyas.training.shared_emb import rows_of

if TYPE_CHECKING:
    from eyas.training.drafter import Eagle3Drafter


def compute_dtype(device: torch.device, default: torch.dtype) -> torch.dtype:
    """The autocast dtype where autocast is on for the device, else `default`."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return default


class _GradSink:
    """The gradient of one weight, summed over the TTT steps inside the weight-gradient GEMMs (beta
    = 1), in the GEMM dtype (bf16 on a GPU: the sum autograd would form, one fused GEMM instead of a
    GEMM and an add per step; fp32 sums run ~10% slower on cuBLAS,
    bench/results/2026-12-03_h200_train-step.md). `part`: the column block a GEMM's gradient belongs
    to, for a weight used as two halves (q/k/v's embedding and hidden-state columns:
    eyas/training/shared_emb.py); take() joins them."""

    def __init__(self):
        self.bufs = {}  # part (None: the whole weight) -> (out, in) buffer, made by its first GEMM

    def add(
        self, dy_t, x, part: int | None = None
    ):  # += dy_t @ x: the first GEMM writes the buffer
        buf = self.bufs.get(part)
        if buf is None:
            self.bufs[part] = dy_t @ x
        else:
            buf.addmm_(dy_t, x)

    def add_product(
        self, g
    ):  # += g, a weight gradient formed elsewhere (the FP8 GEMMs: no accumulating kernel)
        buf = self.bufs.get(None)
        if buf is None:
            self.bufs[None] = g
        else:
            buf.add_(g)

    def take(self, dtype):
        """The sum in `dtype` (None if nothing was added), emptying the sink."""
        bufs, self.bufs = self.bufs, {}
        if not bufs:
            return None
        if None in bufs:
            return bufs[None].to(dtype)
        return torch.cat([bufs[0].to(dtype), bufs[1].to(dtype)], dim=1)  # (out, in_0 + in_1)


class _Collect(torch.autograd.Function):
    """A 0-dim token every use of a shared weight depends on; its backward, which autograd runs once
    after all of them, hands the summed gradient to the weight (an ordinary AccumulateGrad)."""

    @staticmethod
    def forward(ctx, sink, w):
        ctx.sink, ctx.dtype = sink, w.dtype
        return w.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return None, ctx.sink.take(ctx.dtype)


class _SharedLinear(torch.autograd.Function):
    """x @ w.T for a weight shared by the TTT steps: dx as usual, dW added to the weight's sink."""

    @staticmethod
    def forward(ctx, x, token, w, sink, out_dtype, part=None):
        # x (..., in); w (out, in) detached, already in the GEMM dtype; the output in out_dtype
        x2 = x.reshape(-1, x.shape[-1])  # (M, in)
        xg = gemm.gemm_operand(x2, w.dtype)  # (M or more, in): CPU bf16 GEMMs get padded rows
        ctx.save_for_backward(xg)
        ctx.w, ctx.sink, ctx.x_dtype, ctx.x_shape, ctx.part = w, sink, x.dtype, x.shape, part
        return (xg @ w.T)[: x2.shape[0]].to(out_dtype).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        (xg,) = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dyg = gemm.gemm_operand(dy2, ctx.w.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dyg @ ctx.w)[: dy2.shape[0]].view(ctx.x_shape).to(ctx.x_dtype)
        ctx.sink.add(dyg.T, xg, ctx.part)  # padded rows are zeros on both sides: they add nothing
        return dx, dy.new_zeros((), dtype=torch.float32), None, None, None, None


class _SharedLinears(torch.autograd.Function):
    """_SharedLinear for weights that read one x (q/k/v, gate/up): x saved once, and its gradient
    summed inside the input-gradient GEMMs (beta = 1) instead of one GEMM per weight and autograd's
    adds of their (M, in) results. Only where x is already in the GEMM dtype (a GPU under autocast,
    or fp32 throughout): the CPU's bf16 GEMMs over fp32 activations keep one node per weight and
    their sums in fp32 (TTTWeights.linears)."""

    @staticmethod
    def forward(ctx, x, ws, sinks, out_dtype, part, *tokens):
        # x (..., in); ws: the weights (out_i, in), detached, in x's dtype -> one output (...,
        # out_i) each
        x2 = x.reshape(-1, x.shape[-1])  # (M, in)
        ctx.save_for_backward(x2)
        ctx.ws, ctx.sinks, ctx.x_shape, ctx.part = ws, sinks, x.shape, part
        return tuple((x2 @ w.T).to(out_dtype).view(*x.shape[:-1], w.shape[0]) for w in ws)

    @staticmethod
    def backward(ctx, *dys):
        (x2,) = ctx.saved_tensors
        dx = None
        for dy, w, sink in zip(dys, ctx.ws, ctx.sinks):
            dy2 = dy.reshape(-1, dy.shape[-1]).to(w.dtype)  # (M, out_i)
            if ctx.needs_input_grad[0]:
                dx = (
                    dy2 @ w if dx is None else dx.addmm_(dy2, w)
                )  # (M, in): the sum in the GEMM's epilogue
            sink.add(dy2.T, x2, ctx.part)
        dx = None if dx is None else dx.view(ctx.x_shape)
        return (dx, None, None, None, None, *(dy.new_zeros((), dtype=torch.float32) for dy in dys))


class _SharedLinearFP8(torch.autograd.Function):
    """_SharedLinear with its three GEMMs in FP8: x quantized per token for the forward and per
    channel (transposed) for the weight gradient, dy likewise in the backward, the weight per output
    and per input channel (once per unroll, _Fp8Weight). Rows are padded to a multiple of 16."""

    @staticmethod
    def forward(ctx, x, token, wq, xq, sink, out_dtype):
        # x (..., in) the activation (for its shape and autograd); xq its quantized rows/columns
        # (_quantized)
        x8, sx, xc8, sxc, M = xq
        ctx.save_for_backward(xc8, sxc)
        ctx.wq, ctx.sink, ctx.x_dtype, ctx.x_shape, ctx.M = wq, sink, x.dtype, x.shape, M
        y = gemm.mm_fp8(x8, sx, wq.row8, wq.row_s, out_dtype)[:M]  # (M, out)
        return y.view(*x.shape[:-1], wq.row8.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xc8, sxc = ctx.saved_tensors
        wq, M = ctx.wq, ctx.M
        dy8, sdy, dyc8, sdyc, _ = _quantized(dy, wq.compile)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = gemm.mm_fp8(dy8, sdy, wq.col8, wq.col_s, ctx.x_dtype)[:M].view(
                ctx.x_shape
            )  # (M, in)
        ctx.sink.add_product(gemm.mm_fp8(dyc8, sdyc, xc8, sxc, dy.dtype))
        return dx, dy.new_zeros((), dtype=torch.float32), None, None, None, None


def _quantized(x, compile: bool):
    """x (..., K) -> (rows fp8 (Mp, K), their scales (Mp, 1), columns fp8 (K, Mp) transposed, their
    scales (K, 1), M): both quantizations of one operand, rows padded with zeros to Mp, a multiple
    of 16."""
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    if gemm.fp8_pad(M) > M:
        x2 = F.pad(x2, (0, 0, 0, gemm.fp8_pad(M) - M))
    return (*gemm.quant_both(x2, compile=compile), M)


@dataclass
class _Fp8Weight:
    """A weight quantized once per unroll: per output channel for the forward, per input channel
    (transposed) for the input gradient."""

    row8: torch.Tensor  # (out, in) fp8
    row_s: torch.Tensor  # (out, 1)
    col8: torch.Tensor  # (in, out) fp8
    col_s: torch.Tensor  # (in, 1)
    compile: bool

    @classmethod
    def of(cls, w: torch.Tensor, compile: bool) -> "_Fp8Weight":
        return cls(*gemm.quant_both(w.detach(), compile=compile), compile)


class TTTWeights:
    """The drafter's GEMM weights for one TTT unroll (see the module docstring).

    dtype: the activations' (the compute dtype); gemm_dtype: run the GEMMs in this dtype instead (a
    CPU with bf16 matrix units: bf16 GEMMs run ~8x faster than fp32 ones on 2 cores, its bf16
    elementwise ops slower: bench/results/2026-12-03_cpu2_cpu-train-step.md). fp8: the layer's GEMMs
    in FP8 where their shapes allow. halves: q/k/v as two column blocks, the embedding's and the
    hidden state's (eyas/training/shared_emb.py), picked by linear's `part`. grouped: linears() as
    one node where it applies (KernelOptions.grouped_gemms)."""

    def __init__(
        self,
        drafter: Eagle3Drafter,
        dtype: torch.dtype,
        gemm_dtype: torch.dtype | None = None,
        fp8: bool = False,
        compile: bool = False,
        halves: bool = False,
        grouped: bool = True,
    ):
        a, m = drafter.midlayer.self_attn, drafter.midlayer.mlp
        mods = {
            "fc": drafter.fc,
            "q_proj": a.q_proj,
            "k_proj": a.k_proj,
            "v_proj": a.v_proj,
            "o_proj": a.o_proj,
            "gate_proj": m.gate_proj,
            "up_proj": m.up_proj,
            "down_proj": m.down_proj,
        }
        grad = torch.is_grad_enabled()
        self.w, self.sink, self.token, self.dtype, self.q8, self.compile = (
            {},
            {},
            {},
            dtype,
            {},
            compile,
        )
        self._last: tuple | None = None  # (x, its FP8 quantization): q/k/v and gate/up read one x
        self.grouped, self.halves = grouped, halves
        H = drafter.cfg.hidden_size
        for name, mod in mods.items():
            w = mod.weight
            self.sink[name] = _GradSink()
            self.token[name] = (
                _Collect.apply(self.sink[name], w) if grad and w.requires_grad else None
            )
            if fp8 and w.shape[0] % gemm.FP8_MULTIPLE == 0 and w.shape[1] % gemm.FP8_MULTIPLE == 0:
                self.q8[name] = _Fp8Weight.of(
                    w, compile
                )  # from the master weights; no bf16 copy needed
            elif halves and name in ("q_proj", "k_proj", "v_proj"):
                # two column blocks, each contiguous (the cast copies anyway)
                w = w.detach().to(gemm_dtype or dtype)
                self.w[name] = (w[:, :H].contiguous(), w[:, H:].contiguous())
            else:
                self.w[name] = w.detach().to(gemm_dtype or dtype)

    def linears(
        self, names: tuple[str, ...], x: torch.Tensor, part: int | None = None
    ) -> list[torch.Tensor]:
        """[linear(name, x, part) for name in names], as one _SharedLinears where it applies (x in
        the GEMM dtype, gradients wanted, no FP8, grouped): the same function, x's gradient summed
        in the GEMMs."""
        one_each = not self.grouped or len(names) < 2
        if one_each or any(n in self.q8 or self.token[n] is None for n in names):
            return [self.linear(n, x, part) for n in names]
        ws = [self.w[n] if part is None else self.w[n][part] for n in names]
        if any(w.dtype != x.dtype for w in ws):
            return [self.linear(n, x, part) for n in names]
        return list(
            _SharedLinears.apply(
                x,
                tuple(ws),
                tuple(self.sink[n] for n in names),
                self.dtype,
                part,
                *(self.token[n] for n in names),
            )
        )

    def qkv(self, x: torch.Tensor, emb: dict, keep=None):
        """q, k and v of concat(emb, x), each as (a GEMM's output, the share still to add or None).

        x (B, L, H) hidden_norm(h); emb {q_proj: at the query rows, k_proj, v_proj} a TTT step's
        reading of its tokens (ttt_step.emb_proj): with halves, the embedding's share already
        projected, left for the caller to add (inside RoPE's kernel); without (FP8 quantizes
        q/k/v's weights whole), input_layernorm(embed), concatenated here. keep: q only at these
        rows of L (rows_of's forms; None: all)."""
        if self.halves:
            part, shares, xkv = 1, (emb["q_proj"], emb["k_proj"], emb["v_proj"]), x
            xq = None if keep is None else rows_of(x, keep)
        else:
            part, shares = None, (None, None, None)
            xkv = torch.cat([emb["k_proj"], x], -1)  # (B, L, 2H)
            xq = None if keep is None else torch.cat([emb["q_proj"], rows_of(x, keep)], -1)
        if xq is None:  # q/k/v read one input: one node
            return list(zip(self.linears(("q_proj", "k_proj", "v_proj"), xkv, part), shares))
        yk, yv = self.linears(("k_proj", "v_proj"), xkv, part)
        return list(zip((self.linear("q_proj", xq, part), yk, yv), shares))

    def linear(self, name: str, x: torch.Tensor, part: int | None = None) -> torch.Tensor:
        """x @ W.T for the weight `name`; part 0 / 1: x @ W[:, :H].T / x @ W[:, H:].T (q/k/v with
        halves)."""
        if name in self.q8:
            if self._last is None or self._last[0] is not x:
                self._last = (x, _quantized(x.detach(), self.compile))
            token = self.token[name]
            if token is None:  # no gradient: the forward GEMM alone
                x8, sx, _, _, M = self._last[1]
                w8 = self.q8[name]
                return gemm.mm_fp8(x8, sx, w8.row8, w8.row_s, self.dtype)[:M].view(
                    *x.shape[:-1], w8.row8.shape[0]
                )
            return _SharedLinearFP8.apply(
                x, token, self.q8[name], self._last[1], self.sink[name], self.dtype
            )
        w = self.w[name] if part is None else self.w[name][part]
        if self.token[name] is None:
            return (x.to(w.dtype) @ w.T).to(self.dtype)
        return _SharedLinear.apply(x, self.token[name], w, self.sink[name], self.dtype, part)
