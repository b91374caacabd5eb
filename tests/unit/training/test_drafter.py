import pytest
import torch
import torch.nn.functional as F

from eyas.evaluation.export import expected_weights
from eyas.training.drafter import (
    DrafterConfig,
    Eagle3Drafter,
    KVCache,
    apply_rope,
    causal_mask,
    rope_cos_sin,
    ttt_mask,
)
from tests.helpers_training import shift_left

torch.set_num_threads(1)


def tiny(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=32,
        target_hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=64,
        draft_vocab_size=40,
    )
    return DrafterConfig(**{**base, **kw})


def make(seed=0, **kw):
    torch.manual_seed(seed)
    m = Eagle3Drafter(tiny(**kw)).eval()
    with torch.no_grad():  # non-trivial norms, so a swapped norm would show
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        m.embed_tokens.weight.normal_()
    return m


def inputs(m, B=2, T=9, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, m.cfg.vocab_size, (B, T), generator=g)
    aux = torch.randn(B, T, 3 * m.cfg.target_hidden_size, generator=g)
    return ids, aux


def ttt_unroll(m, ids, aux, steps):
    """The training unroll through the plain model: step k reads token t+1+k and the previous step's
    output at t, and attends to the earlier steps' keys in a KVCache under ttt_mask."""
    T = ids.shape[1]
    h, cache, outs = aux, KVCache(), []
    for k in range(steps):
        logits, h = m(shift_left(ids, 1 + k), h, torch.arange(T) + k, ttt_mask(T, k), cache)
        outs.append(logits)
    return outs


def test_state_dict_uses_sglang_names_and_shapes():
    m = make()
    sd = m.state_dict()
    want = expected_weights(m.cfg)
    assert set(sd) == set(want) | {"embed_tokens.weight"}
    for name, (shape, dtype) in want.items():
        assert list(sd[name].shape) == shape, name
        if dtype is not None:
            assert sd[name].dtype == dtype
    assert not m.embed_tokens.weight.requires_grad
    assert "embed_tokens.weight" not in m.trainable_state_dict()


def test_ttt_step_k_equals_incremental_drafting_with_a_kv_cache():
    """What training optimises is exactly what drafting at inference computes, step by step."""
    m = make()
    ids, aux = inputs(m, B=1, T=9)
    K = 3
    with torch.no_grad():
        train_logits = ttt_unroll(m, ids, aux, K)
        for t in [0, 3, 5]:
            cache = KVCache()  # prefill positions 0..t, then draft one token at a time
            logits, h = m(
                ids[:, 1 : t + 2],
                aux[:, : t + 1],
                torch.arange(t + 1),
                causal_mask(t + 1),
                cache=cache,
            )
            torch.testing.assert_close(logits[0, -1], train_logits[0][0, t], atol=1e-5, rtol=1e-5)
            h = h[:, -1:]
            for k in range(1, K):
                logits, h = m(
                    ids[:, t + 1 + k : t + 2 + k],
                    h,
                    torch.tensor([t + k]),
                    causal_mask(1, len(cache)),
                    cache=cache,
                )
                torch.testing.assert_close(
                    logits[0, -1], train_logits[k][0, t], atol=1e-5, rtol=1e-5
                )


def test_ttt_is_causal():
    m = make()
    ids, aux = inputs(m)
    t = 4
    ids2, aux2 = ids.clone(), aux.clone()
    ids2[:, t + 1 :] = (
        ids2[:, t + 1 :] + 7
    ) % m.cfg.vocab_size  # changes tokens step 0 reads after t
    aux2[:, t + 1 :] += 3.0
    with torch.no_grad():
        a, b = ttt_unroll(m, ids, aux, 3), ttt_unroll(m, ids2, aux2, 3)
    for k in range(3):  # step k at t reads token t+1+k, so only positions < t-k are untouched
        torch.testing.assert_close(a[k][:, : t - k], b[k][:, : t - k])
        assert not torch.allclose(a[k][:, t], b[k][:, t])


def test_step0_attention_is_plain_causal_attention():
    m = make()
    attn, T = m.midlayer.self_attn, 6
    x = torch.randn(2, T, 2 * m.cfg.hidden_size)
    cos, sin = rope_cos_sin(torch.arange(T), m.cfg.head_dim, m.cfg.rope_theta)
    with torch.no_grad():
        got = attn(x, cos, sin, causal_mask(T))
        q = attn.q_proj(x).view(2, T, 4, 8).transpose(1, 2)
        k = attn.k_proj(x).view(2, T, 2, 8).transpose(1, 2)
        v = attn.v_proj(x).view(2, T, 2, 8).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True
        )
        want = attn.o_proj(y.transpose(1, 2).reshape(2, T, 32))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rope_matches_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8, rope_theta=5000.0)
    pos = torch.arange(7)[None]
    x = torch.randn(1, 4, 7, 8)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, pos)
    want, _ = apply_rotary_pos_emb(x, x, cos, sin)
    c2, s2 = rope_cos_sin(pos[0], 8, 5000.0)
    torch.testing.assert_close(apply_rope(x, c2, s2), want)


def test_fc_only_reads_the_target_states():
    m = make()
    ids, aux = inputs(m, T=3)
    with torch.no_grad():
        _, h = m(ids, aux, torch.arange(3), causal_mask(3))
        assert h.shape == (2, 3, 32)
        logits, _ = m(ids, h, torch.arange(3), causal_mask(3))  # H-wide input: fc is skipped
    assert logits.shape == (2, 3, 40)


def test_ttt_mask_is_causal_over_step_0_and_diagonal_over_the_later_steps():
    m = ttt_mask(4, 2)[0, 0]  # (T, 3T)
    assert m.shape == (4, 12)
    seen = m == 0
    assert torch.equal(seen[:, :4], torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(seen[:, 4:8], torch.eye(4, dtype=torch.bool)) and torch.equal(
        seen[:, 8:], seen[:, 4:8]
    )
    assert torch.equal(ttt_mask(5, 0), causal_mask(5))


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        tiny(num_key_value_heads=3)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        tiny(draft_vocab_size=65)
