"""The EAGLE-3 draft checkpoint SGLang's `LlamaForCausalLMEagle3` loads: its shape, weight names and
config.

    dcfg = DrafterConfig(hidden_size=256, target_hidden_size=256, num_attention_heads=4, ...)
    # {"fc.weight": ([H, 3 * H_target], None), ..., "d2t": (..., int64)}
    expected_weights(dcfg)
    sglang_config(dcfg, [2, 4, 5], "bfloat16", provenance={...})   # config.json's content

One home for the format, below every stage: training builds its drafter from DrafterConfig, export
writes trained weights in it (eyas/evaluation/export.py), and the capture launch of an SGLang
without capture-only mode writes a stub draft in it (eyas/server/capture_draft.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eyas.errors import InvalidInput


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
            raise InvalidInput(
                f"DrafterConfig: num_attention_heads={self.num_attention_heads} is not a "
                f"multiple of num_key_value_heads={self.num_key_value_heads}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise InvalidInput(
                f"DrafterConfig: draft_vocab_size={self.draft_vocab_size} exceeds the "
                f"target vocab_size={self.vocab_size}"
            )
        if self.head_dim % 2:
            raise InvalidInput(f"DrafterConfig: head_dim={self.head_dim} must be even for RoPE")


def expected_weights(dcfg: DrafterConfig) -> dict[str, tuple[list[int], torch.dtype | None]]:
    """SGLang's weight names and shapes for this drafter (dtype None = the export dtype)."""
    H, nh, nkv, hd, inter = (
        dcfg.hidden_size,
        dcfg.num_attention_heads,
        dcfg.num_key_value_heads,
        dcfg.head_dim,
        dcfg.intermediate_size,
    )
    a, m = "midlayer.self_attn.", "midlayer.mlp."
    return {
        "fc.weight": ([H, dcfg.num_aux * dcfg.target_hidden_size], None),
        a + "q_proj.weight": ([nh * hd, 2 * H], None),
        a + "k_proj.weight": ([nkv * hd, 2 * H], None),
        a + "v_proj.weight": ([nkv * hd, 2 * H], None),
        a + "o_proj.weight": ([H, nh * hd], None),
        m + "gate_proj.weight": ([inter, H], None),
        m + "up_proj.weight": ([inter, H], None),
        m + "down_proj.weight": ([H, inter], None),
        "midlayer.input_layernorm.weight": ([H], None),
        "midlayer.hidden_norm.weight": ([H], None),
        "midlayer.post_attention_layernorm.weight": ([H], None),
        "norm.weight": ([H], None),
        "lm_head.weight": ([dcfg.draft_vocab_size, H], None),
        "d2t": ([dcfg.draft_vocab_size], torch.int64),
        "t2d": ([dcfg.vocab_size], torch.bool),
    }


def sglang_config(
    dcfg: DrafterConfig, capture_ids: list[int], dtype: str, provenance: dict
) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": dcfg.hidden_size,
        "target_hidden_size": dcfg.target_hidden_size,
        "num_attention_heads": dcfg.num_attention_heads,
        "num_key_value_heads": dcfg.num_key_value_heads,
        "head_dim": dcfg.head_dim,
        "intermediate_size": dcfg.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": dcfg.vocab_size,
        "draft_vocab_size": dcfg.draft_vocab_size,
        "rms_norm_eps": dcfg.rms_norm_eps,
        "rope_theta": dcfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": dcfg.max_position_embeddings,
        "tie_word_embeddings": False,  # SGLang would otherwise use the embedding as lm_head
        "attention_bias": False,
        "torch_dtype": dtype,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(capture_ids),
            "use_aux_hidden_state": True,
        },
        "eyas": provenance,
    }
