"""Multi-head latent attention over cached latents, in SGLang's absorbed form.

    absorb_mla(model)   # every DeepSeek-V2/V3 attention layer of a transformers model, in place

transformers' DeepseekV3Attention caches the compressed latents (kv_lora_rank + rope dims a token)
and expands the whole cache through kv_b_proj into per-head keys and values at every forward. For
a prefill that is the work anyway; for a decode step it re-expands every cached token of every
row, which is most of a step's time on the CPU (a step of 8 rows over ~250 cached tokens: 28 ms,
of which the expansion and its copies are about half).

SGLang computes MLA the other way wherever keys are cached (the absorbed path of
DeepseekV2AttentionMLA): the key half of kv_b_proj is folded into the query and the value half
applied after the attention, so the scores and the weighted sum read the cached latents directly,
one shared "head" for all query heads. Its dispatch (attention_backend_handler.py,
handle_attention_triton, which the CPU backend falls back to) takes the expanded form only for a
prefill with nothing cached before it. Here the same rule: a forward whose cache is empty (a
prompt, or its first prefill chunk) runs transformers' own code; one that extends a cache (a later
prefill chunk, a decode step, EAGLE's verify) the absorbed form. Both compute the same function
and round differently in fp32's last bits.
"""

from __future__ import annotations

import types

import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf


def absorb_mla(model: torch.nn.Module) -> int:
    """Give every MLA layer of `model` the absorbed path where keys are cached -> the number of
    layers changed."""
    layers = [m for m in model.modules() if isinstance(m, hf.DeepseekV3Attention)]
    for layer in layers:
        layer.forward = types.MethodType(_forward, layer)
    return len(layers)


def _forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kw):
    if past_key_values is None or past_key_values.get_seq_length(self.layer_idx) == 0:
        return hf.DeepseekV3Attention.forward(
            self, hidden_states, position_embeddings, attention_mask, past_key_values, **kw
        )
    b, t = hidden_states.shape[:2]
    h, nope, rope, r = (
        self.num_heads,
        self.qk_nope_head_dim,
        self.qk_rope_head_dim,
        self.kv_lora_rank,
    )
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
    q_nope, q_rot = q.view(b, t, h, nope + rope).transpose(1, 2).split([nope, rope], dim=-1)
    latent, k_rot = self.kv_a_proj_with_mqa(hidden_states).split([r, rope], dim=-1)
    latent = self.kv_a_layernorm(latent).view(b, 1, t, r)
    k_rot = k_rot.view(b, 1, t, rope)
    cos, sin = position_embeddings
    rotate = (
        hf.apply_rotary_pos_emb_interleave
        if self.config.rope_interleave
        else hf.apply_rotary_pos_emb
    )
    q_rot, k_rot = rotate(q_rot, k_rot, cos, sin)
    # the cache holds latents (b, 1, s, r) and rotated keys (b, 1, s, rope), as transformers does
    latent, k_rot = past_key_values.update(latent, k_rot, self.layer_idx)
    s = latent.shape[2]
    w = self.kv_b_proj.weight.view(h, nope + self.v_head_dim, r)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # (h, nope, r), (h, v, r)
    q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_uk)  # the key's expansion, folded in
    latent, k_rot = latent.view(b, s, r), k_rot.view(b, s, rope)
    scores = q_latent.reshape(b, h * t, r) @ latent.transpose(1, 2)  # (b, h*t, s)
    scores = scores + q_rot.reshape(b, h * t, rope) @ k_rot.transpose(1, 2)
    scores = scores.view(b, h, t, s) * self.scaling  # (b, h, t, s)
    scores = _masked(scores, attention_mask, t, s)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(latent.dtype)
    context = probs.view(b, h * t, s) @ latent  # (b, h*t, r): the weighted latents
    out = torch.einsum("bhtr,hvr->bthv", context.view(b, h, t, r), w_uv)  # the value's expansion
    return self.o_proj(out.reshape(b, t, h * self.v_head_dim)), None


def _masked(scores: torch.Tensor, mask: torch.Tensor | None, t: int, s: int) -> torch.Tensor:
    """Scores (b, h, t, s) with what the layer's mask hides at -inf. transformers hands an SDPA
    layer a boolean mask (True: attend), an eager one an additive mask, or None where nothing is
    hidden but the causal order, which with a cache ends at the last `t` of `s` keys."""
    if mask is None:
        if t == 1:
            return scores
        future = torch.ones(t, s, dtype=torch.bool).triu(s - t + 1)
        return scores.masked_fill(future, float("-inf"))
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask[..., :s], float("-inf"))
    return scores + mask[..., :s]
