"""The EAGLE-3 draft model, laid out exactly like SGLang's `LlamaForCausalLMEagle3`.

    cfg = DrafterConfig(hidden_size=256, target_hidden_size=256, num_attention_heads=4, ...)
    drafter = Eagle3Drafter(cfg)
    logits, h = drafter(input_ids, aux, positions, causal_mask(T))              # one step
    h, hn = drafter.step(next_ids, h, positions + 1, None, ttt=kv, kernels=k)   # a TTT step (training)
    h, hn = drafter.ttt_step(h, emb.step(q_rows, rows), positions + 1, kv, shared, k)   # ... its embedding's share given

One step: fc(concat of the target's 3 aux hidden states) -> one Llama decoder layer whose q/k/v read
concat(input_layernorm(embed(token)), hidden_norm(h)) -> final norm -> lm_head over the draft vocab.
The residual stream of the layer starts from h (not from the embedding), as in SGLang; the pre-norm
output h is what the next draft step reads instead of fc(aux).

The elementwise pieces (norms, RoPE, residual adds, SwiGLU) go through eyas/training/kernels.py,
which torch.compile fuses where the step's KernelOptions say so (on a GPU by default); `step` takes
those options from its caller (TTTObjective), and the plain forward (drafting, export) runs eager. State-dict names are SGLang's checkpoint names (`fc.weight`,
`midlayer.self_attn.q_proj.weight`, `norm.weight`, `lm_head.weight`, `d2t`, `t2d`), so export is a
rename-free dtype cast.

Attention has two modes:
- training-time test (TTT): `ttt` is a list the caller keeps across the unrolled steps. At step k
  the query at position t attends to step 0's keys at positions <= t and to its own position t in
  steps 1..k (the "cache_hidden" scheme of EAGLE-3 / SpecForge). With `mask=None` this runs as one
  causal flash attention plus diagonal terms (eyas/training/attention.py), never forming the T x T scores;
  with an explicit `mask` it runs the plain masked-softmax reference.
- drafting: `cache` is a KVCache; the new keys are appended and `mask` spans cache + new keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from eyas.training import kernels as fused
from eyas.training.attention import ttt_attention
from eyas.training.kernels import DEFAULT, KernelOptions


@dataclass
class DrafterConfig:
    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int
    num_aux: int = 3  # target layers fused by fc
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def __post_init__(self):
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"DrafterConfig: num_attention_heads={self.num_attention_heads} is not a "
                             f"multiple of num_key_value_heads={self.num_key_value_heads}")
        if self.draft_vocab_size > self.vocab_size:
            raise ValueError(f"DrafterConfig: draft_vocab_size={self.draft_vocab_size} exceeds the "
                             f"target vocab_size={self.vocab_size}")
        if self.head_dim % 2:
            raise ValueError(f"DrafterConfig: head_dim={self.head_dim} must be even for RoPE")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., dim) -> same dtype as x; statistics in fp32 (F.rms_norm upcasts)
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """Llama (NeoX-style, rotate-half) RoPE tables for integer positions (..., T) -> (..., T, hd)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    freqs = positions.float()[..., None] * inv_freq  # (..., T, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (..., T, hd)
    return emb.cos(), emb.sin()


def apply_rope(x, cos, sin):
    # x (B, nh, T, hd); cos/sin (T, hd) or (B, T, hd)
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def causal_mask(num_new: int, num_past: int = 0, device=None, dtype=torch.float32) -> torch.Tensor:
    """Additive mask (1, 1, T, past+T): new token t sees every past key and new keys <= t."""
    q = torch.arange(num_new, device=device)[:, None] + num_past
    k = torch.arange(num_past + num_new, device=device)[None, :]
    return torch.zeros(q.shape[0], k.shape[1], device=device, dtype=dtype).masked_fill(
        k > q, float("-inf"))[None, None]


class TTTKeys(list):
    """What a TTT unroll's attention reads across its steps: step 0's (k, v) for every position of the
    (B, T) batch, then one diagonal (k, v) per later step. `where`: the (b, t) positions of the later
    steps' rows when they run gathered, as a (1, N) batch (TTTObjective's per-position skipping);
    None: they run on the batch's own (B, L) layout. A plain list works where nothing is gathered."""

    where: tuple[torch.Tensor, torch.Tensor] | None = None


class KVCache:
    """Keys/values of committed draft positions for incremental drafting; crop() rolls back."""

    def __init__(self):
        self.k = self.v = None  # (B, n_kv, L, hd)

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


class _GradSink:
    """The gradient of one weight, summed over the TTT steps inside the weight-gradient GEMMs (beta = 1).

    In the GEMM dtype (the default: bf16 on a GPU, the sum autograd forms, one fused GEMM instead of a
    GEMM and an add per step) or, with fp32 (KernelOptions.grad_acc_fp32), in fp32: more exact, but
    cuBLAS's fp32-output kernels run ~10% slower, which costs more than the adds it saves
    (bench/results/2026-12-03_h200_train-step.md). `part`: the column block a GEMM's gradient belongs to, for a weight used as
    two halves (q/k/v's embedding and hidden-state columns, KernelOptions.shared_emb); take() joins them."""

    def __init__(self, fp32: bool = False):
        self.bufs, self.fp32 = {}, fp32  # part (None: the whole weight) -> (out, in) buffer, made by its first GEMM

    def add(self, dy_t, x, part: int | None = None):  # += dy_t @ x: the first GEMM writes the buffer, the next ones accumulate
        buf = self.bufs.get(part)
        if buf is None:
            self.bufs[part] = fused.mm_f32(dy_t, x) if self.fp32 and dy_t.dtype.itemsize < 4 else dy_t @ x
        elif buf.dtype == dy_t.dtype:
            buf.addmm_(dy_t, x)
        else:
            fused.addmm_f32_(buf, dy_t, x)

    def add_product(self, g):  # += g, a weight gradient formed elsewhere (the FP8 GEMMs: no accumulating kernel)
        buf = self.bufs.get(None)
        if buf is None:
            self.bufs[None] = g if not self.fp32 else g.float()
        else:
            buf.add_(g)

    def take(self, dtype):
        """The sum in `dtype` (None if nothing was added), emptying the sink."""
        bufs, self.bufs = self.bufs, {}
        if not bufs:
            return None
        if None in bufs:
            return bufs[None].to(dtype)
        return torch.cat([bufs[0].to(dtype), bufs[1].to(dtype)], dim=1)  # (out, in_0 + in_1): both halves run every unroll


class _Collect(torch.autograd.Function):
    """A 0-dim token every use of a shared weight depends on; its backward, which autograd runs once
    after all of them, hands the summed gradient to the weight (an ordinary AccumulateGrad, so the
    DDP/FSDP hooks see an ordinary gradient)."""

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
        # x (..., in); w (out, in) detached, already in the GEMM dtype; the output in out_dtype;
        # part: which column block of the shared weight w is (_GradSink), None for all of it
        x2 = x.reshape(-1, x.shape[-1])  # (M, in)
        xg = fused.gemm_operand(x2, w.dtype)  # (M or more, in): CPU bf16 GEMMs get padded rows
        ctx.save_for_backward(xg)
        ctx.w, ctx.sink, ctx.x_dtype, ctx.x_shape, ctx.part = w, sink, x.dtype, x.shape, part
        return (xg @ w.T)[:x2.shape[0]].to(out_dtype).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xg, = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dyg = fused.gemm_operand(dy2, ctx.w.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dyg @ ctx.w)[:dy2.shape[0]].view(ctx.x_shape).to(ctx.x_dtype)
        ctx.sink.add(dyg.T, xg, ctx.part)  # padded rows are zeros on both sides: they add nothing
        return dx, dy.new_zeros((), dtype=torch.float32), None, None, None, None


class _SharedLinears(torch.autograd.Function):
    """_SharedLinear for weights that read one x (q/k/v, gate/up; KernelOptions.grouped_gemms): x saved
    once, and its gradient summed inside the input-gradient GEMMs (beta = 1) instead of one GEMM per
    weight and autograd's adds of their (M, in) results. Only where x is already in the GEMM dtype (a
    GPU under autocast, or fp32 throughout): the CPU's bf16 GEMMs over fp32 activations keep one node
    per weight and their sums in fp32 (TTTWeights.linears)."""

    @staticmethod
    def forward(ctx, x, ws, sinks, out_dtype, part, *tokens):
        # x (..., in); ws: the weights (out_i, in), detached, in x's dtype -> one output (..., out_i) each
        x2 = x.reshape(-1, x.shape[-1])  # (M, in)
        ctx.save_for_backward(x2)
        ctx.ws, ctx.sinks, ctx.x_shape, ctx.part = ws, sinks, x.shape, part
        return tuple((x2 @ w.T).to(out_dtype).view(*x.shape[:-1], w.shape[0]) for w in ws)

    @staticmethod
    def backward(ctx, *dys):
        x2, = ctx.saved_tensors
        dx = None
        for dy, w, sink in zip(dys, ctx.ws, ctx.sinks):
            dy2 = dy.reshape(-1, dy.shape[-1]).to(w.dtype)  # (M, out_i)
            if ctx.needs_input_grad[0]:
                dx = dy2 @ w if dx is None else dx.addmm_(dy2, w)  # (M, in): the sum in the GEMM's epilogue
            sink.add(dy2.T, x2, ctx.part)
        dx = None if dx is None else dx.view(ctx.x_shape)
        return (dx, None, None, None, None, *(dy.new_zeros((), dtype=torch.float32) for dy in dys))


class _SharedLinearFP8(torch.autograd.Function):
    """_SharedLinear with its three GEMMs in FP8 (KernelOptions.fp8_gemms): x quantized per token for the
    forward and per channel (transposed) for the weight gradient, dy likewise in the backward, the weight
    per output and per input channel (once per unroll, _Fp8Weight). Rows are padded to a multiple of 16."""

    @staticmethod
    def forward(ctx, x, token, wq, xq, sink, out_dtype):
        # x (..., in) the activation (for its shape and autograd); xq its quantized rows/columns (_quantized)
        x8, sx, xc8, sxc, M = xq
        ctx.save_for_backward(xc8, sxc)
        ctx.wq, ctx.sink, ctx.x_dtype, ctx.x_shape, ctx.M = wq, sink, x.dtype, x.shape, M
        y = fused.mm_fp8(x8, sx, wq.row8, wq.row_s, out_dtype)[:M]  # (M, out)
        return y.view(*x.shape[:-1], wq.row8.shape[0])

    @staticmethod
    def backward(ctx, dy):
        xc8, sxc = ctx.saved_tensors
        wq, M = ctx.wq, ctx.M
        dy8, sdy, dyc8, sdyc, _ = _quantized(dy, wq.compile)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = fused.mm_fp8(dy8, sdy, wq.col8, wq.col_s, ctx.x_dtype)[:M].view(ctx.x_shape)  # (M, in)
        ctx.sink.add_product(fused.mm_fp8(dyc8, sdyc, xc8, sxc, torch.float32 if ctx.sink.fp32 else dy.dtype))
        return dx, dy.new_zeros((), dtype=torch.float32), None, None, None, None


def _quantized(x, compile: bool):
    """x (..., K) -> (rows fp8 (Mp, K), their scales (Mp, 1), columns fp8 (K, Mp) transposed, their scales
    (K, 1), M): both quantizations of one operand, rows padded with zeros to Mp, a multiple of 16."""
    x2 = x.reshape(-1, x.shape[-1])
    M = x2.shape[0]
    if fused.fp8_pad(M) > M:
        x2 = F.pad(x2, (0, 0, 0, fused.fp8_pad(M) - M))
    return (*fused.quant_both(x2, compile=compile), M)


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
        return cls(*fused.quant_both(w.detach(), compile=compile), compile)


class TTTWeights:
    """The drafter's GEMM weights for one TTT unroll: cast to the compute dtype once, and each one's
    gradient summed over the steps inside its weight-gradient GEMMs instead of one gradient per step
    summed by autograd and then cast (gradient-accumulation fusion). The math is the nn.Linear
    modules'; only the kernels differ.

    gemm_dtype: run the GEMMs in this dtype while the activations stay in `dtype` (a CPU with bf16
    matrix units: bf16 GEMMs run ~8x faster than fp32 ones on 2 cores, its bf16 elementwise ops
    slower: bench/results/2026-12-03_cpu2_cpu-train-step.md).
    grad_acc_fp32: the sums in fp32 (_GradSink)."""

    def __init__(self, drafter: "Eagle3Drafter", dtype: torch.dtype, gemm_dtype: torch.dtype | None = None,
                 grad_acc_fp32: bool = False, fp8: bool = False, compile: bool = False, halves: bool = False):
        a, m = drafter.midlayer.self_attn, drafter.midlayer.mlp
        mods = {"fc": drafter.fc, "q_proj": a.q_proj, "k_proj": a.k_proj, "v_proj": a.v_proj, "o_proj": a.o_proj,
                "gate_proj": m.gate_proj, "up_proj": m.up_proj, "down_proj": m.down_proj}
        grad = torch.is_grad_enabled()
        self.w, self.sink, self.token, self.dtype, self.q8, self.compile = {}, {}, {}, dtype, {}, compile
        self._last: tuple | None = None  # (x, its FP8 quantization): q/k/v and gate/up read one x
        H = drafter.cfg.hidden_size
        for name, mod in mods.items():
            w = mod.weight
            self.sink[name] = _GradSink(grad_acc_fp32)
            self.token[name] = _Collect.apply(self.sink[name], w) if grad and w.requires_grad else None
            if fp8 and w.shape[0] % fused.FP8_MULTIPLE == 0 and w.shape[1] % fused.FP8_MULTIPLE == 0:
                self.q8[name] = _Fp8Weight.of(w, compile)  # from the master weights; no bf16 copy needed
            elif halves and name in ("q_proj", "k_proj", "v_proj"):
                # q/k/v read concat(embedding, hidden state): its two column blocks as two GEMM operands,
                # each contiguous (the cast copies anyway); linear(name, x, part) picks one
                w = w.detach().to(gemm_dtype or dtype)
                self.w[name] = (w[:, :H].contiguous(), w[:, H:].contiguous())
            else:
                self.w[name] = w.detach().to(gemm_dtype or dtype)

    def linears(self, names: tuple[str, ...], x: torch.Tensor, part: int | None = None,
                grouped: bool = True) -> list[torch.Tensor]:
        """[linear(name, x, part) for name in names], as one _SharedLinears where it applies (grouped,
        x in the GEMM dtype, gradients wanted, no FP8): the same function, x's gradient summed in the GEMMs."""
        if not grouped or len(names) < 2 or any(n in self.q8 or self.token[n] is None for n in names):
            return [self.linear(n, x, part) for n in names]
        ws = [self.w[n] if part is None else self.w[n][part] for n in names]
        if any(w.dtype != x.dtype for w in ws):
            return [self.linear(n, x, part) for n in names]
        return list(_SharedLinears.apply(x, tuple(ws), tuple(self.sink[n] for n in names), self.dtype, part,
                                         *(self.token[n] for n in names)))

    def linear(self, name: str, x: torch.Tensor, part: int | None = None) -> torch.Tensor:
        """x @ W.T for the weight `name`; part 0 / 1: x @ W[:, :H].T / x @ W[:, H:].T (q/k/v with halves)."""
        if name in self.q8:
            if self._last is None or self._last[0] is not x:
                self._last = (x, _quantized(x.detach(), self.compile))
            token = self.token[name]
            if token is None:  # no gradient: the forward GEMM alone
                x8, sx, _, _, M = self._last[1]
                w8 = self.q8[name]
                return fused.mm_fp8(x8, sx, w8.row8, w8.row_s, self.dtype)[:M].view(*x.shape[:-1], w8.row8.shape[0])
            return _SharedLinearFP8.apply(x, token, self.q8[name], self._last[1], self.sink[name], self.dtype)
        w = self.w[name] if part is None else self.w[name][part]
        if self.token[name] is None:
            return (x.to(w.dtype) @ w.T).to(self.dtype)
        return _SharedLinear.apply(x, self.token[name], w, self.sink[name], self.dtype, part)


class _EmbSums:
    """An unroll's embedding projections, detached (`data`), and their gradients, one (B, S, out) buffer
    each, made by the first step's backward that reaches it. Holds no graph tensor: the autograd nodes
    hold it."""

    def __init__(self, pe: dict):
        self.data = {n: p.detach() for n, p in pe.items()}
        self.bufs: dict = {}

    def add(self, name: str, rows, dy):  # the buffer's rows `rows` (rows_of's forms) += dy
        buf = self.bufs.get(name)
        if buf is None:
            buf = self.bufs[name] = torch.zeros_like(self.data[name])
        if isinstance(rows, slice):
            # one sequence at a time: buf[b, rows] is contiguous where buf[:, rows] is strided, which
            # runs CUDA's generic elementwise kernel (12 ms of a batch-4 step; one sequence at a time
            # the in-place sums beat autograd's by 0.6%: bench/results/2026-12-05_h200_copies-adds.md)
            for b in range(buf.shape[0]):
                buf[b, rows].add_(dy[b])
        else:  # gathered (b, t), distinct: one indexed add into the flat (B * S, out) rows
            b, t = rows
            buf.view(-1, buf.shape[-1]).index_add_(0, b * buf.shape[1] + t, dy.reshape(-1, buf.shape[-1]))

    def take(self, name: str):
        return self.bufs.pop(name, None)


class _CollectEmb(torch.autograd.Function):
    """A 0-dim token every step's share of one embedding projection depends on; its backward, which
    autograd runs after all of theirs, hands the summed buffer to the projection (as _Collect does for
    weights)."""

    @staticmethod
    def forward(ctx, sums, name, p):
        ctx.sums, ctx.name = sums, name
        return p.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return None, None, ctx.sums.take(ctx.name)


class _EmbRows(torch.autograd.Function):
    """One step's rows of an embedding projection: the forward a view (or gather) of it, the backward
    an in-place add into the unroll's sum (_EmbSums) instead of a zero-padded copy for autograd to sum."""

    @staticmethod
    def forward(ctx, token, sums, name, rows):
        ctx.sums, ctx.name, ctx.rows = sums, name, rows
        return rows_of(sums.data[name], rows)

    @staticmethod
    def backward(ctx, dy):
        ctx.sums.add(ctx.name, ctx.rows, dy)
        return dy.new_zeros(()), None, None, None


def rows_of(x, rows):
    """x (B, S, ...) at `rows`: a slice of S (a view), or gathered (b, t) -> (1, N, ...)."""
    if isinstance(rows, slice):
        return x[:, rows]
    return x[rows][None]


class SharedEmb:
    """input_layernorm(embed(tokens)) @ W_e.T for q, k and v over an unroll's S = T + K - 1 tokens
    (Eagle3Drafter.emb_proj, KernelOptions.shared_emb), handed to each TTT step at its rows (at()).

    in_place (KernelOptions.emb_grad_inplace): each step's gradient is added into one (B, S, out) buffer
    per projection (_EmbRows); without it autograd slices, which costs every step a zero-filled (B, S,
    out) tensor, a strided copy into it and an add. `start`: the first token a projection holds (q's
    may start where the first query does); rows are given in token positions."""

    def __init__(self, pe: dict, start: dict | None = None, in_place: bool = True):
        self.pe, self.start = pe, start or {}
        grad = in_place and any(p.requires_grad for p in pe.values())
        self.sums = _EmbSums(pe) if grad else None
        self.token = {n: _CollectEmb.apply(self.sums, n, p) for n, p in pe.items()} if grad else None

    def at(self, name: str, rows):
        """The projection `name` at token positions `rows` (a slice, or gathered (b, t))."""
        off = self.start.get(name, 0)
        if off:
            rows = slice(rows.start - off, rows.stop - off) if isinstance(rows, slice) else (rows[0], rows[1] - off)
        if self.token is None:
            return rows_of(self.pe[name], rows)
        return _EmbRows.apply(self.token[name], self.sums, name, rows)

    def step(self, q_rows, kv_rows) -> dict:
        """{q_proj: at q_rows, k_proj and v_proj: at kv_rows}: one TTT step's inputs."""
        return {"q_proj": self.at("q_proj", q_rows), "k_proj": self.at("k_proj", kv_rows),
                "v_proj": self.at("v_proj", kv_rows)}


def compute_dtype(device: torch.device, default: torch.dtype) -> torch.dtype:
    """The autocast dtype where autocast is on for the device, else `default`."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return default


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def _heads(self, t):  # (B, nkv, S, hd) -> (B, nh, S, hd)
        return t if self.nh == self.nkv else t.repeat_interleave(self.nh // self.nkv, dim=1)

    def forward(self, x, cos, sin, mask, ttt=None, cache=None, shared: TTTWeights | None = None,
                kernels: KernelOptions = DEFAULT):
        B, T, _ = x.shape  # x (B, T, 2H)
        lin = (lambda name, t: getattr(self, name)(t)) if shared is None else shared.linear
        q = lin("q_proj", x).view(B, T, self.nh, self.hd)
        k = lin("k_proj", x).view(B, T, self.nkv, self.hd)
        v = lin("v_proj", x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        q, k = (t.transpose(1, 2) for t in fused.rope_qk(q, k, cos, sin, compile=kernels.compile))  # (B, nh|nkv, T, hd)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, nkv, L+T, hd)
        scale = 1.0 / math.sqrt(self.hd)
        if ttt is not None:
            ttt.append((k, v))
            (k, v), diag = ttt[0], ttt[1:]  # step 0's keys; one same-position key per later step
            if mask is None:  # causal over step 0 + diagonal over steps 1..k, O(T) memory
                y = ttt_attention(q, self._heads(k), self._heads(v), [self._heads(kd) for kd, _ in diag],
                                  [self._heads(vd) for _, vd in diag], scale, kernels,
                                  getattr(ttt, "where", None) if diag else None)  # (B, nh, T, hd)
                return lin("o_proj", y.transpose(1, 2).reshape(B, T, self.nh * self.hd))
        else:
            diag = []
        k, v = self._heads(k), self._heads(v)
        S = k.shape[2]
        att = (q @ k.transpose(-2, -1)) * scale + mask  # (B, nh, T, S)
        extra = [(q * self._heads(kd)).sum(-1, keepdim=True) * scale for kd, _ in diag]  # (B, nh, T, 1)
        att = F.softmax(torch.cat([att, *extra], dim=-1).float(), dim=-1).to(q.dtype)
        y = att[..., :S] @ v  # (B, nh, T, hd)
        for j, (_, vd) in enumerate(diag):
            y = y + att[..., S + j, None] * self._heads(vd)
        return lin("o_proj", y.transpose(1, 2).reshape(B, T, self.nh * self.hd))


    def forward_ttt(self, x, pe: dict, cos, sin, ttt: list, shared: TTTWeights, kernels: KernelOptions, keep=None):
        """A TTT step's attention with the embedding's share of q/k/v given (KernelOptions.shared_emb).

        x (B, L, H) hidden_norm(h); pe {k_proj, v_proj: (B, L, out), q_proj: the same at the query rows}
        input_layernorm(embed) @ W_e.T at the same positions (SharedEmb.step); cos/sin (L, hd) or
        (L', hd) matching the rows. keep (step 0 of a skipping unroll): the queries only at these rows,
        a slice of L (the last rows: bottom-right causal) or gathered (b, t) -> (1, N); keys and values
        at every row, since they are every later step's causal keys. -> o_proj's output at the query rows."""
        B, L, _ = x.shape
        c, g = kernels.compile, kernels.grouped_gemms
        if keep is None:
            yq, yk, yv = shared.linears(("q_proj", "k_proj", "v_proj"), x, 1, g)
        else:
            yk, yv = shared.linears(("k_proj", "v_proj"), x, 1, g)
            yq = shared.linear("q_proj", _rows(x, keep), 1)
        k = fused.add_rope(yk.view(B, L, self.nkv, self.hd), pe["k_proj"].view(B, L, self.nkv, self.hd), cos, sin,
                           compile=c).transpose(1, 2)
        v = (yv + pe["v_proj"]).view(B, L, self.nkv, self.hd).transpose(1, 2)
        Bq, Lq = yq.shape[:2]
        q = fused.add_rope(yq.view(Bq, Lq, self.nh, self.hd), pe["q_proj"].view(Bq, Lq, self.nh, self.hd),
                           _pos_rows(cos, keep), _pos_rows(sin, keep), compile=c).transpose(1, 2)  # (Bq, nh, Lq, hd)
        ttt.append((k, v))
        (k0, v0), diag = ttt[0], ttt[1:]
        where = getattr(ttt, "where", None) if diag else (keep if isinstance(keep, tuple) else None)
        y = ttt_attention(q, self._heads(k0), self._heads(v0), [self._heads(kd) for kd, _ in diag],
                          [self._heads(vd) for _, vd in diag], 1.0 / math.sqrt(self.hd), kernels, where)
        return shared.linear("o_proj", y.transpose(1, 2).reshape(Bq, Lq, self.nh * self.hd))


def _rows(x, keep):
    """x (B, L, ...) at the rows `keep` names: None all, a slice of L, or gathered (b, t) -> (1, N, ...)."""
    return x if keep is None else rows_of(x, keep)


def _pos_rows(x, keep):
    """A per-position table (L, ...) (RoPE's cos/sin) at the rows `keep` names (see _rows)."""
    if keep is None:
        return x
    return x[keep] if isinstance(keep, slice) else x[keep[1]]


class _SwiGLU(torch.autograd.Function):
    """silu(g) * u keeping only g and u for the backward (silu(g) is recomputed): a third less MLP memory."""

    @staticmethod
    def forward(ctx, g, u):  # (B, T, I) each
        ctx.save_for_backward(g, u)
        return F.silu(g) * u

    @staticmethod
    def backward(ctx, dy):  # the same kernels autograd would run for F.silu(g) * u
        g, u = ctx.saved_tensors
        return torch.ops.aten.silu_backward(dy * u, g), dy * F.silu(g)


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x, shared: TTTWeights | None = None, kernels: KernelOptions = DEFAULT):
        if shared is None:
            g, u, down = self.gate_proj(x), self.up_proj(x), self.down_proj  # (B, T, I)
        else:
            g, u = shared.linears(("gate_proj", "up_proj"), x, grouped=kernels.grouped_gemms)
            down = lambda t: shared.linear("down_proj", t)  # noqa: E731
        return down(fused.swiglu(g, u, compile=True) if kernels.compile else _SwiGLU.apply(g, u))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, h, cos, sin, mask, ttt=None, cache=None, final_norm: RMSNorm | None = None,
                shared: TTTWeights | None = None, kernels: KernelOptions = DEFAULT):
        """-> (h_out (B, T, H), final_norm(h_out) or None): the final norm fused with the last add."""
        eps, c = self.input_layernorm.eps, kernels.compile
        x = fused.norm_cat(emb, h, self.input_layernorm.weight, self.hidden_norm.weight, eps, compile=c)  # (B, T, 2H)
        h, x = fused.add_norm(h, self.self_attn(x, cos, sin, mask, ttt, cache, shared, kernels),  # residual starts at h
                              self.post_attention_layernorm.weight, eps, compile=c)
        out = self.mlp(x, shared, kernels)
        if final_norm is None:
            return h + out, None
        return fused.add_norm(h, out, final_norm.weight, final_norm.eps, compile=c)


    def forward_ttt(self, h, pe: dict, cos, sin, ttt: list, final_norm: RMSNorm, shared: TTTWeights,
                    kernels: KernelOptions, keep=None):
        """forward() for a TTT step whose embedding's share of q/k/v is given (Attention.forward_ttt):
        h (B, L, H) the residual stream in -> (h_out, final_norm(h_out)) at the query rows `keep`."""
        eps, c = self.hidden_norm.eps, kernels.compile
        x = fused.norm(h, self.hidden_norm.weight, eps, compile=c)  # (B, L, H)
        a = self.self_attn.forward_ttt(x, pe, cos, sin, ttt, shared, kernels, keep)
        h, x = fused.add_norm(_rows(h, keep), a, self.post_attention_layernorm.weight, eps, compile=c)
        return fused.add_norm(h, self.mlp(x, shared, kernels), final_norm.weight, final_norm.eps, compile=c)


class Eagle3Drafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # frozen: SGLang swaps in the target's
        self.fc = nn.Linear(cfg.num_aux * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        # draft id i is target id i + d2t[i]; t2d marks the target ids in the draft vocab
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen embedding (which always comes from the target)."""
        return {k: v for k, v in self.state_dict().items() if k != "embed_tokens.weight"}

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def logits(self, h):  # (..., H) -> (..., V_d)
        return self.lm_head(self.norm(h))

    def forward(self, input_ids, hidden, positions, mask, ttt=None, cache=None, with_logits=True):
        """One draft step.

        input_ids (B, T) target ids; hidden (B, T, num_aux*H_t) target aux states, or (B, T, H) the
        previous step's output; positions (T,) or (B, T); mask additive (1|B, 1, T, S), or None for
        causal TTT attention on the fast path (only with `ttt`).
        Returns logits over the draft vocab (B, T, V_d) (None unless with_logits) and the pre-norm
        output (B, T, H), which the next step reads.
        """
        h, hn = self.step(input_ids, hidden, positions, mask, ttt, cache)
        return (self.lm_head(hn) if with_logits else None), h

    def step(self, input_ids, hidden, positions, mask, ttt=None, cache=None, shared: TTTWeights | None = None,
             kernels: KernelOptions = DEFAULT):
        """forward() without the head -> (pre-norm output h (B, T, H), norm(h)).

        shared: the TTT unroll's TTTWeights (training), used instead of the Linear modules.
        kernels: how the elementwise regions and the TTT attention run (training's KernelOptions)."""
        emb = self.embed_tokens(input_ids)  # (B, T, H)
        if hidden.shape[-1] != self.cfg.hidden_size:  # SGLang's rule: fc only on the target's states
            hidden = self.fc(hidden) if shared is None else shared.linear("fc", hidden)  # (B, T, H)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        if mask is None and ttt is None:
            raise ValueError("Eagle3Drafter: mask=None (causal fast path) needs ttt")
        return self.midlayer(emb.to(hidden.dtype), hidden, cos.to(hidden.dtype), sin.to(hidden.dtype),
                             None if mask is None else mask.to(hidden.dtype), ttt, cache, final_norm=self.norm,
                             shared=shared, kernels=kernels)

    def emb_proj(self, tokens: torch.Tensor, shared: TTTWeights, kernels: KernelOptions = DEFAULT,
                 q_from: int = 0) -> SharedEmb:
        """input_layernorm(embed(tokens)) @ W_e.T for q, k and v, W_e their embedding columns: the part
        of every TTT step's q/k/v that depends on its token alone (KernelOptions.shared_emb). tokens
        (B, S) -> SharedEmb of {q_proj, k_proj, v_proj: (B, S, out)} (q_proj from token q_from on: no
        step queries the tokens before); their gradients, summed over the steps that read them, reach W_e
        and the norm's weight through one GEMM each."""
        e = self.embed_tokens(tokens).to(shared.dtype)  # (B, S, H), frozen
        en = fused.norm(e, self.midlayer.input_layernorm.weight, self.midlayer.input_layernorm.eps,
                        compile=kernels.compile)
        names = ("k_proj", "v_proj") if q_from else ("q_proj", "k_proj", "v_proj")  # q apart where it starts later
        pe = dict(zip(names, shared.linears(names, en, 0, kernels.grouped_gemms)))
        if q_from:
            pe["q_proj"] = shared.linear("q_proj", en[:, q_from:], 0)
        return SharedEmb(pe, {"q_proj": q_from}, kernels.emb_grad_inplace)

    def ttt_step(self, hidden, pe: dict, positions, ttt: list, shared: TTTWeights, kernels: KernelOptions,
                 keep=None):
        """step() with the embedding's share of q/k/v given: pe at hidden's positions, q's at the query
        rows (SharedEmb.step); keep: step 0's query rows (DecoderLayer.forward_ttt) -> (h, norm(h)) there."""
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = shared.linear("fc", hidden)  # (B, L, H)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        return self.midlayer.forward_ttt(hidden, pe, cos.to(hidden.dtype), sin.to(hidden.dtype), ttt, self.norm,
                                         shared, kernels, keep)
