"""The EAGLE-3 draft model, laid out exactly like SGLang's `LlamaForCausalLMEagle3`.

    cfg = DrafterConfig(hidden_size=256, target_hidden_size=256, num_attention_heads=4, ...)
    drafter = Eagle3Drafter(cfg)
    logits, h = drafter(input_ids, aux, positions, causal_mask(T))                  # prefill
    # one draft step
    logits, h = drafter(next_ids, h, positions + 1, causal_mask(1, len(cache)), cache)

One step: fc(concat of the target's 3 aux hidden states) -> one Llama decoder layer whose q/k/v read
concat(input_layernorm(embed(token)), hidden_norm(h)) -> final norm -> lm_head over the draft vocab.
The residual stream of the layer starts from h (not from the embedding), as in SGLang; the pre-norm
output h is what the next draft step reads instead of fc(aux).

State-dict names are SGLang's checkpoint names (`fc.weight`, `midlayer.self_attn.q_proj.weight`,
`norm.weight`, `lm_head.weight`, `d2t`, `t2d`), so export is a rename-free dtype cast. Drafting
(evaluation, the local engine) and export run this module as it is.

Training-time test (TTT) is this model unrolled: step k at position t attends to step 0's keys at
positions <= t and to its own position t in steps 1..k (the "cache_hidden" scheme of EAGLE-3 /
SpecForge), i.e. a KVCache of the earlier steps' keys under `ttt_mask`. Training runs the same
function through fused kernels that never form those scores (eyas/training/ttt_step.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from eyas.draft_format import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):  # (..., dim) -> same dtype as x; statistics in fp32 (F.rms_norm upcasts)
        with torch.autocast(x.device.type, enabled=False):
            return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), self.eps)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """Llama (NeoX-style, rotate-half) RoPE tables for integer positions (..., T) -> (..., T,
    hd)."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim
    )
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
        k > q, float("-inf")
    )[None, None]


def ttt_mask(T: int, step: int, device=None, dtype=torch.float32) -> torch.Tensor:
    """Additive mask (1, 1, T, (step+1)*T) of TTT step `step` over a KVCache holding the earlier
    steps' keys: causal over step 0's, and position t over its own position in each later step."""
    blocks = [causal_mask(T, device=device, dtype=dtype)[0, 0]]
    diag = torch.full((T, T), float("-inf"), device=device, dtype=dtype).fill_diagonal_(0.0)
    return torch.cat(blocks + [diag] * step, dim=1)[None, None]


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


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(2 * cfg.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(2 * cfg.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def heads(
        self, t
    ):  # (B, nkv, S, hd) -> (B, nh, S, hd): grouped-query keys shared by nh / nkv heads
        return t if self.nh == self.nkv else t.repeat_interleave(self.nh // self.nkv, dim=1)

    def forward(self, x, cos, sin, mask, cache: KVCache | None = None):
        B, T, _ = x.shape  # x (B, T, 2H)
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, nkv, S, hd), S = past + T
        k, v = self.heads(k), self.heads(v)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd) + mask  # (B, nh, T, S)
        att = F.softmax(att.float(), dim=-1).to(q.dtype)
        y = att @ v  # (B, nh, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):  # (B, T, H) -> (B, T, H): SwiGLU
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, h, cos, sin, mask, cache: KVCache | None = None):
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(h)], dim=-1)  # (B, T, 2H)
        h = h + self.self_attn(x, cos, sin, mask, cache)  # the residual stream starts at h
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, T, H)


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

    def forward(self, input_ids, hidden, positions, mask, cache: KVCache | None = None):
        """One draft step -> (logits over the draft vocab (B, T, V_d), pre-norm output h (B, T, H)).

        input_ids (B, T) target ids; hidden (B, T, num_aux*H_t) the target's aux states, or (B, T,
        H) the previous step's h; positions (T,) or (B, T); mask additive (1|B, 1, T, S), S =
        len(cache) + T.
        """
        emb = self.embed_tokens(input_ids)  # (B, T, H)
        if (
            hidden.shape[-1] != self.cfg.hidden_size
        ):  # SGLang's rule: fc only on the target's states
            hidden = self.fc(hidden)  # (B, T, H)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        dt = hidden.dtype
        h = self.midlayer(emb.to(dt), hidden, cos.to(dt), sin.to(dt), mask.to(dt), cache)
        return self.logits(h), h
