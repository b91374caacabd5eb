"""A thinking target for tests: a random tiny DeepSeek-V3 that speaks Kimi-K2.5's chat format.

    # config, safetensors shards, tokenizer, Kimi's template
    folder = thinking_target(tmp_path)
    tok = AutoTokenizer.from_pretrained(folder)   # <think> and </think> are one special token each

The tokenizer is word-level (w<i> words) with Kimi-K2.5's special tokens, and its chat template is
fixtures/kimi-k2.5's, so regeneration renders prompts exactly as for the real target, thinking
switch and history rules included. `eyas serve-local --think-tokens N` makes its replies reason. The
output rows of the special tokens are zero, so greedy decoding never picks one by itself (random
logits of the words are above 0 somewhere): replies are words, which decode and encode back to the
same ids.
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPECIALS = (
    "[BOS]",
    "[EOS]",
    "[UNK]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
)
VOCAB = 512
CONFIG = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    max_position_embeddings=2048,
    bos_token_id=0,
    eos_token_id=1,
)


def kimi_template() -> str:
    return json.loads((ROOT / "fixtures" / "kimi-k2.5" / "tokenizer_config.json").read_text())[
        "chat_template"
    ]


def write_tokenizer(folder: Path, template: str | None = None) -> None:
    """tokenizer.json and tokenizer_config.json: SPECIALS as ids 0..9, then the words w10..w511."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {
        **{t: i for i, t in enumerate(SPECIALS)},
        **{f"w{i}": i for i in range(len(SPECIALS), VOCAB)},
    }
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "[BOS]",
                "eos_token": "[EOS]",
                "unk_token": "[UNK]",
                "model_max_length": 2048,
                "clean_up_tokenization_spaces": False,
                "additional_special_tokens": list(SPECIALS[3:]),
                "chat_template": kimi_template() if template is None else template,
            }
        )
    )
    # The turn ends with <|im_end|>: the server stops there as SGLang does with generation_config's
    # eos.
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [1, 3], "bos_token_id": 0})
    )


def thinking_target(folder: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**CONFIG))
    with torch.no_grad():
        model.lm_head.weight[: len(SPECIALS)] = 0.0
    model.save_pretrained(folder, max_shard_size="200KB")
    write_tokenizer(folder)
    return folder
