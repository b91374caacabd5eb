"""A tiny random LlamaForCausalLM checkpoint that real SGLang 0.5.23 serves on this machine's CPU.

    # config.json, safetensors shards, tokenizer
    folder = write_tiny_llama(tmp_path / "tiny-llama")

The shapes respect SGLang's CPU kernels (../shared/docs/sglang-cpu.md): attention head size 64 (a
multiple of 32), plain RoPE, bf16 weights. The tokenizer, its chat template and generation config
are fixtures/tiny-target's (vocabulary 4096), so fixtures/data/conversations.jsonl tokenizes as it
does for the default target. Weights are random from a fixed seed; the checkpoint is split into
several shards so SGLang's loading bar has more than one step for the readiness sensor to read.
"""

from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER_SOURCE = ROOT / "fixtures" / "tiny-target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")

# 8 layers, so local-tiny's capture ids [2, 4, 5] (capture-before) apply unchanged.
TINY_LLAMA = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=2,
)


def write_tiny_llama(folder: str | Path, *, seed: int = 0, max_shard_size: str = "2MB") -> Path:
    """Write the checkpoint into `folder` (created; must be empty or absent) and return it."""
    import torch
    import transformers

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        raise ValueError(f"{folder}: not empty; write_tiny_llama wants a new folder")
    head = TINY_LLAMA["head_dim"]
    if head % 32:
        raise ValueError(f"head_dim {head}: SGLang's CPU attention kernels want a multiple of 32")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**TINY_LLAMA)
    # A larger init than the default 0.02 keeps the residual stream's layers distinguishable
    # (a comparison of captured layers then means something) without overflowing bf16.
    config.initializer_range = 0.05
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_SOURCE / name, folder / name)
    return folder


if __name__ == "__main__":
    import sys

    print(write_tiny_llama(sys.argv[1]))
